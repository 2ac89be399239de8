"""A byte-level BPE tokenizer trained on the corpus's training split.

Saved as a ``transformers`` fast tokenizer (``tokenizer.json`` + ``tokenizer_config.json``), so
``AutoTokenizer.from_pretrained(folder)`` loads it. Plain ``tokenizer(text)`` prepends BOS, as the
training documents start with BOS; the chat template starts with BOS itself (chat templates are
tokenized without special tokens) and ends each turn with EOS, so EOS is the only stop token.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (BOS, EOS, PAD, *ROLE_TOKENS)  # ids 0..5 in this order

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, min_frequency: int = 2
) -> PreTrainedTokenizerFast:
    """Train byte-level BPE on ``texts`` and wrap it as a transformers fast tokenizer.

    The 256 byte symbols are always in the vocabulary, so any text round-trips.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size must exceed {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return wrap(tok)


def wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        clean_up_tokenization_spaces=False,
        model_max_length=1_000_000,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, folder: Path) -> None:
    """Save so that transformers 4.x and 5.x load it: the generic fast-tokenizer class name and
    the chat template inside ``tokenizer_config.json`` too (5.x also writes ``chat_template.jinja``)."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(folder))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    tok = AutoTokenizer.from_pretrained(str(folder))
    if not isinstance(tok, PreTrainedTokenizerFast):
        raise ValueError(f"tokenizer in {folder} is not a fast (tokenizers) tokenizer")
    if tok.bos_token_id is None or tok.eos_token_id is None:
        raise ValueError(f"tokenizer in {folder} lacks BOS/EOS")
    return tok


def sample_texts(texts: Iterable[str], max_bytes: int) -> Iterator[str]:
    """The first texts whose UTF-8 sizes add up to at most ``max_bytes`` (tokenizer training set)."""
    used = 0
    for text in texts:
        size = len(text.encode("utf-8"))
        if used + size > max_bytes:
            if used == 0:
                yield text[:max_bytes]
            return
        used += size
        yield text
