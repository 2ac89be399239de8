"""The sweep's engines: their KV pool sizing."""

from __future__ import annotations

from pathlib import Path

import torch


def test_kv_pool_of_a_small_sweep_leaves_room_for_static_padding(dense_model_dir: Path) -> None:
    """A sweep of batch 1 alone once sized a pool smaller than a CUDA-graph engine's padding
    blocks (KVCacheFull at start-up on the H200): pools are at least MIN_KV_BYTES."""
    from bench.contenders import MIN_KV_BYTES, kv_bytes_for
    from engine import EngineConfig, LLMEngine, SpecConfig

    eng = LLMEngine.from_pretrained(str(dense_model_dir), device="cpu", spec=SpecConfig(method="none"),
                                    engine_config=EngineConfig(max_batch_size=1, kv_memory_bytes=MIN_KV_BYTES))  # fmt: skip
    assert kv_bytes_for(eng, 1, 16) == MIN_KV_BYTES
    big = kv_bytes_for(eng, 4096, 4096)
    assert big > MIN_KV_BYTES and kv_bytes_for(eng, 8192, 4096) > 1.9 * big


def test_the_sweeps_adaptive_engine_expects_what_the_model_folder_recorded() -> None:
    """The sweep builds its engines around one loaded model, not through ``from_pretrained``; its
    adaptive engine had run on the generic default prior, unlike a served one."""
    from bench.contenders import build_contenders, load_base
    from bench.modes import build_modes
    from engine.spec.acceptance_prior import DEFAULT_PRIOR, acceptance_prior

    folder = str(Path(__file__).resolve().parents[2] / "models" / "demo")
    base = load_base(folder, "cpu", "float32", 1, 32, None)
    contenders, skipped = build_contenders(folder, base, build_modes(["adaptive"], [32]), torch.float32)
    assert not skipped
    adaptive = next(c.engine for c in contenders if c.mode.mode == "adaptive")
    assert adaptive is not None and adaptive.adaptive is not None
    assert adaptive.adaptive.prior == acceptance_prior(folder)
    assert adaptive.adaptive.prior[False] != DEFAULT_PRIOR
