"""The training loop: a joint phase, then a distillation phase, with held-out tracking.

1. ``joint``: the DeepSeek-V3 objective, ``main + mtp_lambda · mean_d(mtp_d)``, every weight
   trained. The best weights by held-out next-token loss are kept.
2. ``distill``: the main model frozen, the MTP modules trained towards the main model's own
   next-token distributions (``objectives.distill_losses``). The best weights by the held-out
   chain-acceptance proxy are kept. The phase starts from the best joint weights.

CUDA: bf16 autocast over fp32 master weights, fused AdamW, TF32, optional ``torch.compile``.
CPU: float32. A checkpoint is written every ``ckpt_every_s`` and at phase ends; ``resume``
continues from it.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from engine.model.deepseek_v3 import DeepseekV3ForCausalLM
from train.checkpoint import load_checkpoint, save_checkpoint
from train.data import WindowSampler
from train.objectives import HeldoutMetrics, distill_losses, heldout_metrics, joint_losses
from train.presets import Preset
from train.schedule import PhasePlan

PHASES = ("joint", "distill", "done")


@dataclass(frozen=True)
class RunSettings:
    device: torch.device
    ckpt_dir: Path
    seed: int = 0
    deadline: float | None = None  # time.monotonic() by which training must stop
    joint_steps: int | None = None
    distill_steps: int | None = None
    resume: bool = False
    ckpt_every_s: float = 180.0
    compile: bool = False  # torch.compile the joint phase's loss
    log_every: int = 10
    progress: bool = True


@dataclass
class TrainState:
    """Everything the loop needs to continue after a restart (saved in the checkpoint)."""

    phase: str = "joint"
    step: int = 0  # steps done in the current phase
    elapsed_s: float = 0.0  # wall time spent in the current phase
    data_step: int = 0  # batches consumed so far (both phases): the sampler's position
    best_metric: float | None = None
    best_step: int | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    phase_summary: dict[str, dict[str, Any]] = field(default_factory=dict)


def _clone_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Trainer:
    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        preset: Preset,
        sampler: WindowSampler,
        heldout: torch.Tensor,  # [n, T] fixed held-out windows (CPU)
        settings: RunSettings,
        log: Callable[[str], None] = print,
    ) -> None:
        self.model, self.preset, self.sampler, self.settings = model, preset, sampler, settings
        self.num_depths = model.config.num_nextn_predict_layers
        if self.num_depths < 1:
            raise ValueError("the model has no MTP modules to train")
        self.heldout = [
            b.to(settings.device) for b in heldout.split(preset.eval_batch_size)
        ]  # list of [b, T]
        self.cuda = settings.device.type == "cuda"
        self.log = log
        self.state = TrainState()
        self.best_state: dict[str, torch.Tensor] | None = None
        self._opt_state: dict[str, Any] | None = None
        self._train_record: dict[str, Any] | None = None
        self._t0 = time.monotonic()
        self._last_ckpt = time.monotonic()
        if self.cuda:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        if settings.resume:
            self._restore()

    # ---- public ----
    def fit(self) -> TrainState:
        for phase in PHASES[:-1]:
            if PHASES.index(self.state.phase) > PHASES.index(phase):
                continue
            self._run_phase(phase)
        return self.state

    def evaluate(self) -> HeldoutMetrics:
        self.model.eval()
        with self._autocast():
            metrics = heldout_metrics(self.model, self.heldout, self.num_depths)
        self.model.train()
        return metrics

    # ---- phases ----
    def _plan(self, phase: str) -> PhasePlan:
        p, s = self.preset, self.settings
        steps = s.joint_steps if phase == "joint" else s.distill_steps
        time_s = None
        if s.deadline is not None:
            remaining = max(s.deadline - time.monotonic(), 0.0)
            share = (1.0 - p.distill_frac) if phase == "joint" else 1.0
            time_s = self.state.elapsed_s + remaining * share
        elif steps is None:
            steps = p.default_joint_steps if phase == "joint" else p.default_distill_steps
        # warm-up in steps: a fraction of a step count, or the preset's count under a time budget
        if phase == "joint":
            warmup = max(1, round(p.warmup_frac * steps)) if steps else p.warmup_steps
            return PhasePlan(phase, p.lr, p.min_lr_ratio, warmup, steps, time_s)
        warmup = max(1, round(0.05 * steps)) if steps else max(1, p.warmup_steps // 3)
        return PhasePlan(phase, p.distill_lr, p.min_lr_ratio, warmup, steps, time_s)

    def _optimizer(self, phase: str) -> torch.optim.Optimizer:
        L = self.model.config.num_hidden_layers
        mtp_prefixes = tuple(f"model.layers.{L + i}." for i in range(self.num_depths))
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for name, param in self.model.named_parameters():
            trainable = phase == "joint" or name.startswith(mtp_prefixes)
            param.requires_grad_(trainable)
            if not trainable:
                continue
            (decay if param.dim() >= 2 and "embed_tokens" not in name else no_decay).append(param)
        groups = [
            {"params": decay, "weight_decay": self.preset.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        kwargs: dict[str, Any] = {"betas": (0.9, 0.95), "eps": 1e-8, "lr": 0.0}
        if self.cuda:
            kwargs["fused"] = True
        return torch.optim.AdamW(groups, **kwargs)

    def _loss_fn_eager(
        self, phase: str
    ) -> Callable[[torch.Tensor], tuple[torch.Tensor, list[torch.Tensor]]]:
        return self._loss_fn(phase, compile_joint=False)

    def _loss_fn(
        self, phase: str, compile_joint: bool | None = None
    ) -> Callable[[torch.Tensor], tuple[torch.Tensor, list[torch.Tensor]]]:
        compile_joint = self.settings.compile if compile_joint is None else compile_joint
        model, k, lam = self.model, self.num_depths, self.preset.mtp_lambda
        hard = self.preset.distill_hard_weight

        def joint(x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
            main, mtp = joint_losses(model, x, k)
            return main + lam * torch.stack(mtp).mean(), [main, *mtp]

        def distill(x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
            kl = distill_losses(model, x, k, hard)
            return torch.stack(kl).mean(), kl

        if phase == "joint":
            return torch.compile(joint) if compile_joint else joint  # type: ignore[return-value]
        return distill

    def _run_phase(self, phase: str) -> None:
        st, s = self.state, self.settings
        resuming = st.phase == phase and (st.step > 0 or self._opt_state is not None)
        if not resuming:
            st.phase, st.step, st.elapsed_s = phase, 0, 0.0
            if phase == "distill":
                self._start_distill()
        if phase == "joint" and not resuming:
            self._eval_and_track(phase)  # the untrained model's held-out metrics, for reference
        opt = self._optimizer(phase)
        if resuming and self._opt_state is not None:
            opt.load_state_dict(self._opt_state)
        self._opt_state = None
        params = [p for g in opt.param_groups for p in g["params"]]
        loss_fn = self._loss_fn(phase)
        eager_fn = self._loss_fn_eager(phase) if s.compile and phase == "joint" else loss_fn
        tokens_per_step = self.sampler.batch_size * self.sampler.seq_len
        plan = self._plan(phase)  # last before the loop: a time share counts from here
        bar = self._bar(phase, plan)
        self.log(
            f"[{phase}] plan: steps={plan.max_steps} time_s={plan.time_s and round(plan.time_s)} "
            f"peak_lr={plan.peak_lr} warmup={plan.warmup_steps}"
        )
        last_eval = last_log = t_prev = time.monotonic()
        log_step, window_losses = st.step, []
        self.model.train()
        while plan.progress(st.step, st.elapsed_s) < 1.0:
            if s.deadline is not None and time.monotonic() >= s.deadline:
                self.log(f"[{phase}] time budget reached at step {st.step}")
                break
            lr = plan.lr(st.step, st.elapsed_s)
            for group in opt.param_groups:
                group["lr"] = lr
            x = self.sampler.batch(st.data_step)  # [B, T]
            try:
                with self._autocast():
                    loss, parts = loss_fn(x)
                loss.backward()
            except Exception as exc:  # torch.compile failures: fall back to eager once
                if loss_fn is eager_fn:
                    raise
                self.log(f"[{phase}] torch.compile failed ({type(exc).__name__}: {exc}); eager")
                loss_fn = eager_fn
                opt.zero_grad(set_to_none=True)
                continue
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.preset.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            st.step += 1
            st.data_step += 1
            if st.step == 1 and plan.time_s is not None:
                # The first step carries CUDA start-up and compilation: the cosine starts after it.
                first = time.monotonic() - t_prev
                plan = replace(plan, time_s=max(plan.time_s - first, 0.0))
                t_prev += first
            window_losses.append(
                torch.stack([t.detach().float() for t in (loss, *parts, grad_norm)])
            )  # [total, parts..., grad_norm]
            now = time.monotonic()
            st.elapsed_s += now - t_prev
            t_prev = now
            if st.step % s.log_every == 0 or plan.progress(st.step, st.elapsed_s) >= 1.0:
                mean = torch.stack(window_losses).mean(0).tolist()  # syncs with the device
                window_losses = []
                now = time.monotonic()
                tok_s = (st.step - log_step) * tokens_per_step / max(now - last_log, 1e-9)
                log_step, last_log = st.step, now
                if not math.isfinite(mean[0]):
                    raise FloatingPointError(f"[{phase}] loss is {mean[0]} at step {st.step}")
                self._train_record = {
                    "loss": mean[:-1],
                    "grad_norm": mean[-1],
                    "lr": lr,
                    "tok_s": tok_s,
                }
                self._update_bar(bar, plan, phase, mean, lr, tok_s)
            # Evaluations and checkpoints count as phase time (they are part of the wall budget).
            if now - last_eval >= self.preset.eval_every_s:
                self._eval_and_track(phase)
                last_eval = time.monotonic()
            if now - self._last_ckpt >= s.ckpt_every_s:
                self._save(opt)
        bar.close()
        if not st.history or (st.history[-1]["phase"], st.history[-1]["step"]) != (phase, st.step):
            self._eval_and_track(phase)
        self._finish_phase(phase)
        self._save(None)

    def _start_distill(self) -> None:
        """Distil from the best joint weights; the best-by-acceptance tracking starts afresh."""
        if self.best_state is not None:
            self.model.load_state_dict(self.best_state)
        self.state.best_metric, self.state.best_step = None, None

    def _finish_phase(self, phase: str) -> None:
        st = self.state
        if self.best_state is not None:
            self.model.load_state_dict(self.best_state)
        st.phase_summary[phase] = {
            "steps": st.step,
            "elapsed_s": round(st.elapsed_s, 1),
            "best_step": st.best_step,
            "best_metric": st.best_metric,
        }
        st.phase = PHASES[PHASES.index(phase) + 1]
        st.step, st.elapsed_s = 0, 0.0
        self.log(f"[{phase}] done: {st.phase_summary[phase]}")

    def _eval_and_track(self, phase: str) -> None:
        st = self.state
        result = self.evaluate()
        metrics = result.as_dict()
        st.history.append(
            {
                "phase": phase,
                "step": st.step,
                "data_step": st.data_step,
                "epochs": round(self.sampler.epochs_at(st.data_step), 3),
                "time_s": round(time.monotonic() - self._t0, 1),
                "train": self._train_record,
                "heldout": metrics,
            }
        )
        # joint: lower held-out next-token loss; distill: longer (proxy) accepted chain
        if phase == "joint":
            score = -result.main_loss
        else:
            score = result.chain(result.accept_sampled)
        if st.best_metric is None or score > st.best_metric:
            st.best_metric, st.best_step = score, st.step
            self.best_state = _clone_state(self.model)
        self.log(
            f"[{phase}] step {st.step} heldout main={result.main_loss:.4f} "
            f"mtp={[round(v, 3) for v in result.mtp_loss]} "
            f"accept(T=1)={[round(a, 3) for a in result.accept_sampled]} "
            f"chain~{metrics['chain_len_sampled']:.2f} greedy~{metrics['chain_len_greedy']:.2f}"
        )

    # ---- plumbing ----
    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.cuda:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _bar(self, phase: str, plan: PhasePlan) -> tqdm:
        interactive = sys.stderr.isatty()
        if plan.time_s is not None:
            total, unit = int(math.ceil(plan.time_s)), "s"
        else:
            total, unit = int(plan.max_steps or 0), "step"
        return tqdm(
            total=total,
            desc=phase,
            unit=unit,
            dynamic_ncols=interactive,
            mininterval=1.0 if interactive else 15.0,
            disable=not self.settings.progress,
            file=sys.stderr,
        )

    def _update_bar(
        self, bar: tqdm, plan: PhasePlan, phase: str, mean: list[float], lr: float, tok_s: float
    ) -> None:
        st = self.state
        target = min(int(st.elapsed_s), bar.total) if plan.time_s is not None else st.step
        postfix = {"step": st.step, "loss": f"{mean[0]:.3f}"}
        if phase == "joint":  # parts: main, mtp_1..k
            postfix["main"] = f"{mean[1]:.3f}"
            postfix["mtp"] = f"{sum(mean[2:-1]) / max(len(mean) - 3, 1):.3f}"
        postfix.update(
            lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", ep=f"{self.sampler.epochs_at(st.data_step):.2f}"
        )
        bar.set_postfix(postfix, refresh=False)
        bar.update(target - bar.n)  # redraws at most every ``mininterval`` seconds

    def _save(self, opt: torch.optim.Optimizer | None) -> None:
        st = self.state
        save_checkpoint(
            self.settings.ckpt_dir,
            {
                "model": self.model.state_dict(),
                "optimizer": opt.state_dict() if opt is not None else None,
                "state": st.__dict__,
                "best_state": self.best_state,
            },
        )
        self._last_ckpt = time.monotonic()

    def _restore(self) -> None:
        payload = load_checkpoint(self.settings.ckpt_dir, self.settings.device)
        if payload is None:
            self.log(f"no checkpoint in {self.settings.ckpt_dir}; starting fresh")
            return
        self.model.load_state_dict(payload["model"])
        self.state = TrainState(**payload["state"])
        self.best_state = payload["best_state"]
        self._opt_state = payload["optimizer"]
        self.log(
            f"resumed: phase={self.state.phase} step={self.state.step} "
            f"data_step={self.state.data_step}"
        )
