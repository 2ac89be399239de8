"""What the MTP modules lose if they see only the last W tokens of a prompt (a research probe).

A switch to drafting first catches every MTP module up over the prompt: each module is a full
decoder layer over every prompt token, and at the H200's batch 256 of 64-token prompts that
catch-up (~12 ms a round) is what drafting's steady gains must pay back. If each module saw only
the last ``W`` prompt positions of its own cache, the catch-up would cover ``W`` rows a prompt,
not the whole prompt, and drafts would still start from the target's hidden state, which has
seen everything. Outputs cannot change (verification decides); acceptance may.

This measures that on the host path (CPU): requests one at a time, greedy, with every MTP
attention (catch-up and drafting) blind to its cache entries at positions ``< len(prompt) - W``
for every query at or after that position (the rows before it are computed as usual, seen by
nothing that counts: what a catch-up of ``W`` rows leaves). The target's attention is untouched.
Prints and writes the mean accepted length per window (``none``: the engine as it is)::

    PYTHONPATH=. python scripts/mtp_window_probe.py OUT --prompts 12 --prompt-tokens 64,256
"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import engine.attention.reference as reference
from engine import LLMEngine, SamplingParams, SpecConfig
from engine.model.deepseek_v3 import DeepseekV3ForCausalLM

_window: dict[str, Any] = {"on": False, "first_key": None}  # the probe's switches


def _windowed_plan_group(original):  # type: ignore[no-untyped-def]
    def plan(block_tables, ctx, starts, num_new, kv_lens, new_mask, query_ctx_lens, max_q, max_s,  # type: ignore[no-untyped-def]
             block_size, num_tokens):
        group = original(block_tables, ctx, starts, num_new, kv_lens, new_mask, query_ctx_lens, max_q, max_s,
                         block_size, num_tokens)  # fmt: skip
        first = _window["first_key"]
        if _window["on"] and first is not None and first > 0:
            # Query q of a sequence sits at position ctx + q for a catch-up's rows, and past the
            # prompt for a draft's (ctx >= prompt length - 1): hide keys before ``first`` from it.
            qpos = ctx[:, None] + torch.arange(max_q, device=ctx.device)[None, :]  # [g, Q]
            hide = (qpos >= first)[:, :, None] & (torch.arange(max_s, device=ctx.device) < first)[None, None, :]
            group.bias.masked_fill_(hide[:, :, None, :], float("-inf"))  # bias [g, Q, 1, S]
        return group

    return plan


def _mtp_marked(original):  # type: ignore[no-untyped-def]
    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        _window["on"] = True
        try:
            return original(self, *args, **kwargs)
        finally:
            _window["on"] = False

    return forward


@contextmanager
def mtp_window_patched():  # type: ignore[no-untyped-def]
    saved = reference._plan_group, DeepseekV3ForCausalLM.forward_mtp_fused
    reference._plan_group = _windowed_plan_group(saved[0])  # type: ignore[assignment]
    DeepseekV3ForCausalLM.forward_mtp_fused = _mtp_marked(saved[1])  # type: ignore[method-assign]
    try:
        yield
    finally:
        reference._plan_group, DeepseekV3ForCausalLM.forward_mtp_fused = saved  # type: ignore[method-assign]


def accepted_length(eng: LLMEngine, prompts: list[list[int]], window: int | None, new_tokens: int) -> float:
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    steps = accepted = 0
    for prompt in prompts:
        _window["first_key"] = None if window is None else max(len(prompt) - window, 0)
        out = eng.generate([prompt], sp)[0]
        steps += out.stats.num_steps
        accepted += out.stats.num_accepted_tokens
    return 1.0 + accepted / max(steps, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="models/demo")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--prompt-tokens", default="64,256")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--windows", default="none,32,16,8,0")
    parser.add_argument("--budgets", default="chain-4,tree-4x6-32")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from train.heldout import heldout_prompts

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    windows = [None if w == "none" else int(w) for w in args.windows.split(",")]
    specs = {
        "chain-4": SpecConfig(method="chain", num_draft_tokens=4),
        "tree-4x6-32": SpecConfig(method="tree", topk=4, depth=6, num_draft_tokens=32),
    }
    results: list[dict[str, object]] = []
    with mtp_window_patched():
        for budget in args.budgets.split(","):
            eng = LLMEngine.from_pretrained(args.model, spec=specs[budget])
            for length in (int(n) for n in args.prompt_tokens.split(",")):
                prompts = heldout_prompts(args.model, tokenizer, args.prompts, prompt_tokens=length)
                for window in windows:
                    value = accepted_length(eng, prompts, window, args.new_tokens)
                    row = {"budget": budget, "prompt_tokens": length, "window": window, "accepted_length": value}
                    results.append(row)
                    print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mtp_window_probe.json").write_text(json.dumps(
        {"model": args.model, "prompts": args.prompts, "new_tokens": args.new_tokens, "rows": results}, indent=1
    ) + "\n")


if __name__ == "__main__":
    main()
