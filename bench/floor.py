"""The GPU floor of a decode step: what the hardware could do at best, measured, not quoted.

Rates are measured on the device: copy bandwidth from a large device-to-device copy (bytes read
plus bytes written per second), matmul rate from an 8192^3 bf16 matmul (CUDA events, median of
several). A step must read the weights it touches and the KV it attends to, and do the matmul
FLOPs of every token it runs (target forward over root + draft nodes, plus the MTP draft
forwards); its floor is the larger of bytes / bandwidth and FLOPs / matmul rate. The benchmark
reports measured step time / floor (1.0 would be perfect).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.model.deepseek_v3 import DeepseekV3ForCausalLM


def _time_cuda_ms(fn: Any, repeats: int = 10) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _copy_ms(dev: torch.device, nbytes: int) -> float:
    src = torch.randn(nbytes // 2, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return _time_cuda_ms(lambda: dst.copy_(src))


def _matmul_ms(dev: torch.device, n: int) -> float:
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    return _time_cuda_ms(lambda: a @ b)


def measure_rates(device: str, copy_bytes: int = 1 << 30, n: int = 8192) -> dict[str, float]:
    """Measured ``copy_gbps`` (read + write) and ``matmul_tflops`` (bf16) of the device."""
    dev = torch.device(device)
    copy_ms = _copy_ms(dev, copy_bytes)
    mm_ms = _matmul_ms(dev, n)
    torch.cuda.empty_cache()
    return {"copy_gbps": 2 * copy_bytes / copy_ms / 1e6, "matmul_tflops": 2 * n**3 / mm_ms / 1e9}


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def model_sizes(model: DeepseekV3ForCausalLM) -> dict[str, int]:
    """Parameter counts the floor needs: target layers, one MTP module, lm_head, routed experts."""
    cfg = model.config
    main = sum(_numel(layer) for layer in model.main_layers) + _numel(model.model.norm)
    mtp = [_numel(model.mtp_layer(d)) for d in range(1, cfg.num_nextn_predict_layers + 1)]
    routed = 0
    for name, p in model.named_parameters():
        if ".mlp.experts." in name and name.startswith("model.layers.") and int(name.split(".")[2]) < cfg.num_hidden_layers:
            routed += p.numel()
    return {"main": main, "mtp_mean": sum(mtp) // max(len(mtp), 1), "head": model.lm_head.weight.numel(),
            "routed_main": routed, "n_routed_experts": int(getattr(cfg, "n_routed_experts", 0) or 0),
            "experts_per_tok": int(getattr(cfg, "num_experts_per_tok", 0) or 0)}


def step_floor(
    model: DeepseekV3ForCausalLM,
    rates: dict[str, float],
    batch: int,
    tokens_per_seq: float,  # target tokens per sequence and step: 1 + draft nodes
    draft_depth: float,  # MTP forwards per step (0 for autoregressive)
    ctx: int,  # average committed context per sequence
    dtype_bytes: int,
) -> dict[str, float]:
    """Bytes, FLOPs and floor time (ms) of one decode step of ``batch`` sequences."""
    cfg = model.config
    sizes = model_sizes(model)
    tokens = batch * tokens_per_seq
    dense = sizes["main"] - sizes["routed_main"]
    if sizes["n_routed_experts"]:
        touched = min(1.0, tokens * sizes["experts_per_tok"] / sizes["n_routed_experts"])
    else:
        touched = 0.0
    weights = dense + sizes["routed_main"] * touched + sizes["head"]
    weights += draft_depth * (sizes["mtp_mean"] + sizes["head"])
    kv_entry = cfg.latent_dim * dtype_bytes
    kv_bytes = batch * ctx * kv_entry * (cfg.num_hidden_layers + draft_depth)
    bytes_ = weights * dtype_bytes + kv_bytes
    attn = 2 * cfg.num_attention_heads * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim) * ctx
    flops = tokens * (2 * (dense + sizes["head"]) + 2 * sizes["routed_main"] * (
        sizes["experts_per_tok"] / max(sizes["n_routed_experts"], 1)) + attn * cfg.num_hidden_layers)
    # every draft node comes out of one MTP forward (its module and the shared lm_head)
    flops += batch * (tokens_per_seq - 1) * (2 * (sizes["mtp_mean"] + sizes["head"]) + attn)
    memory_ms = bytes_ / rates["copy_gbps"] / 1e6
    compute_ms = flops / rates["matmul_tflops"] / 1e9
    return {"bytes": float(bytes_), "flops": float(flops), "memory_ms": memory_ms,
            "compute_ms": compute_ms, "floor_ms": max(memory_ms, compute_ms)}
