"""User-facing parameters of the engine: how to sample, how to speculate, how much memory to use.

Frozen dataclasses validated on construction: a bad value raises ``ValueError`` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from engine.logprobs import MAX_LOGPROBS

SpecMethod = Literal["none", "chain", "tree", "adaptive"]
MIN_TEMPERATURE = 1e-5  # below it a request decodes greedily (``SamplingParams``)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request (OpenAI semantics).

    temperature 0 means greedy, and so does any temperature below ``MIN_TEMPERATURE`` (the
    law's limit, as in vLLM: logits divided by 1e-40 overflow float32 and leave no law to draw
    from, which had failed the engine step and every request in it). ``top_p`` 1.0 and
    ``top_k`` 0 are off. Presence and frequency penalties apply to tokens generated so far (as
    vLLM and OpenAI do). ``seed=None`` gives the sequence its own fresh randomness; an int makes
    the request reproducible: its draws are keyed by the seed and each token's position
    (``engine.keyed_noise``), so it gives the same tokens alone or in any batch, under any
    speculation method. ``logprobs`` (None or 0-20) asks for each generated token's
    log-probability and its position's most likely tokens (``RequestOutput.new_logprobs``);
    ``prompt_logprobs`` the same for the prompt (``RequestOutput.prompt_logprobs``).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # None: no log-probabilities; k: each generated token's and its position's k most likely
    # (``engine.logprobs``: the model's raw distribution).
    logprobs: int | None = None
    # The same for the prompt's tokens (each but the first, which has no context), given with
    # the first output (``RequestOutput.prompt_logprobs``).
    prompt_logprobs: int | None = None
    # OpenAI's logit_bias: (token id, value in [-100, 100]) pairs added to the logits before
    # every draw (a mapping is taken too).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # No EOS or stop token may end the output before it has this many tokens (vLLM's).
    min_tokens: int = 0
    # Derived on construction (read per sequence in every step's host work, where a property's
    # call per read showed: ``scripts/closed_round_ops.py``).
    greedy: bool = field(init=False, repr=False, compare=False)
    # A seeded sampled request: its draws are keyed by (seed, position) (``engine.keyed_noise``),
    # and speculation verifies it as a greedy one, against the keyed draw at each node.
    keyed: bool = field(init=False, repr=False, compare=False)
    has_penalties: bool = field(init=False, repr=False, compare=False)
    # Penalties, a logit bias or min_tokens: the logits are changed before each draw, on the
    # host path.
    adjusts_logits: bool = field(init=False, repr=False, compare=False)
    # Those or log-probabilities: served by the host-driven steps only (no device-resident
    # tree step, no step launched ahead), which hand the host what they need.
    stays_on_host: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (0.0 <= float(self.temperature) <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if float(self.temperature) < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if not (0.0 < float(self.top_p) <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer (0 = off), got {self.top_k!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = float(getattr(self, name))
            if not (-2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {self.seed!r}")
        ids = tuple(self.stop_token_ids)
        if any(not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS
            ):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        object.__setattr__(self, "greedy", float(self.temperature) == 0.0)
        object.__setattr__(self, "keyed", self.seed is not None and not self.greedy)
        object.__setattr__(self, "has_penalties", self.presence_penalty != 0.0 or self.frequency_penalty != 0.0)
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        try:
            pairs = tuple(sorted((int(t), float(v)) for t, v in bias))  # type: ignore[call-overload]
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from None
        repeated = len({t for t, _ in pairs}) < len(pairs)
        if repeated or any(t < 0 or not -100.0 <= v <= 100.0 for t, v in pairs):
            raise ValueError(f"logit_bias takes distinct token ids >= 0 with values in [-100, 100], got {pairs!r}")
        object.__setattr__(self, "logit_bias", pairs)
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        object.__setattr__(self, "adjusts_logits", self.has_penalties or bool(pairs) or self.min_tokens > 0)
        object.__setattr__(self, "stays_on_host", self.adjusts_logits or self.logprobs is not None)


@dataclass(frozen=True)
class SpecConfig:
    """How to speculate with the model's MTP modules.

    method:
      - ``none``: plain autoregressive decoding.
      - ``chain``: top-1 (or one sample) per depth, ``num_draft_tokens`` deep.
      - ``tree``: EAGLE-2 style dynamic tree; ``None`` fields take the documented device defaults
        (see ``engine.spec.defaults``).
      - ``adaptive``: the scheduler picks the budget (including no speculation) per step.
    topk: children expanded per frontier node (clamped to the vocabulary).
    depth: maximum draft depth. Depths beyond the number of MTP modules reuse the last module
    when ``reuse_last_module`` is set; otherwise depth is capped at the number of modules.
    num_draft_tokens: draft nodes offered for verification per sequence and step (root excluded).
    """

    method: SpecMethod = "tree"
    topk: int | None = None
    depth: int | None = None
    num_draft_tokens: int | None = None
    reuse_last_module: bool = True
    # Greedy trees stop deepening once the best path's draft probability is below this
    # (EAGLE-2's confidence cut); None = the device default (see engine.spec.defaults).
    min_path_prob: float | None = None
    # ``adaptive`` only: the depths of the chain arms captured beside the tree, each a choice of
    # the controller per batch bucket, for greedy and sampled batches alike (None: the defaults of
    # engine.spec.defaults.chain_budgets: chain-4, and for greedy batches one as deep as the MTP modules).
    chain_depths: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.method not in ("none", "chain", "tree", "adaptive"):
            raise ValueError(
                f"method must be one of 'none', 'chain', 'tree', 'adaptive', got {self.method!r}"
            )
        for name in ("topk", "depth", "num_draft_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if self.min_path_prob is not None and not (0.0 <= float(self.min_path_prob) < 1.0):
            raise ValueError(f"min_path_prob must be in [0, 1) or None, got {self.min_path_prob!r}")
        if self.chain_depths is not None:
            depths = self.chain_depths
            if self.method != "adaptive":
                raise ValueError(f"chain_depths is for method 'adaptive' (its chain arms), not {self.method!r}")
            if (not isinstance(depths, tuple) or not depths
                    or any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in depths)):  # fmt: skip
                raise ValueError(f"chain_depths must be a non-empty tuple of positive integers, got {depths!r}")
            if len(set(depths)) != len(depths):
                raise ValueError(f"chain_depths has a depth twice: {depths!r}")


# Default prompt tokens per prefill step, by device type. On a GPU a small chunk turns admitting a
# large batch into a long ramp of steps (256 prompts of 64 tokens: 32 steps at 512), each also
# running the decode of the streams admitted so far.
DEFAULT_PREFILL_CHUNK = {"cpu": 512, "cuda": 4096}


@dataclass(frozen=True)
class EngineConfig:
    """Resources of one engine: batch limit, KV memory, block size, prefill chunking."""

    max_batch_size: int = 64
    kv_memory_bytes: int | None = None  # None: a modest device default (CPU: 256 MiB)
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # Prompt tokens prefilled per step. None: 512 on CPU (running streams keep flowing), 4096 on
    # CUDA (a batch of prompts is admitted in a few steps; see DEFAULT_PREFILL_CHUNK).
    prefill_chunk_tokens: int | None = None
    # Static-shape target forward: None = CUDA graphs on CUDA, off on CPU; True forces the
    # padded static path everywhere (graphs only on CUDA); False turns it off.
    cuda_graphs: bool | None = None
    # Adaptive speculation on the graphed path: time every captured arm at every batch bucket at
    # start-up (engine.spec.arm_calibration). None: on CUDA, off on CPU (tests turn it on).
    calibrate_arms: bool | None = None
    # A steady decode step launches the next one before its host work (commits, stop checks,
    # outputs, the next scheduling), so the device runs one while the host does the other
    # (engine/launch_ahead.py). None: on CUDA (the H200 sweep of session 27: +24% tokens/s at
    # batch 1, +30-43% at 128, both modes; outputs unchanged in the float32 check), off on a
    # CPU, where nothing overlaps (tests turn it on to check the outputs are unchanged).
    overlap_steps: bool | None = None
    # With overlap, a prefill step whose prompts make up the whole decode batch launches that
    # batch's first decode step too, before its own host work (``LLMEngine._launch_after_
    # prefill``): the step that started each request synchronously, not launched ahead.
    launch_after_prefill: bool = True
    # A prefill's MTP catch-up over its prompts (where their first decode step drafts) is
    # queued behind the drawing of their first tokens and before their read, so its host work
    # runs while the device runs the prefill and its device work under the host work after the
    # read (requests with penalties, sampled on the host, keep the old order); False: after the
    # read (before session 43, with the device idle through the catch-up's host work).
    early_catch_up: bool = True
    # The graphed tree steps' MTP forwards take the drafting layer (engine/model/draft_layer.py:
    # absorbed MLA weights, GEMMs with the norms, residual adds and SwiGLU inside; drafts may
    # differ in the last bits, outputs do not). None: on CUDA with Triton in a 16-bit dtype;
    # True also on a CPU (its PyTorch form, for tests); False: the layer path.
    drafting_layer: bool | None = None

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_memory_bytes is not None and self.kv_memory_bytes <= 0:
            raise ValueError(f"kv_memory_bytes must be positive, got {self.kv_memory_bytes}")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}")
