"""LLMEngine: schedule -> (prefill | draft -> verify -> accept -> commit KV) -> outputs.

One ``step()`` runs one scheduler iteration: a chunked-prefill forward for sequences still
reading their prompt, and one decode forward for the others — an autoregressive step, or a
speculative step (MTP tree draft, one tree-masked target forward, lossless acceptance, KV
compaction with the rejected slots zeroed). The engine is single-threaded; the serving loop
(engine/serving) owns it on its own thread.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import torch

from engine.batch_builder import SeqRows, build_batch, causal_mask
from engine.captured_steps import capture_steps, uses_static_steps
from engine.cuda_graphs import StaticTargetForward
from engine.kv.block_pool import BlockPool, KVCacheFull
from engine.launch_ahead import ARLaunch, may_continue, rows_within
from engine.logprobs import TokenLogprob, token_logprobs
from engine.model.attention_batch import AttentionBatch
from engine.model.config import ModelConfig
from engine.model.deepseek_v3 import DeepseekV3ForCausalLM
from engine.model.draft_layer import DraftLayer
from engine.model.loader import load_model, parse_dtype
from engine.model.tokenizer_files import eos_token_ids, load_tokenizer
from engine.outputs import RequestOutput, StepTimings, ZeroEvent
from engine.params import DEFAULT_PREFILL_CHUNK, EngineConfig, SamplingParams, SpecConfig
from engine.sampling import make_generator
from engine.scheduler import Scheduler
from engine.sequence import SeqStatus, Sequence
from engine.spec.acceptance_prior import acceptance_prior
from engine.spec.acceptance_stats import AcceptanceCounter
from engine.spec.adaptive import NO_SPEC, AdaptiveController, budget_label, calibrate_catch_up
from engine.spec.batch_choice import BatchChoice
from engine.spec.defaults import chain_budgets, resolve_budget
from engine.spec.device_tree import warm_race_draw
from engine.spec.drafter import MTPDrafter, TreeBudget, steady_catch_up_rows
from engine.spec.graphed_sampled import GraphedSampledTree
from engine.spec.graphed_tree import GraphedGreedyTree, GraphedTreeStep
from engine.spec.hidden_log import HiddenLog
from engine.spec.host_step import HostTreeStep
from engine.startup_timer import StartupTimer
from engine.step_failure import StepFailed
from engine.token_draw import draw_tokens, read_drawn, read_staged, sample_tokens, stage_drawn

CPU_DEFAULT_KV_BYTES = 256 << 20
GPU_DEFAULT_KV_FRACTION = 0.3
PROMPT_SCORE_ROWS = 256  # prompt rows whose logits are taken at once (prompt_logprobs)
# Adaptive: steps without a new request after which the running batch counts as closed (it
# only shrinks), unless the caller said so from the start (``LLMEngine.closed_workload``).
QUIET_STEPS_FOR_CLOSED = 32
# Zeroing records kept for ``drain_zero_events`` (the service drains them every step): an engine
# driven offline, which never drains, keeps only the newest.
MAX_ZERO_EVENTS = 4096
NO_TOKEN_IDS: frozenset[int] = frozenset()  # the EOS ids of a request that ignores EOS


class LLMEngine:
    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        tokenizer: object | None,
        eos_token_ids: frozenset[int],
        spec: SpecConfig,
        engine_config: EngineConfig,
        device: torch.device,
    ) -> None:
        cfg = model.config
        # The stream the engine's work runs on, looked up by the first ``wait_for_device``
        # (construction already waits: the start-up calibrations time the device).
        self._stream: torch.cuda.Stream | None = None
        self.model = model
        if device.type == "cuda":
            model.fuse_projections()  # before any graph is captured; a no-op when done
        self.model_config: ModelConfig = cfg
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.spec = spec
        self.config = engine_config
        self.device = device
        self.max_model_len = engine_config.max_model_len or cfg.max_position_embeddings
        if spec.method != "none" and cfg.num_mtp_modules == 0:
            if cfg.declared_mtp_modules:
                raise ValueError(
                    f"SpecConfig(method={spec.method!r}) needs MTP modules: config.json declares "
                    f"num_nextn_predict_layers = {cfg.declared_mtp_modules}, but the checkpoint "
                    f"has no tensors for layer {cfg.num_hidden_layers} (model.layers."
                    f"{cfg.num_hidden_layers}.*); add the MTP weights or use method='none'"
                )
            raise ValueError(
                f"SpecConfig(method={spec.method!r}) needs MTP modules, but the model has "
                "num_nextn_predict_layers = 0; use method='none'"
            )
        timer = StartupTimer(device)
        self.budget = resolve_budget(spec, device.type, cfg.vocab_size)
        dtype = next(model.parameters()).dtype
        memory = engine_config.kv_memory_bytes or self._default_kv_bytes(device)
        num_blocks = BlockPool.blocks_for_budget(
            memory, cfg.num_layers_total, engine_config.block_size, cfg.latent_dim, dtype
        )
        with timer.stage("kv_pool"):
            self.pool = BlockPool(
                cfg.num_layers_total, num_blocks, engine_config.block_size, cfg.latent_dim, dtype, device
            )
        scratch = self.budget.num_draft_tokens + self.budget.topk + 5  # + graphed catch-up slack
        chunk = engine_config.prefill_chunk_tokens or DEFAULT_PREFILL_CHUNK.get(device.type, 512)
        self.scheduler = Scheduler(self.pool, engine_config.max_batch_size, chunk, scratch)
        # MTP state is kept only when something drafts (autoregressive engines skip it).
        drafts = cfg.num_mtp_modules > 0 and spec.method != "none"
        self.drafter = MTPDrafter(model, self.pool, spec.reuse_last_module) if drafts else None
        # Speculative steps no device-resident step takes (``engine.spec.host_step``).
        self.host_step = HostTreeStep(model, self.pool, self.drafter, self._forward_target) if self.drafter else None
        # Autoregressive steps' hidden rows, handed to the sequences when something reads them.
        self._hidden_log = HiddenLog()
        self.acceptance = AcceptanceCounter()
        self.sampled_acceptance = AcceptanceCounter()  # sampled trees only: their shape's input
        # Each decode step's budget (adaptive speculation's choice is carried over cheap steps).
        self.batch_choice = BatchChoice(self)
        self.last_timings = StepTimings()
        self.static_forward: StaticTargetForward | None = None
        self.graphed_tree: GraphedGreedyTree | None = None
        self.graphed_sampled: GraphedSampledTree | None = None
        # Every device-resident tree step, (greedy, sampled) per captured budget, the engine's
        # budget first (``graphed_tree`` / ``graphed_sampled``).
        self._graphed_runners: list[GraphedTreeStep] = []
        self._last_runner: GraphedTreeStep | None = None  # the last to take a graphed step
        overlap = engine_config.overlap_steps
        self.overlap_steps = device.type == "cuda" if overlap is None else overlap
        self.launch_after_prefill = self.overlap_steps and engine_config.launch_after_prefill
        self.early_catch_up = engine_config.early_catch_up
        self._ahead: GraphedTreeStep | ARLaunch | None = None  # a step launched ahead (``_read_ahead``)
        self._ahead_since = 0.0  # perf_counter when it was launched: its turn starts there
        self.draft_layers: dict[int, DraftLayer] = {}
        # Adaptive speculation's chain arms for greedy (False) and sampled (True) batches
        # (``SpecConfig.chain_depths``; by default engine/spec/defaults.py's ``chain_budgets``).
        self._chain_budgets = {s: chain_budgets(spec, cfg.num_mtp_modules, s) for s in (False, True)}
        if device.type == "cuda":
            with timer.stage("sampling_kernels"):  # the fused draws' programs, compiled now
                warm_race_draw(device, cfg.vocab_size, torch.float32)  # the autoregressive rows' logits
                if drafts:
                    warm_race_draw(device, cfg.vocab_size, dtype)  # the drafting heads' logits
        if uses_static_steps(engine_config, device):
            max_blocks = -(-(self.max_model_len + scratch) // engine_config.block_size)
            captured = capture_steps(model, self.pool, spec, engine_config, self.budget, self._chain_budgets,
                                     max_blocks, chunk, drafts, timer)  # fmt: skip
            self.static_forward, self.draft_layers = captured.static_forward, captured.draft_layers
            self._graphed_runners = captured.runners
            if self.drafter is not None:
                self.drafter.static_catch_up = captured.catch_up
            if captured.runners:
                self.graphed_tree, self.graphed_sampled = captured.runners[:2]  # type: ignore[assignment]
        self.adaptive: AdaptiveController | None = None
        if spec.method == "adaptive":
            self.adaptive = AdaptiveController(self, self.budget, self._chain_budgets)
            # What a switch to drafting costs, before the first one is measured; and the
            # latency model the host path plans its tree with.
            with timer.stage("calibration"):
                self.adaptive.arms.catch_up.calibrate(calibrate_catch_up(self))
                self.adaptive.calibrate_if_planning(self)
        # Seconds per start-up stage (``engine.startup_timer``; ``from_pretrained`` adds the
        # weights' load first).
        self.startup_seconds: dict[str, float] = timer.seconds
        # The draft budget of the last step's decode (``budget_label``; None: it decoded
        # nothing): what the metrics count per budget, adaptive speculation's choices.
        self.last_decode_budget: str | None = None
        # Adaptive: the last decode step's budget when it drafted (None: it decoded
        # autoregressively, or nothing yet): new prompts are then caught up in their prefill.
        self._last_drafting: TreeBudget | None = None
        self._step_caught_up = False  # this step caught the MTP modules up first (not steady)
        self._catch_up_s: float | None = None  # the graphed path times its catch-up alone
        # Tokens this step's decode produced before max_tokens / stop truncation: what the
        # chosen speculation (or none) delivers, the measure the adaptive controller compares.
        self._step_tokens = 0
        # Adaptive: drafting steps so far and the sum of their arms' mean yields, the clock a
        # finished sequence's relative yield is read from (``_observe_yield``).
        self._yield_clock: tuple[int, float] = (0, 0.0)
        # Whether the running batch may still be joined: a server's is, as finished requests'
        # slots are refilled, so a drafting batch does not drain; an offline batch's is not.
        # The caller says so (``closed_batch``; ``generate`` does), or ``QUIET_STEPS_FOR_CLOSED``
        # steps without a new request do. Adaptive speculation charges a closed batch's
        # drafting for its drain (``engine.spec.drain``).
        self.closed_workload = False
        self._steps_since_arrival = 0
        self._requests: dict[str, Sequence] = {}
        # Requests that sample with a seed, and those that ask for log-probabilities: a step
        # looks at its batch for them only while some exist (the decode hot path's common case
        # has none). Left when a request finishes or is given up.
        self._seeded_ids: set[str] = set()
        self._logprob_ids: set[str] = set()
        self._sessions: dict[str, Sequence] = {}
        self._stepping = False  # inside ``step``: released blocks wait for its end
        self._ended_in_step: list[Sequence] = []  # requests that ended in this step (``step``)
        self._alone_in_step: Sequence | None = None  # the suspect this step ran alone, if any
        self._parked: dict[str, Sequence] = {}  # a failed step's batch, until resumed or aborted
        self._released: list[int] = []  # KV blocks of requests finished in this step
        self._zero_events: deque[ZeroEvent] = deque(maxlen=MAX_ZERO_EVENTS)
        self._arrivals = itertools.count()
        calibrate = engine_config.calibrate_arms
        if calibrate is None:
            calibrate = device.type == "cuda"
        if self.adaptive is not None and calibrate and self._graphed_runners:
            # Every captured arm's step time at every batch bucket (engine.spec.arm_calibration).
            with timer.stage("arm_calibration"):
                self.adaptive.calibrate_arms(self)

    def graphed_budgets(self, sampled: bool) -> list[TreeBudget]:
        """Budgets with a device-resident step for greedy (or sampled) batches."""
        kind = GraphedSampledTree if sampled else GraphedGreedyTree
        return [r.budget for r in self._graphed_runners if isinstance(r, kind)]

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str = "cpu",
        dtype: str = "float32",
        spec: SpecConfig | None = None,
        engine_config: EngineConfig | None = None,
    ) -> LLMEngine:
        folder = Path(path)
        try:
            torch_device = torch.device(device)
        except RuntimeError as exc:
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from exc
        if torch_device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
        if torch_device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but no CUDA GPU is available")
        if spec is not None and not isinstance(spec, SpecConfig):
            raise ValueError("spec must be a SpecConfig")
        timer = StartupTimer(torch_device)
        with timer.stage("load_weights"):
            model = load_model(folder, dtype=parse_dtype(dtype), device=torch_device)
        tokenizer = load_tokenizer(folder)
        eos = eos_token_ids(folder, model.config)
        engine = cls(model, tokenizer, eos, spec or SpecConfig(), engine_config or EngineConfig(), torch_device)
        engine.use_acceptance_prior(folder)
        engine.startup_seconds = {**timer.seconds, **engine.startup_seconds}
        return engine

    def use_acceptance_prior(self, folder: str | Path) -> None:
        """Adaptive speculation: before measuring the MTP modules, expect what the model folder's
        training recorded of them (``engine.spec.acceptance_prior``); ``from_pretrained`` calls
        it, an engine built around a loaded model (the benchmark's) calls it too."""
        if self.adaptive is not None:
            self.adaptive.prior = acceptance_prior(folder)

    @staticmethod
    def _default_kv_bytes(device: torch.device) -> int:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free * GPU_DEFAULT_KV_FRACTION)
        return CPU_DEFAULT_KV_BYTES

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        session_id: str | None = None,
        owner: str = "",
    ) -> None:
        if request_id in self._requests or request_id in self._parked:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(sampling, SamplingParams):
            raise ValueError("sampling must be a SamplingParams")
        ids = list(prompt_token_ids)
        vocab = self.model_config.vocab_size
        # Checked in C loops (a closed batch of 256 prompts of 64 tokens: 2 ms as a generator).
        if set(map(type, ids)) - {int} or (ids and (min(ids) < 0 or max(ids) >= vocab)):
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab})")
        if sampling.logit_bias and sampling.logit_bias[-1][0] >= vocab:  # sorted by id
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}), got {sampling.logit_bias[-1][0]}")
        history: list[int] = []
        session: Sequence | None = None
        if session_id is not None:
            session = self._sessions.get(session_id)
            if session is None:
                raise ValueError(f"unknown session {session_id!r}")
            if session.status is not SeqStatus.IDLE:
                raise ValueError(f"session {session_id!r} already has a request running")
            history = session.tokens
        if not ids and not history:
            raise ValueError("prompt_token_ids must not be empty")
        total = len(history) + len(ids) + sampling.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({total - sampling.max_tokens} tokens) plus max_tokens "
                f"({sampling.max_tokens}) exceeds the context length {self.max_model_len}"
            )
        needed = self.scheduler.blocks_for(total)
        if needed > self.pool.num_blocks:
            raise KVCacheFull(
                f"request needs {needed} KV blocks but the pool has {self.pool.num_blocks}; "
                "lower max_tokens or raise the KV memory budget"
            )
        if session is None:
            seq = Sequence(
                request_id=request_id,
                tokens=ids,
                sampling=sampling,
                generator=make_generator(sampling.seed, self.device),
                owner=owner,
                num_mtp_modules=self.model_config.num_mtp_modules,
            )
        else:
            seq = session
            seq.request_id = request_id
            seq.tokens.extend(ids)
            seq.sampling = sampling
            seq.generator = make_generator(sampling.seed, self.device)
            seq.stats = type(seq.stats)()
            seq.finish_reason = None
            seq.new_turn()
        seq.output_start = len(seq.tokens)
        seq.num_prompt_tokens = len(ids)
        if sampling.keyed:
            self._seeded_ids.add(request_id)
        if sampling.logprobs is not None:
            self._logprob_ids.add(request_id)
        seq.prompt_logprobs = [None] if sampling.prompt_logprobs is not None else []
        seq.ends = ()
        if sampling.min_tokens:
            eos = frozenset() if sampling.ignore_eos else self.eos_token_ids
            seq.ends = tuple(sorted(eos | set(sampling.stop_token_ids)))
        self._steps_since_arrival = 0
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        parked = self._parked.pop(request_id, None)
        if parked is not None:
            self._drop_parked(parked)
            return
        seq = self._requests.get(request_id)
        if seq is None:
            return
        self.scheduler.remove(seq)
        self._finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ------------------------------------------------------------------ sessions
    def open_session(self, session_id: str, owner: str = "") -> None:
        if session_id in self._sessions:
            raise ValueError(f"session {session_id!r} already exists")
        seq = Sequence(
            request_id="",
            tokens=[],
            sampling=SamplingParams(),
            generator=make_generator(0),
            owner=owner,
            session_id=session_id,
            num_mtp_modules=self.model_config.num_mtp_modules,
            status=SeqStatus.IDLE,
        )
        self._sessions[session_id] = seq

    def close_session(self, session_id: str) -> int:
        seq = self._sessions.pop(session_id, None)
        if seq is None:
            raise ValueError(f"unknown session {session_id!r}")
        if seq.status in (SeqStatus.RUNNING, SeqStatus.WAITING):
            self.scheduler.remove(seq)
            self._requests.pop(seq.request_id, None)
            self._parked.pop(seq.request_id, None)
        return self._release(seq, seq.request_id or None)

    def session_num_tokens(self, session_id: str) -> int:
        seq = self._sessions.get(session_id)
        if seq is None:
            raise ValueError(f"unknown session {session_id!r}")
        return len(seq.tokens)

    def session_cached_tokens(self, session_id: str) -> int:
        """Tokens of the session whose KV entries its next turn reuses: all but the last one
        generated (computed with the next turn's prompt), none after its cache was dropped (a
        failed turn rolled back, ``engine.step_failure``)."""
        seq = self._sessions.get(session_id)
        if seq is None:
            raise ValueError(f"unknown session {session_id!r}")
        return seq.num_committed

    # ------------------------------------------------------------------ introspection
    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def kv_blocks_used(self) -> int:
        return self.pool.num_used

    @property
    def kv_blocks_total(self) -> int:
        return self.pool.num_blocks

    @property
    def static_scratch_blocks(self) -> list[int]:
        """Blocks the static (CUDA-graph) paths hold for their padding rows, all zero at rest."""
        blocks = list(self.static_forward.scratch) if self.static_forward is not None else []
        for runner in self._graphed_runners:
            blocks += runner.scratch
        if self.drafter is not None and self.drafter.static_catch_up is not None:
            blocks += self.drafter.static_catch_up.scratch
        return blocks

    def sequence(self, request_id: str) -> Sequence | None:
        """The running or waiting request ``request_id``'s sequence (None: unknown or done)."""
        return self._requests.get(request_id)

    def reset_statistics(self) -> None:
        """Forget what served requests taught the engine's counters: acceptance statistics, the
        drafting-step clock, zeroing records (after the start-up calibration's scratch requests,
        whose random prompts say nothing of real ones)."""
        self._hidden_log.flush()
        self.acceptance = AcceptanceCounter()
        self.sampled_acceptance = AcceptanceCounter()
        self.last_timings = StepTimings()
        self.last_decode_budget = None
        self._last_drafting = None
        self.batch_choice.reset()
        self._yield_clock = (0, 0.0)
        self._steps_since_arrival = 0
        self._zero_events.clear()

    def drain_zero_events(self) -> list[ZeroEvent]:
        """Zeroing records since the last call (the newest ``MAX_ZERO_EVENTS`` of them)."""
        events = list(self._zero_events)
        self._zero_events.clear()
        return events

    def acceptance_snapshot(self) -> dict[str, object]:
        """Acceptance counters per depth and rank (``AcceptanceStats.from_dict`` reads them) and,
        under adaptive speculation once enough sequences finished, ``relative_yields``: the
        spread of tokens per drafting step over sequences (``engine.spec.drain``), what
        ``mtpserve simulate --closed-batch-tokens`` takes; and ``arm_costs``: each arm's measured
        (or start-up calibrated) decode step per batch-size bucket and the tokens per sequence
        the choice counts on (``engine.simulator.arm_costs``), what ``mtpserve
        simulate --arm-costs`` takes as its latency model; and ``fill_costs``: each arm's
        measured filling step (a whole engine step that prefilled and decoded) per decode batch
        bucket, what a filling step's choice is made by."""
        snapshot = self.acceptance.snapshot()
        if self.adaptive is not None:
            snapshot.update(self.adaptive.snapshot())
        return snapshot

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompt_token_ids: list[list[int]],
        sampling: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Every prompt's final output, in order; ``sampling``: one for all, or one per prompt."""
        if isinstance(sampling, list):
            if len(sampling) != len(prompt_token_ids):
                raise ValueError(f"{len(sampling)} sampling params for {len(prompt_token_ids)} prompts")
            params = sampling
        else:
            params = [sampling or SamplingParams()] * len(prompt_token_ids)
        ids = [f"gen-{next(self._arrivals)}-{i}" for i in range(len(prompt_token_ids))]
        for rid, prompt, sp in zip(ids, prompt_token_ids, params, strict=True):
            self.add_request(rid, list(prompt), sp)
        final: dict[str, RequestOutput] = {}
        with self.closed_batch():
            while len(final) < len(ids):
                try:
                    outputs = self.step()
                except StepFailed as exc:  # the whole call fails: nothing stays parked
                    for rid in exc.request_ids:
                        self.abort_request(rid)
                    raise
                for out in outputs:
                    if out.finished:
                        final[out.request_id] = out
        return [final[rid] for rid in ids]

    @contextlib.contextmanager
    def closed_batch(self) -> Iterator[None]:
        """Within: no request joins the running ones (an offline batch), so adaptive
        speculation charges drafting for the batch's drain from its first step
        (``closed_workload``)."""
        closed, self.closed_workload = self.closed_workload, True
        try:
            yield
        finally:
            self.closed_workload = closed

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        # The KV blocks of requests finishing in this step are zeroed and returned to the pool
        # together when it ends (``_release``): one copy of their ids and one fill, where one
        # per request had cost a device synchronisation each.
        self._stepping = True
        self._ended_in_step.clear()
        self._alone_in_step = None
        try:
            return self._step()
        except Exception as exc:
            raise StepFailed(self._recover_from_failed_step(), exc) from exc
        finally:
            self._stepping = False
            self._free_released()
            if self._hidden_log and not (self._sessions or self.scheduler.num_running or self.scheduler.num_waiting):
                # Idle, no session open: every logged row is a finished request's (``HiddenLog.clear``).
                self._hidden_log.clear()

    def _step(self) -> list[RequestOutput]:
        self._steps_since_arrival += 1
        if self._ahead is not None:
            read = self._read_ahead(self._ahead)
            if read is not None:
                return read
        step_start = time.perf_counter()
        plan = self.scheduler.schedule()
        self._alone_in_step = self.scheduler.alone
        outputs: list[RequestOutput] = []
        if plan.prefill:
            # A session's next turn continues its MTP rows: hand out the log first if it holds
            # one of the prefilling sequences (new requests have none: a batch filling over
            # several chunks had paid a flush of the whole log per chunk, ~1 ms at 256 on the
            # H200's host).
            if any(self._hidden_log.holds(seq) for seq, _ in plan.prefill):
                self._hidden_log.flush()
            self._prefill(plan.prefill, outputs)
        else:
            self.batch_choice.end_fill()  # a step without a prefill ends a fill
        decode = [s for s in plan.decode if s.status is SeqStatus.RUNNING]
        if plan.prefill and not plan.decode and self.launch_after_prefill:
            self._launch_after_prefill()
        self.last_decode_budget = None
        self._step_caught_up = False
        self._catch_up_s = None
        self._step_tokens = 0
        if decode:
            self._decode(decode, bool(plan.prefill), step_start, outputs)
        return outputs

    def _decode(
        self, decode: list[Sequence], filling: bool, step_start: float, outputs: list[RequestOutput]
    ) -> None:
        """The step's decode over ``decode``: its budget chosen, the step run, and (adaptive
        speculation) measured. ``filling``: the step also prefilled (from ``step_start``).

        A seeded sampled request gives the same tokens whatever is drafted (its draws are
        keyed by position: ``engine.keyed_noise``). On the graphed path, where no device step
        serves it, adaptive speculation decodes it autoregressively beside a drafting batch
        rather than take the host-driven tree for it."""
        seeded = self._seeded_apart(decode)
        rest = [s for s in decode if s.request_id not in self._seeded_ids] if seeded else decode
        closed = not filling and self._batch_closed()
        if rest:
            budget, lag, sampled = self.batch_choice.choose(rest, filling, closed)
        else:
            budget, lag, sampled = NO_SPEC, 0, True
        if budget.speculates:
            decode = rest
        else:  # the autoregressive step serves the seeded ones too
            seeded = []
        self.last_decode_budget = budget_label(budget)
        self._last_drafting = budget if budget.speculates else None
        start = time.perf_counter()
        ahead = not filling and not seeded and self._may_launch_ahead(decode)
        host_step = False  # a host-driven speculative step leaves device work queued
        if budget.speculates:
            self._hidden_log.flush()
            host = decode
            for runner in self._graphed_steps(budget):
                if not host:
                    break
                graphed, host = self._split_graphed(runner, host)
                if graphed:
                    self._graphed_step(runner, graphed, outputs, ahead and not host)
                    self._last_runner = runner
            if host:
                self._speculative_step(host, budget, outputs)
                host_step = True
        else:
            self._autoregressive_step(decode, outputs, ahead)
        if self.adaptive is not None:
            self._observe_decode(len(decode), budget, lag, sampled, None if filling else start, step_start, host_step)
        self._tick_yield_clock(budget, sampled)
        if seeded:  # after the measured step, which it is no part of
            self._autoregressive_step(seeded, outputs)

    def _seeded_apart(self, decode: list[Sequence]) -> list[Sequence]:
        """The seeded sampled requests of ``decode`` that adaptive speculation on the graphed
        path decodes autoregressively (``_decode``); none for the other methods, whose budget
        is fixed, and none on the host-driven path, which drafts for them as for the others."""
        if (not self._seeded_ids or self.adaptive is None or self.adaptive.forced is not None
                or not self._graphed_runners):  # fmt: skip
            return []
        return [s for s in decode if s.request_id in self._seeded_ids]

    def _observe_decode(
        self, batch_size: int, budget: TreeBudget, lag: int, sampled: bool, start: float | None,
        step_start: float, host_step: bool,
    ) -> None:
        """Hand adaptive speculation what the decode step just run cost: a steady step (its
        catch-up, if it caught up first, apart), a switch's catch-up, or (``start`` None: the
        step prefilled too) a filling step, timed whole from ``step_start``.

        A decode step next to a prefill is not timed alone: that would mean waiting for the
        prefill's device work first, and the device would idle while the host builds the step.
        (Timed alone, each of the 3 chain-4 steps filling the H200's batch 256 took ~5-7 ms more
        than the baseline's autoregressive one, ~2.3 ms of it that idle device; their batch grows
        in each, so neither was a steady step's cost.)"""
        assert self.adaptive is not None
        if start is None:
            if not self._step_caught_up:
                # What a filling step of this arm costs (``MeasuredArms.observe_filling``), apart
                # from the steady costs. (Its reads have waited for the prefill's device work; a
                # host-path step's KV compaction may still be queued, as small as a steady
                # step's.)
                self.adaptive.observe_filling(
                    batch_size, budget, time.perf_counter() - step_start, self._step_tokens, sampled
                )
            return
        # Autoregressive and graphed steps end on a read of their last device result (the
        # sampled tokens, the packed outputs), so the clock already covers their device work;
        # only the host path's KV compaction is still queued.
        if host_step:
            self.wait_for_device()
        seconds = time.perf_counter() - start
        if self._catch_up_s is not None:  # timed alone: the rest is a steady step
            self.adaptive.observe_catch_up(batch_size, budget, self._catch_up_s, lag, sampled, timed_alone=True)
            self.adaptive.observe(batch_size, budget, seconds - self._catch_up_s, self._step_tokens, sampled)
        elif self._step_caught_up:  # not a steady step: what a switch to ``budget`` costs
            self.adaptive.observe_catch_up(batch_size, budget, seconds, lag, sampled)
        else:
            self.adaptive.observe(batch_size, budget, seconds, self._step_tokens, sampled)

    def _recover_from_failed_step(self) -> frozenset[str]:
        """``_step`` raised: park the sequences of its batch and put the device-step state back
        to rest (``engine.step_failure``); returns their request ids.

        The batch is every running sequence (those admitted by the failed step included; only
        the suspect where one ran alone) and those that ended in it, whose outputs were never
        returned. Each is taken out of the scheduler, its KV blocks zeroed and freed and its
        computation forgotten (entries the step wrote, committed or not, are not trusted), and
        parked until the caller resumes it (``resume_request``) or gives it up
        (``abort_request``). The hidden log hands the other sequences their rows; requests
        waiting for a batch slot are untouched."""
        alone = self._alone_in_step  # a suspect's step: the other running sequences paused
        running = self.scheduler.running if alone is None else [alone]
        batch = [*dict.fromkeys([*running, *self._ended_in_step])]
        for seq in batch:
            self.scheduler.remove(seq)
            self._requests.pop(seq.request_id, None)
            seq.status = SeqStatus.FINISHED  # the hidden log's flush passes over it
        # The other sequences' logged rows (an idle session's, a running one's that a suspect's
        # step paused) go to their MTP queues: their steps before this one are intact.
        self._hidden_log.flush()
        for seq in batch:
            seq.status = SeqStatus.WAITING  # parked: neither scheduled nor idle
            self._parked[seq.request_id] = seq
            self._release(seq, seq.request_id or None)
            seq.forget_computation()
        self._ahead = None
        for runner in self._graphed_runners:
            runner.reset()
        if self.static_forward is not None:
            self.static_forward.reset()
        if self.drafter is not None and self.drafter.static_catch_up is not None:
            self.drafter.static_catch_up.reset()
        self._last_runner = self._last_drafting = None
        self.batch_choice.reset()
        self._step_caught_up, self._catch_up_s = False, None
        return frozenset(seq.request_id for seq in batch)

    def resume_request(self, request_id: str, num_delivered: int) -> bool:
        """Resume a request a failed step parked (``StepFailed.request_ids``) from the first
        ``num_delivered`` tokens it generated (what its caller has handed on; the rest is
        generated again): queued ahead of every waiting request, it is recomputed and then runs
        alone until it has decoded one step; resumed a second time (it passed that step, and a
        later batch failed again), it runs alone until it ends. So a request whose steps fail
        fails alone, however late in its decoding they start to, and the others of its batches
        are resumed: each runs alone at most once more, where it cannot fail for another. A
        greedy request continues exactly as if no step had failed, an unseeded sampled one from
        the target's law given its tokens so far, and a seeded one exactly as if no step had
        failed (its draws are keyed by position: ``engine.keyed_noise``). False, and nothing
        done (give it up with ``abort_request``), if the step failed while it ran alone (it is
        the cause)."""
        seq = self._parked.get(request_id)
        if seq is None:
            raise ValueError(f"request {request_id!r} is not parked by a failed step")
        if not 0 <= num_delivered <= len(seq.tokens) - seq.output_start:
            raise ValueError(f"num_delivered {num_delivered} is outside the {len(seq.tokens) - seq.output_start} "
                             f"tokens request {request_id!r} generated")  # fmt: skip
        # A suspect is cleared once it has decoded a step (at the next admission), and the
        # scheduler runs one at a time with no other sequence: a suspect that failed ran alone.
        if seq.suspect or seq.quarantined:
            return False
        del self._parked[request_id]
        del seq.tokens[seq.output_start + num_delivered :]
        del seq.logprobs[num_delivered:]
        if seq.sampling.prompt_logprobs is not None:  # its prompt is prefilled again
            seq.prompt_logprobs = [None]
        seq.quarantined, seq.resumed, seq.suspect = seq.resumed, True, True
        seq.finish_reason = None
        seq.stats = type(seq.stats)()
        seq.yield_clock = None
        self._requests[request_id] = seq
        self.scheduler.add_first(seq)
        return True

    def _drop_parked(self, seq: Sequence) -> None:
        """Give up a parked request: a session's turn is rolled back (the session as it stood
        before the turn; its cache is recomputed at its next turn), anything else is finished."""
        seq.finish_reason = "error"
        self._forget_ids(seq.request_id)
        if self._keeps_blocks(seq):
            del seq.tokens[seq.output_start - seq.num_prompt_tokens :]
            seq.output_start = len(seq.tokens)
            seq.num_prompt_tokens = 0
            seq.status = SeqStatus.IDLE
        else:
            seq.status = SeqStatus.FINISHED

    def _batch_closed(self) -> bool:
        """Whether the running batch is closed: nothing waits, and the caller says no more will
        come or none has for ``QUIET_STEPS_FOR_CLOSED`` steps (a step with a prefill is not)."""
        return not self.scheduler.num_waiting and (
            self.closed_workload or self._steps_since_arrival >= QUIET_STEPS_FOR_CLOSED
        )

    def _tick_yield_clock(self, budget: TreeBudget, sampled: bool) -> None:
        """Count a drafting step and the tokens per sequence it was expected to yield."""
        if self.adaptive is not None and budget.speculates:
            steps, expected = self._yield_clock
            self._yield_clock = (steps + 1, expected + self.adaptive.arms.mean_yield(sampled, budget))

    def _may_launch_ahead(self, decode: list[Sequence]) -> bool:
        """Whether a decode step over ``decode`` (no prefill with it) may launch the next step
        before its host work: steps overlap, no request waits or is in its prefill (the next
        step would not be this batch's again), no suspect runs alone (``resume_request``: its
        steps take no other sequence), and no sequence keeps its blocks (a session's:
        what the launched step wrote past a stop would stay in them)."""
        return (self.overlap_steps and not self.scheduler.num_waiting and self.scheduler.alone is None
                and len(decode) == self.scheduler.num_running
                and all(s.session_id is None for s in decode))  # fmt: skip

    def _read_ahead(self, launched: GraphedTreeStep | ARLaunch) -> list[RequestOutput] | None:
        """A step whose work the device has had since the last step's host work began: read
        it over the sequences of its batch still decoding, and launch the next one if the batch
        still may (``_may_launch_ahead``) and adaptive speculation would choose its budget again
        (else the next step chooses anew). None if none of them decodes any more: this engine
        step then takes the usual course."""
        self._ahead, since = None, self._ahead_since
        self.batch_choice.end_fill()  # no prefill in this step: any fill has ended
        runner = launched if isinstance(launched, GraphedTreeStep) else None
        batch = launched.seqs if isinstance(launched, ARLaunch) else launched.launched_ahead
        assert batch is not None
        seqs = [s for s in batch if s.status is SeqStatus.RUNNING]
        if not seqs:
            if runner is not None:
                runner.discard_ahead()
            return None
        outputs: list[RequestOutput] = []
        self._step_tokens = 0
        self._step_caught_up, self._catch_up_s = False, None
        closed = self._batch_closed()
        budget = NO_SPEC if runner is None else runner.budget
        ahead = self._may_launch_ahead(seqs)
        sampled = False
        chosen = budget
        if self.adaptive is not None:
            chosen, _, sampled = self.batch_choice.choose(seqs, False, closed)
            ahead = ahead and chosen == budget
        if isinstance(launched, ARLaunch):
            self._autoregressive_step(seqs, outputs, ahead, launched)
            self._last_drafting = None
        else:
            self._graphed_step(launched, seqs, outputs, ahead)
            self._last_drafting, self._last_runner = launched.budget, launched
            if chosen != budget and chosen.speculates:
                self._launch_switched(chosen, batch)
        if self.adaptive is not None:
            # What the step cost is its turn: from its launch, through the host work that ran
            # while the device computed it (the last step's commits, the caller's handling of
            # its outputs), to the launch of its successor. Timed from the read alone, a step
            # whose device work had finished during that host work cost nothing; one such step
            # set the arm's fastest, which caps every later measurement at twice it, and the
            # controller took autoregressive steps for ~free (the H200's batch 1, T=0.7, took
            # them 277 times against 142 tree steps). A step read without launching one has no
            # turn of its own (its successor is the next ``step``'s, timed there): not counted.
            if self._ahead is not None:
                self.adaptive.observe(len(seqs), budget, self._ahead_since - since, self._step_tokens, sampled)
            self._tick_yield_clock(budget, sampled)
        self.last_decode_budget = budget_label(budget)
        return outputs

    def _launch_switched(self, budget: TreeBudget, batch: list[Sequence]) -> None:
        """Adaptive speculation switches the batch of the graphed step just read to drafting
        ``budget``: launch that arm's first step now, as the step read would have launched its
        own next one, its runner taking the batch over on the device (``GraphedTreeStep.adopt``,
        through ``_split_graphed``). Not launched, that first step ran synchronously, the device
        idle through its host work: ~1.8 ms more than a steady step at 44-93 sequences on the
        H200 (session 37's trace), at each switch of a shrinking closed batch."""
        seqs = [s for s in batch if s.status is SeqStatus.RUNNING]
        if seqs and self._may_launch_ahead(seqs):
            self._launch_graphed(budget, seqs)

    def _launch_graphed(self, budget: TreeBudget, seqs: list[Sequence]) -> None:
        """Launch a graphed step of ``budget`` over ``seqs`` ahead of its turn (the next step's
        ``_read_ahead`` reads it), if one runner takes them all; else leave the step to the
        next engine step's choice."""
        runner = next((r for r in self._graphed_steps(budget)
                       if all(r.serves(s.sampling) for s in seqs)), None)  # fmt: skip
        if runner is None or len(seqs) > runner.max_batch:
            return
        self._hidden_log.flush()  # (empty after a drafting step or a prefill of new requests)
        if self._split_graphed(runner, seqs)[1]:  # some sequence it cannot take
            return
        runner.launch(seqs)
        self._ahead, self._ahead_since, self._last_runner = runner, time.perf_counter(), runner

    def wait_for_device(self) -> None:
        """Wait for the work queued on the device (adaptive speculation times its steps). The
        stream's own wait: ``torch.cuda.synchronize`` switches devices around it (0.08 ms a call
        under a profiler on the H200's host, against 0.8 ms for a whole batch-16 step)."""
        if self.device.type == "cuda":
            if self._stream is None:  # looked up once: the lookup is most of a call's host time
                self._stream = torch.cuda.current_stream(self.device)
            self._stream.synchronize()

    # ------------------------------------------------------------------ prefill
    def _prefill(self, work: list[tuple[Sequence, int]], outputs: list[RequestOutput]) -> None:
        rows = []
        for seq, chunk in work:
            start = seq.num_committed
            rows.append(
                SeqRows(
                    seq.block_ids,
                    start,
                    seq.tokens[start : start + chunk],
                    list(range(start, start + chunk)),
                    causal_mask(chunk),
                )
            )
        static = self.static_forward
        shape = static.prefill_shape(rows) if static is not None else None
        if static is not None and shape is not None:
            hidden = static.run_prefill(rows, shape)  # [N, H], one graph replay on CUDA
        else:
            ids, batch = build_batch(rows, self.pool.block_size, self.device)
            hidden = self.model.forward_target(ids, batch, self.pool.kv_cache)  # [N, H]
        offset = 0
        finishing: list[tuple[Sequence, torch.Tensor]] = []
        for seq, chunk in work:
            h = hidden[offset : offset + chunk]
            offset += chunk
            if self.drafter is not None:
                seq.push_hidden(0, seq.num_committed, h)
            if seq.sampling.prompt_logprobs is not None:
                self._score_prompt(seq, seq.num_committed, h)
            seq.num_committed += chunk
            if seq.num_committed == len(seq.tokens):
                finishing.append((seq, h[-1]))
        if finishing:
            prefilled = [seq for seq, _ in finishing]
            whole = len(finishing) == len(work)
            logits = self.model.logits(torch.stack([h for _, h in finishing]))  # [F, V]
            early = self.early_catch_up and not any(s.sampling.adjusts_logits for s in prefilled)
            if early:
                # The first tokens are drawn and their copy to the host started, then the
                # catch-up queued behind them: its host work runs while the device runs the
                # prefill, and the tokens' read waits for the prefill, not for the catch-up,
                # whose device work then runs under the host work that follows the read.
                staged = stage_drawn(*draw_tokens(prefilled, logits))
                self._catch_up_prompts(prefilled, whole)
                tokens = read_staged(*staged)
            else:
                tokens = self._sample_rows(prefilled, logits)
            row_logprobs = self._row_logprobs(prefilled, logits, tokens)
            for i, ((seq, _), token) in enumerate(zip(finishing, tokens, strict=True)):
                if self.adaptive is not None:
                    seq.yield_clock = (*self._yield_clock, seq.stats.num_accepted_tokens)
                lp = None if row_logprobs is None else row_logprobs[i]
                self._append_tokens(seq, [token], outputs, drafted=None, accepted=None, logprobs=lp)
            if not early:
                self._catch_up_prompts(prefilled, whole)

    def _row_logprobs(
        self, seqs: list[Sequence], logits: torch.Tensor, tokens: list[int]
    ) -> list[list[TokenLogprob] | None] | None:
        """Per sequence, the log-probability of ``tokens[i]`` under row ``i`` of ``logits``
        [B, V] where its sampling asks for one (one read for all of them); None where none
        does."""
        if not self._logprob_ids:
            return None
        rows = [i for i, s in enumerate(seqs) if s.sampling.logprobs is not None]
        if not rows:
            return None
        ks = [seqs[i].sampling.logprobs or 0 for i in rows]
        found = token_logprobs(logits[rows], [tokens[i] for i in rows], max(ks))
        out: list[list[TokenLogprob] | None] = [None] * len(seqs)
        for i, k, lp in zip(rows, ks, found, strict=True):
            out[i] = [lp._replace(top=lp.top[:k])]
        return out

    def _score_prompt(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        """The log-probabilities of the prompt tokens that the rows ``hidden`` [C, H] of
        positions ``start``.. predict (row p predicts token p + 1), into the turn's
        ``prompt_logprobs``; 256 rows of logits at a time."""
        first = seq.output_start - seq.num_prompt_tokens  # the turn's prompt starts here
        lo = max(start, first)
        hi = min(start + hidden.shape[0], seq.output_start - 1)
        k = seq.sampling.prompt_logprobs
        assert k is not None
        for a in range(lo, hi, PROMPT_SCORE_ROWS):
            b = min(a + PROMPT_SCORE_ROWS, hi)
            logits = self.model.logits(hidden[a - start : b - start])  # [b - a, V]
            seq.prompt_logprobs.extend(token_logprobs(logits, seq.tokens[a + 1 : b + 1], k))

    def _catch_up_prompts(self, prefilled: list[Sequence], whole_chunk: bool) -> None:
        """Catch the MTP modules up over the prompts of ``prefilled`` (their prefill just ended;
        ``whole_chunk``: every sequence of the step's prefill did), where their first decode
        step would draft. Early (``EngineConfig.early_catch_up``) their first tokens are not in
        the sequences yet: module 1 stops one row earlier (two short of the prompt's end),
        which the first drafting step catches up with its own rows."""
        drafting = self.batch_choice.prompt_catch_up_arm(prefilled, whole_chunk, self._last_drafting)
        runners = self._graphed_steps(drafting) if drafting is not None else []
        if runners and self.drafter is not None:
            # (Early, a request whose first token ends it is caught up for nothing, unless it
            # asked for one token only; its blocks are zeroed after the catch-up's writes.)
            ready = [
                seq for seq in prefilled
                if seq.status is SeqStatus.RUNNING and seq.sampling.max_tokens > 1
                and any(r.serves(seq.sampling) for r in runners)
            ]  # fmt: skip
            if ready:
                self.drafter.catch_up(ready)

    # ------------------------------------------------------------------ decode
    def _autoregressive_step(
        self, seqs: list[Sequence], outputs: list[RequestOutput], ahead: bool = False,
        launched: ARLaunch | None = None,
    ) -> None:
        """One token per sequence. ``launched``: the step was launched ahead over a batch of
        which ``seqs`` are those still decoding: it is read. ``ahead``: the next step is
        launched before this one's host work (``engine.launch_ahead``), where it may be."""
        if launched is None:
            hidden = self._decode_hidden(seqs, [seq.tokens[-1] for seq in seqs], [seq.num_committed for seq in seqs])
            logits = self.model.logits(hidden)  # [B, V]
            tokens = self._sample_rows(seqs, logits)
            row_logprobs = self._row_logprobs(seqs, logits, tokens)
        else:  # (no sequence asking for log-probabilities is launched ahead)
            row_logprobs = None
            rows = rows_within(seqs, launched.seqs)
            everyone = len(rows) == len(launched.seqs)
            tokens = read_drawn(launched.tokens, launched.ok, None if everyone else rows)
            hidden = launched.hidden if everyone else launched.hidden[rows]
        if ahead and self._may_launch_ahead_autoregressive(seqs):
            self._ahead = self._launch_autoregressive(seqs, tokens)
            self._ahead_since = time.perf_counter()
        batch_key = (self.scheduler.version, len(seqs))  # before the commits: they may end some
        for i, seq in enumerate(seqs):
            seq.num_committed += 1
            seq.stats.record_step(0, 0)
            self._step_tokens += 1
            lp = None if row_logprobs is None else row_logprobs[i]
            self._append_tokens(seq, [tokens[i]], outputs, drafted=0, accepted=0, logprobs=lp)
        if self.drafter is not None:  # after the commits (see HiddenLog); no per-sequence work
            self._hidden_log.append(seqs, hidden, batch_key)

    def _decode_hidden(self, seqs: list[Sequence], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """The target's hidden states [B, H] of ``tokens[i]`` at ``positions[i]`` of ``seqs[i]``
        (its context up to there committed)."""
        # Each table lists the blocks up to the new token's only: a sequence reserves blocks
        # for its whole max_tokens and a draft's scratch, and building the step's tables is
        # per-block host work (an adaptive engine reserves a tree's scratch more than the
        # autoregressive baseline, and its autoregressive steps paid for it).
        bs = self.pool.block_size
        widths = [p // bs + 1 for p in positions]
        static = self.static_forward
        if static is not None and static.decode_fits(len(seqs), max(widths)):
            # Straight into the captured step's inputs (one copy to the device, and the rows of
            # the block tables that changed: ``_Static.load_decode``).
            return static.run_decode(tokens, [seq.block_ids for seq in seqs], widths, positions)
        rows = [SeqRows(seq.block_ids[:w], p, [token], [p], causal_mask(1))
                for seq, w, token, p in zip(seqs, widths, tokens, positions, strict=True)]  # fmt: skip
        ids, batch = build_batch(rows, bs, self.device)
        return self._forward_target(ids, batch, 1)

    def _launch_after_prefill(self) -> None:
        """Launch the first decode step of a batch whose every sequence finished its prefill in
        this step (nothing else running, waiting or in prefill): the next engine step reads it
        (``_read_ahead``), as it reads a step launched ahead by a decode step. Its arm is the
        one the prefill caught the MTP modules up for (a speculative engine's budget; adaptive
        speculation's answer to the fill question, or autoregressive decoding), so it needs no
        catch-up of its own. Without it that first step ran synchronously, its host work with
        the device idle: on the H200 ~2.4 ms against ~0.7 for the next tree steps at batch 1
        (~1.4 against ~0.5 for the baseline's autoregressive step), a tenth of a 64-token
        request at batch 1."""
        seqs = list(self.scheduler.running)
        if (not seqs or any(s.status is not SeqStatus.RUNNING or s.in_prefill for s in seqs)
                or not self._may_launch_ahead(seqs) or not may_continue(seqs, 1)):  # fmt: skip
            return
        drafting = self.batch_choice.fill_arm if self.adaptive is not None else self.budget
        if drafting is not None and drafting.speculates:
            self._launch_graphed(drafting, seqs)
        elif self._may_launch_ahead_autoregressive(seqs):
            hidden = self._decode_hidden(seqs, [s.tokens[-1] for s in seqs], [s.num_committed for s in seqs])
            self._ahead = ARLaunch(seqs, hidden, *draw_tokens(seqs, self.model.logits(hidden)))
            self._ahead_since = time.perf_counter()

    def _may_launch_ahead_autoregressive(self, seqs: list[Sequence]) -> bool:
        """Whether the autoregressive step after this one (read, not yet committed) may be
        launched now: tokens drawn on the device (nothing that stays on the host: penalties,
        which count the tokens there, log-probabilities, read off the step's logits), a block
        for every sequence's next position, and a sequence that has not reached ``max_tokens``
        with this step's token."""
        bs, limit = self.pool.block_size, self.max_model_len
        return (all(not s.sampling.stays_on_host and (s.num_committed + 1) // bs < len(s.block_ids)
                    and s.num_committed + 1 < limit for s in seqs)
                and may_continue(seqs, 2))  # fmt: skip

    def _launch_autoregressive(self, seqs: list[Sequence], tokens: list[int]) -> ARLaunch:
        """Queue the next autoregressive step over ``seqs``, whose tokens ``tokens`` were just
        drawn (their commits not yet made): its tokens stay on the device until it is read."""
        hidden = self._decode_hidden(seqs, tokens, [s.num_committed + 1 for s in seqs])
        lands_at = [s.num_committed + 2 for s in seqs]  # past the tokens just drawn
        return ARLaunch(list(seqs), hidden, *draw_tokens(seqs, self.model.logits(hidden), lands_at))

    def _speculative_step(
        self, seqs: list[Sequence], budget: TreeBudget, outputs: list[RequestOutput]
    ) -> None:
        assert self.host_step is not None
        steady = steady_catch_up_rows(budget.depth)
        lagging = [s for s in seqs if len(s.tokens) - 1 - s.mtp_committed[0] > steady]
        if lagging:
            # MTP modules behind (autoregressive steps, a prompt left to its first speculative
            # step): caught up first and timed alone, as the graphed path does
            # (``_split_graphed``), so that the rest of the step is a steady one. Counted whole
            # as a switch's cost, a step with any sequence behind was never a steady one, and a
            # batch that new requests keep joining never measured its drafting arms: CPU serving
            # at a load of 8 re-ran them every few steps, each run catching up first (0.74-0.89x
            # of no speculation, session 30).
            self._catch_up_alone(lagging)
        verified, self.last_timings = self.host_step.run(seqs, budget, self.sampled_acceptance)
        for seq, step in zip(seqs, verified, strict=True):
            tree, result = step.tree, step.result
            self.acceptance.record(tree, result.accepted)
            if not seq.sampling.greedy:
                self.sampled_acceptance.record(tree, result.accepted)
            drafted = tree.num_nodes - 1
            seq.stats.record_step(drafted, result.num_accepted)
            self._step_tokens += result.num_accepted + 1
            self._append_tokens(seq, step.new_tokens, outputs, drafted=drafted, accepted=result.num_accepted,
                                logprobs=step.logprobs)  # fmt: skip

    def _graphed_steps(self, budget: TreeBudget) -> list[GraphedTreeStep]:
        """The device-resident tree steps that serve ``budget`` (greedy, sampled), the one that
        took the last graphed step first: a batch it took whole then goes to it with no check
        per sequence, and the other is not asked (a sampled batch had each of its sequences
        checked by the greedy step first, at every step: ~1 us each on the H200's host)."""
        runners = [g for g in self._graphed_runners if g.budget == budget]
        last = self._last_runner
        if last is not None and last in runners and runners[0] is not last:
            runners.remove(last)
            runners.insert(0, last)
        return runners

    def _catch_up_alone(self, lagging: list[Sequence]) -> None:
        """Catch the MTP modules of ``lagging`` up before this step drafts, timed alone for
        adaptive speculation (``_catch_up_s``: what a switch costs; the rest of the step is a
        steady one)."""
        assert self.drafter is not None
        start = time.perf_counter()
        self.drafter.catch_up(lagging)
        if self.adaptive is not None:
            self.wait_for_device()
            self._catch_up_s = (self._catch_up_s or 0.0) + time.perf_counter() - start
        self._step_caught_up = True  # catching up after AR steps: not a steady-state cost

    def _split_graphed(
        self, fast: GraphedTreeStep, seqs: list[Sequence]
    ) -> tuple[list[Sequence], list[Sequence]]:
        """(sequences ``fast`` takes this step, the others)."""
        if fast.continues(seqs):  # its last step's batch, untouched: no per-sequence checks
            return seqs, []
        # Sequences of its last step untouched since need no check either (``eligible`` would
        # hand out their deferred MTP rows, which the step gathers on the device instead); so
        # do those of another drafting arm's last step, which it takes over (``adopt``).
        rows = fast.continuing(seqs)
        last = self._last_runner
        if last is not None and last is not fast and (rows is None or max(rows, default=-1) < 0):
            rows = fast.adopt(last, seqs)
        rows = rows or [-1] * len(seqs)
        ready = [row >= 0 or fast.eligible(s) for s, row in zip(seqs, rows, strict=True)]
        lagging = [s for s, ok in zip(seqs, ready, strict=True) if not ok and fast.serves(s.sampling)]
        if lagging and self.drafter is not None:
            # MTP modules behind (autoregressive steps in between, a host step that stopped
            # early): catch them up eagerly, then the graphed step can take these sequences.
            self._catch_up_alone(lagging)
            ready = [ok or fast.eligible(s) for s, ok in zip(seqs, ready, strict=True)]
        graphed = [s for s, ok in zip(seqs, ready, strict=True) if ok][: fast.max_batch]
        chosen = {id(s) for s in graphed}
        return graphed, [s for s in seqs if id(s) not in chosen]

    def _graphed_step(
        self, runner: GraphedTreeStep, seqs: list[Sequence], outputs: list[RequestOutput], ahead: bool = False
    ) -> None:
        """Tree speculation as graph replays (see engine/spec/graphed_tree.py); ``ahead``: the
        next step over ``seqs`` is launched before this one's host work (``GraphedTreeStep.run``)."""
        t0 = time.perf_counter()
        results, timing = runner.run(seqs, ahead)
        if runner.launched_ahead is not None:
            self._ahead, self._ahead_since = runner, time.perf_counter()
        elapsed = time.perf_counter() - t0
        drafted = runner.N
        width = runner.budget.topk
        results.record_acceptance(self.acceptance, width)
        sampled = isinstance(runner, GraphedSampledTree)
        if sampled:
            results.record_acceptance(self.sampled_acceptance, width)
        if self.adaptive is not None and width > 1:
            for chain in self.adaptive.chains_for(sampled):
                if chain.depth <= runner.D:  # what the chain would have yielded on these prompts
                    self.adaptive.arms.observe_counterfactual_yield(
                        len(seqs), sampled, chain, results.chain_tokens(chain.depth)
                    )
        self._step_tokens += sum(results.num_accepted) + len(seqs)
        for seq, tokens, accepted in zip(seqs, results.tokens, results.num_accepted, strict=True):
            seq.stats.record_step(drafted, accepted)
            self._append_tokens(seq, tokens, outputs, drafted=drafted, accepted=accepted)
        if len(timing) == 2:
            self.last_timings = StepTimings(0.0, elapsed, 0.0, timing)  # type: ignore[arg-type]
        else:
            self.last_timings = StepTimings(0.0, elapsed, float(timing[0]))  # type: ignore[arg-type]

    def _forward_target(
        self, ids: torch.Tensor, batch: AttentionBatch, tokens_per_seq: int | None
    ) -> torch.Tensor:
        """Decode-step target forward: static shapes / CUDA graphs when eligible, else eager.
        ``tokens_per_seq``: new tokens of every sequence when they are all equal, else None."""
        static = self.static_forward
        if static is not None and static.eligible(ids, batch, tokens_per_seq):
            return static.run(ids, batch)
        return self.model.forward_target(ids, batch, self.pool.kv_cache)

    # ------------------------------------------------------------------ tokens and finishing
    def _sample_rows(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """One token per row of ``logits`` [B, V], read (``engine.token_draw.sample_tokens``)."""
        return sample_tokens(seqs, logits, self.model_config.vocab_size)

    def _append_tokens(
        self,
        seq: Sequence,
        tokens: list[int],
        outputs: list[RequestOutput],
        drafted: int | None,
        accepted: int | None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        """Append a step's ``tokens`` to ``seq`` up to its first stop or its length limit, and
        its output; ``logprobs``: the tokens' own, where its sampling asks for them."""
        params = seq.sampling
        reason = None
        n = len(seq.tokens)
        room = min(params.max_tokens - n + seq.output_start, self.max_model_len - n)
        eos = NO_TOKEN_IDS if params.ignore_eos else self.eos_token_ids
        if len(tokens) < room and eos.isdisjoint(tokens) and not params.stop_token_ids:
            # The common case, decided once for the step's tokens: none ends the request.
            seq.tokens.extend(tokens)
            emitted = tokens
        else:
            emitted = []
            for token in tokens:
                seq.tokens.append(token)
                emitted.append(token)
                if token in eos or token in params.stop_token_ids:
                    reason = "stop"
                elif len(seq.tokens) - seq.output_start >= params.max_tokens or len(seq.tokens) >= self.max_model_len:
                    reason = "length"
                if reason:
                    break
        new_logprobs = None
        if params.logprobs is not None:
            assert logprobs is not None and len(logprobs) == len(tokens), "a step without its logprobs"
            new_logprobs = logprobs[: len(emitted)]
            seq.logprobs.extend(new_logprobs)
        if reason and seq.num_committed > len(seq.tokens) - 1:
            self._truncate_committed(seq)
        if reason and drafted is not None:
            self._observe_yield(seq, accepted or 0)
        outputs.append(
            RequestOutput(
                request_id=seq.request_id,
                new_token_ids=emitted,
                token_ids=seq.tokens,  # sliced when read: ``span``
                finished=reason is not None,
                finish_reason=reason,
                num_prompt_tokens=seq.num_prompt_tokens,
                stats=seq.stats,
                step_drafted=drafted,
                step_accepted=accepted,
                span=(seq.output_start, len(seq.tokens)),
                logprobs=None if new_logprobs is None else seq.logprobs,
                new_logprobs=new_logprobs,
                prompt_logprobs=seq.prompt_logprobs if params.prompt_logprobs is not None else None,
            )
        )
        if reason:
            self.scheduler.remove(seq)
            self._finish(seq, reason)

    def _truncate_committed(self, seq: Sequence) -> None:
        """A stop inside an accepted path: forget KV past the new pending token. It is zeroed now
        only where the sequence keeps its blocks (a session's next turn continues from them); a
        request that ends releases its blocks, zeroed whole when the step ends (``_release``),
        and its MTP rows go with it (a copy and a fill per request had each waited for the
        device, and most requests of a closed batch stop inside a path)."""
        assert not self._hidden_log, "autoregressive steps never truncate; speculative ones flush"
        keep = len(seq.tokens) - 1
        if not self._keeps_blocks(seq):
            seq.num_committed = keep
            return
        table = torch.tensor(seq.block_ids)
        positions = torch.arange(keep, seq.num_committed)
        bs = self.pool.block_size
        slots = table[positions // bs] * bs + positions % bs
        self.pool.zero_slots(slots, slice(0, self.model_config.num_hidden_layers))
        seq.num_committed = keep
        rows = seq.hidden_rows(0) if seq.pending_hidden else None
        if rows is not None:
            seq.pending_hidden[0] = rows[: max(keep - seq.pending_start[0], 0)]

    def _observe_yield(self, seq: Sequence, last_accepted: int) -> None:
        """Adaptive speculation: hand the controller a finished sequence's tokens per drafting
        step against the mean of its arms' (what spreads a closed batch's finish, ``engine.spec.
        drain``). Its last step is left out: max_tokens or a stop cut its tokens short, and the
        clock does not count it yet."""
        if self.adaptive is None or seq.yield_clock is None:
            return
        steps0, expected0, accepted0 = seq.yield_clock
        seq.yield_clock = None
        steps, expected = self._yield_clock
        steps -= steps0
        if not steps:  # no drafting step in its life (a batch that decoded autoregressively)
            return
        tokens = seq.stats.num_accepted_tokens - last_accepted - accepted0 + steps
        self.adaptive.arms.observe_finished(tokens, expected - expected0, steps)

    def _keeps_blocks(self, seq: Sequence) -> bool:
        """Whether ``seq`` keeps its KV blocks when its request ends (an open session's)."""
        return seq.session_id is not None and seq.session_id in self._sessions

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self._requests.pop(seq.request_id, None)
        self._forget_ids(seq.request_id)
        if self._stepping:
            self._ended_in_step.append(seq)
        if self._keeps_blocks(seq):
            seq.status = SeqStatus.IDLE
            self._trim_session_blocks(seq)
            return
        seq.status = SeqStatus.FINISHED
        self._release(seq, seq.request_id)

    def _forget_ids(self, request_id: str) -> None:
        self._seeded_ids.discard(request_id)
        self._logprob_ids.discard(request_id)

    def _trim_session_blocks(self, seq: Sequence) -> None:
        needed = -(-len(seq.tokens) // self.pool.block_size)
        extra = seq.block_ids[needed:]
        if extra:
            del seq.block_ids[needed:]
            self.pool.free(extra)

    def _release(self, seq: Sequence, request_id: str | None) -> int:
        """Zero ``seq``'s KV blocks and return them to the pool (within a step, when it ends:
        no block is handed out again before that); returns the bytes zeroed."""
        # Its deferred MTP rows point at a graphed step that points back at its batch: dropping
        # the reference lets both go without waiting for the garbage collector.
        seq.deferred = None
        blocks = len(seq.block_ids)
        zeroed = blocks * self.pool.bytes_per_block
        self._released += seq.block_ids
        seq.block_ids = []
        if not self._stepping:
            self._free_released()
        if blocks:
            self._zero_events.append(ZeroEvent(seq.owner, request_id, seq.session_id, blocks, zeroed))
        return zeroed

    def _free_released(self) -> None:
        if self._released:
            self.pool.free(self._released)
            self._released = []
