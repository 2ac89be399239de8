"""Host cost of a graphed speculative step whose batch changed (a diagnosis tool).

A closed batch of requests with different ``max_tokens`` decodes with the graphed chain step
(CUDA graphs on a GPU, the same code eagerly on a CPU); as requests finish, every step's batch
differs from the last one's. Prints the median host time of the engine's split of the batch
(``LLMEngine._split_graphed``: eligibility checks) and of the step's input load
(``GraphedTreeStep._load_inputs``) over the steps whose batch changed at 128 sequences or more,
with the survivors gathered on the device (the engine's path) or, with ``--reload``, with every
sequence loaded from the host again (the path before the gather).

    PYTHONPATH=. python scripts/batch_change_cost.py [--device cpu] [--batch 256] [--reload]

Without ``--model`` it decodes a tiny random checkpoint (``tests/model_factory.py``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine.spec import graphed_state
from engine.spec.graphed_tree import GraphedTreeStep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--reload", action="store_true", help="load every sequence from the host")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.model) if args.model else _tiny_checkpoint(Path(tmp))
        eng = LLMEngine.from_pretrained(
            folder, device=args.device, dtype="float32" if args.device == "cpu" else "bfloat16",
            spec=SpecConfig(method="chain", num_draft_tokens=4),
            engine_config=EngineConfig(max_batch_size=args.batch, cuda_graphs=True, prefill_chunk_tokens=8192),
        )  # fmt: skip
        if args.reload:
            graphed_state.SteadyRows.rows_of = lambda self, seqs: [-1] * len(seqs)  # type: ignore[method-assign]
        split_ms, load_ms = _measure(eng, args.batch)
    path = "reload from the host" if args.reload else "survivors gathered on the device"
    print(f"{path}: {len(load_ms)} changed steps at >= {args.batch // 2} sequences; "
          f"split {statistics.median(split_ms):.2f} ms, load {statistics.median(load_ms):.2f} ms (medians)")


def _tiny_checkpoint(tmp: Path) -> Path:
    from tests.model_factory import build_checkpoint  # noqa: PLC0415 (needs the repository root)

    return build_checkpoint(tmp / "tiny", seed=0, vocab_size=64, num_nextn_predict_layers=4)


def _measure(eng: LLMEngine, batch: int) -> tuple[list[float], list[float]]:
    """Two rounds (the first warms up); the second's timings of changed steps, in ms."""
    runner = eng.graphed_tree
    assert runner is not None, "the chain step is not graphed on this engine"
    split_ms: list[float] = []
    load_ms: list[float] = []
    split, load = eng._split_graphed, runner._load_inputs

    def timed_split(fast: GraphedTreeStep, seqs: list) -> tuple[list, list]:  # type: ignore[type-arg]
        changed = not fast.continues(seqs)
        start = time.perf_counter()
        result = split(fast, seqs)
        if changed and len(seqs) >= batch // 2:
            split_ms.append((time.perf_counter() - start) * 1e3)
        return result

    def timed_load(buf: object, seqs: list) -> list[int]:  # type: ignore[type-arg]
        changed = not runner.continues(seqs)
        start = time.perf_counter()
        result = load(buf, seqs)  # type: ignore[arg-type]
        if changed and len(seqs) >= batch // 2:
            load_ms.append((time.perf_counter() - start) * 1e3)
        return result

    eng._split_graphed = timed_split  # type: ignore[method-assign]
    runner._load_inputs = timed_load  # type: ignore[method-assign]
    for round_ in range(2):
        split_ms.clear()
        load_ms.clear()
        for i in range(batch):
            prompt = [(i * 7 + j) % 60 + 1 for j in range(16)]
            params = SamplingParams(max_tokens=8 + i % 32, temperature=0.0, ignore_eos=True)
            eng.add_request(f"{round_}-{i}", prompt, params)
        with eng.closed_batch():
            while eng.has_unfinished_requests():
                eng.step()
    return split_ms, load_ms


if __name__ == "__main__":
    main()
