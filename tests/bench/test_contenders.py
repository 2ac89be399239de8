"""The sweep's engines: their KV pool sizing."""

from __future__ import annotations

from pathlib import Path


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
