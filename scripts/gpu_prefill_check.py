"""Graphed (padded) prefill against the eager one on CUDA, and what it saves.

    PYTHONPATH=. python scripts/gpu_prefill_check.py OUT [--model models/demo]

1. float32: greedy tokens of an engine whose prefill runs through the captured padded shapes
   (``engine/cuda_graphs.py``) equal those of an engine with the static path off, for prompts
   of several lengths in one batch; the hidden states of one prefill agree to float32 rounding.
2. bfloat16: time of one prefill step (prompt of 16 / 64 / 200 tokens, and 16 prompts of 64)
   through the graph and eagerly, median of 20.
Writes OUT/prefill-check.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine.batch_builder import SeqRows, build_batch, causal_mask
from engine.kv.block_pool import BlockOwner

DEVICE = "cuda"


def _sync() -> None:
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def _engine(model: str, dtype: str, static: bool) -> LLMEngine:
    return LLMEngine.from_pretrained(
        model, device=DEVICE, dtype=dtype, spec=SpecConfig(method="none"),
        engine_config=EngineConfig(cuda_graphs=static, max_batch_size=16),
    )  # fmt: skip


def _rows(eng: LLMEngine, lengths: list[int]) -> tuple[list[SeqRows], list[list[int]]]:
    per_seq = -(-max(lengths) // eng.pool.block_size) + 1
    blocks = eng.pool.allocate(per_seq * len(lengths), BlockOwner("prefill-check"))
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, eng.model_config.vocab_size, (n,), generator=gen).tolist()
        rows.append(SeqRows(blocks[i * per_seq : (i + 1) * per_seq], 0, ids, list(range(n)), causal_mask(n)))
    return rows, [blocks]


@torch.inference_mode()
def _time_prefill(eng: LLMEngine, lengths: list[int]) -> dict[str, float]:
    static = eng.static_forward
    assert static is not None
    rows, held = _rows(eng, lengths)
    shape = static.prefill_shape(rows)
    out: dict[str, float] = {"graph_shape": float(shape[0] * shape[1]) if shape else 0.0}
    for name in ("graphed", "eager"):
        times = []
        for _ in range(23):
            _sync()
            start = time.perf_counter()
            if name == "graphed" and shape is not None:
                static.run_prefill(rows, shape)
            else:
                ids, batch = build_batch(rows, eng.pool.block_size, eng.device)
                eng.model.forward_target(ids, batch, eng.pool.kv_cache)
            _sync()
            times.append(time.perf_counter() - start)
        out[f"{name}_ms"] = 1e3 * statistics.median(times[3:])
    for blocks in held:
        eng.pool.free(blocks)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--model", default="models/demo")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (eager)")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    result: dict[str, object] = {"model": args.model}
    prompts = [[(7 * i + j) % 4000 + 3 for j in range(n)] for i, n in enumerate([5, 17, 64, 64, 130, 300, 9, 40])]
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    graphed, eager = _engine(args.model, "float32", True), _engine(args.model, "float32", False)
    a, b = graphed.generate(prompts, greedy), eager.generate(prompts, greedy)
    result["float32_tokens_identical"] = [x.token_ids for x in a] == [y.token_ids for y in b]
    with torch.inference_mode():
        rows, held = _rows(graphed, [37, 64, 5])
        shape = graphed.static_forward.prefill_shape(rows)  # type: ignore[union-attr]
        assert shape is not None
        h_graph = graphed.static_forward.run_prefill(rows, shape)  # type: ignore[union-attr]
        ids, batch = build_batch(rows, graphed.pool.block_size, graphed.device)
        h_eager = graphed.model.forward_target(ids, batch, graphed.pool.kv_cache)
        result["float32_hidden_max_abs_diff"] = float((h_graph - h_eager).abs().max())
        for blocks in held:
            graphed.pool.free(blocks)
    del graphed, eager
    eng = _engine(args.model, "bfloat16", True)
    result["bfloat16_prefill"] = {
        label: _time_prefill(eng, lengths)
        for label, lengths in {"1x16": [16], "1x64": [64], "1x200": [200], "16x64": [64] * 16}.items()
    }
    print(json.dumps(result, indent=2))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "prefill-check.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
