"""Token streams and the windows the trainer reads from them.

Each corpus file becomes ``BOS ids EOS``; the files of one split are concatenated into one stream
(documents are packed, attention crosses their boundaries as in most pre-training). The whole
stream lives on the training device and a batch is a gather of windows, so no loader process is
needed to keep a GPU busy.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerFast


def encode_texts(
    tokenizer: PreTrainedTokenizerFast, texts: Iterable[str], files_per_batch: int = 2048
) -> np.ndarray:
    """One stream of ``BOS ids EOS`` per text, concatenated; uint16 when the vocabulary fits.

    Batches go through the Rust tokenizer's parallel ``encode_batch_fast`` (all cores).
    """
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if bos is None or eos is None:
        raise ValueError("tokenizer needs BOS and EOS tokens")
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.int32
    backend = tokenizer.backend_tokenizer
    parts: list[np.ndarray] = []

    def flush(batch: list[str]) -> None:
        for enc in backend.encode_batch_fast(batch, add_special_tokens=False):
            ids = np.empty(len(enc.ids) + 2, dtype=dtype)
            ids[0], ids[-1] = bos, eos
            ids[1:-1] = enc.ids
            parts.append(ids)

    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) >= files_per_batch:
            flush(batch)
            batch = []
    if batch:
        flush(batch)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def save_tokens(tokens: np.ndarray, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, tokens)
    tmp.replace(path)


def load_tokens(path: Path) -> np.ndarray:
    return np.load(path)


class WindowSampler:
    """Training batches: shuffled, non-overlapping windows of ``seq_len`` tokens, epoch after epoch.

    Epoch ``e`` shifts the window grid by a random offset and visits the windows in a random
    order, both drawn from ``(seed, e)``; batch ``step`` is windows ``step*B … step*B+B-1`` of
    that endless sequence. A batch is thus a pure function of ``(seed, step)``, which makes
    resuming exact without saving any sampler state.
    """

    def __init__(
        self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, device: torch.device
    ) -> None:
        if seq_len < 2 or batch_size < 1:
            raise ValueError(f"need seq_len >= 2 and batch_size >= 1, got {seq_len}, {batch_size}")
        self.num_windows = (len(tokens) - seq_len) // seq_len  # room for the shift
        if self.num_windows < 1:
            raise ValueError(
                f"training stream has {len(tokens)} tokens, too few for windows of {seq_len}"
            )
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.device = device
        self.tokens = torch.from_numpy(tokens.astype(np.int32)).to(device)  # [N]
        self._offsets = torch.arange(seq_len, device=device)  # [T]
        self._epochs: dict[int, tuple[int, torch.Tensor]] = {}

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def _epoch(self, epoch: int) -> tuple[int, torch.Tensor]:
        if epoch not in self._epochs:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            shift = int(torch.randint(self.seq_len, (1,), generator=gen))
            order = torch.randperm(self.num_windows, generator=gen)
            if len(self._epochs) > 2:
                self._epochs.pop(min(self._epochs))
            self._epochs[epoch] = (shift, order)
        return self._epochs[epoch]

    def window_starts(self, step: int) -> torch.Tensor:
        """Start offsets ``[B]`` (CPU, int64) of the windows of batch ``step``."""
        starts = torch.empty(self.batch_size, dtype=torch.int64)
        for j in range(self.batch_size):
            epoch, i = divmod(step * self.batch_size + j, self.num_windows)
            shift, order = self._epoch(epoch)
            starts[j] = shift + int(order[i]) * self.seq_len
        return starts

    def batch(self, step: int) -> torch.Tensor:
        """Token ids ``[B, T]`` (int64, on the device) of batch ``step``."""
        starts = self.window_starts(step).to(self.device, non_blocking=True)
        return self.tokens[starts[:, None] + self._offsets].long()

    def epochs_at(self, step: int) -> float:
        return step * self.batch_size / self.num_windows


def eval_windows(tokens: np.ndarray, seq_len: int, max_windows: int) -> torch.Tensor:
    """Fixed held-out windows ``[n, T]`` (CPU, int64): consecutive, non-overlapping, from the
    start of the stream; ``T`` is ``seq_len`` or the whole stream when that is shorter."""
    if len(tokens) < 2:
        raise ValueError("the held-out split is empty: raise heldout_fraction or add files")
    length = min(seq_len, len(tokens))
    n = min(max_windows, len(tokens) // length)
    return torch.from_numpy(tokens[: n * length].astype(np.int64)).view(n, length)


def iter_batches(windows: torch.Tensor, batch_size: int) -> Iterator[torch.Tensor]:
    for i in range(0, windows.shape[0], batch_size):
        yield windows[i : i + batch_size]
