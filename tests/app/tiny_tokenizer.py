"""A character-level tokenizer for tiny random test checkpoints (fallback for e2e tests)."""

from __future__ import annotations

import string
from pathlib import Path


def write_char_tokenizer(folder: Path, vocab_size: int, bos_id: int = 0, eos_id: int = 1) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = {bos_id: "<s>", eos_id: "</s>"}
    vocab = {name: i for i, name in specials.items()}
    vocab["<unk>"] = max(vocab.values()) + 1
    chars = " " + string.ascii_lowercase + string.ascii_uppercase + string.digits + ".,!?'-:;()"
    for c in chars:
        if len(vocab) >= vocab_size:
            break
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(str(folder))
