"""The tokenizer loads with transformers, frames documents with BOS and round-trips code."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from train.tokenizer import BOS, EOS, sample_texts, save_tokenizer, train_tokenizer

CODE = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\n\nfor name in os.listdir('.'):\n    print(name)\n",
] * 30


def test_autotokenizer_loads_it_with_bos_eos_and_chat_template(tmp_path: Path) -> None:
    tok = train_tokenizer(CODE, vocab_size=400)
    save_tokenizer(tok, tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert loaded.bos_token == BOS and loaded.eos_token == EOS
    assert len(loaded) <= 400
    text = "def add(a, b):\n    return a + b\n\tünïcode = '€'\n"
    ids = loaded(text).input_ids
    assert ids[0] == loaded.bos_token_id
    assert loaded.decode(ids, skip_special_tokens=True) == text
    chat = loaded.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == f"{BOS}<|user|>\nhi{EOS}\n<|assistant|>\n"


def test_bpe_learns_merges_for_code() -> None:
    tok = train_tokenizer(CODE, vocab_size=400)
    text = "    def __init__(self, x, y):\n"
    assert len(tok(text, add_special_tokens=False).input_ids) < len(text.encode()) / 2


def test_sample_texts_stops_at_the_byte_budget() -> None:
    taken = list(sample_texts(["a" * 10, "b" * 10, "c" * 10], max_bytes=25))
    assert taken == ["a" * 10, "b" * 10]
