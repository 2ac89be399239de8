"""Every Prometheus metric of the service, in one registry (names fixed by DESIGN.md).

Labels are tenant names, request statuses and draft positions only: never text. Request
``status`` is one of ``stop``, ``length``, ``abort`` (client went away), ``error`` (engine
failure), ``invalid`` (4xx input), ``rate_limited`` (429), ``unavailable`` (503).
``position`` is the 0-based draft depth, the index of ``SpecStats.accepted_per_position``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from app.logging import audit_zero_events
from engine.serving import LoopStats

# Sub-millisecond to minutes.
LATENCY_BUCKETS = (
    0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0,
)  # fmt: skip
ACCEPTED_BUCKETS = tuple(float(n) for n in range(0, 17))


PRECREATED_POSITIONS = 8


def _with_series(counter: Counter, label: str, values: Sequence[str]) -> Counter:
    """``counter`` with a series for each label value created now, exported at 0 from the start."""
    for value in values:
        counter.labels(**{label: value})
    return counter


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = "mtpserve_"
        self.ttft = Histogram(
            p + "time_to_first_token_seconds", "Time to first token.", buckets=LATENCY_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            p + "inter_token_latency_seconds", "Time between streamed chunks of a request.",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            p + "time_per_output_token_seconds", "Mean time per output token after the first.",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds", "Request latency, arrival to last token.",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_time = Histogram(
            p + "queue_time_seconds", "Time waiting in the scheduler queue.",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.accepted_per_step = Histogram(
            p + "accepted_tokens_per_step", "Draft tokens accepted per verify step and sequence.",
            buckets=ACCEPTED_BUCKETS, registry=r,
        )  # fmt: skip
        self.verify_steps = Counter(
            p + "spec_verify_steps", "Verify steps (per sequence).", registry=r
        )
        self.draft_tokens = Counter(
            p + "spec_draft_tokens", "Draft tokens offered for verification.", registry=r
        )
        self.accepted_tokens = Counter(
            p + "spec_accepted_tokens", "Draft tokens accepted.", registry=r
        )
        # Depths nothing has reached yet show 0 on the dashboards, not "no data".
        self.accepted_per_position = _with_series(Counter(
            p + "spec_accepted_tokens_per_position",
            "Verify steps whose accepted path reached this draft position (0-based).",
            ["position"], registry=r,
        ), "position", [str(i) for i in range(PRECREATED_POSITIONS)])  # fmt: skip
        self.decode_steps = Counter(
            p + "decode_steps",
            "Engine decode steps by draft budget (none, chain-D, tree-KxD-N): what adaptive "
            "speculation chose.",
            ["budget"], registry=r,
        )  # fmt: skip
        self.requests = Counter(
            p + "requests", "Requests by tenant and status.", ["tenant", "status"], registry=r
        )
        self.prompt_tokens = Counter(
            p + "prompt_tokens", "Prompt tokens prefilled.", ["tenant"], registry=r
        )
        self.completion_tokens = Counter(
            p + "completion_tokens", "Completion tokens generated.", ["tenant"], registry=r
        )
        self.zeroed_bytes = Counter(
            p + "kv_zeroed_bytes", "KV cache bytes zeroed before reuse.", registry=r
        )
        self.step_failures = Counter(
            p + "engine_step_failures",
            "Engine steps that raised (engine/step_failure.py).",
            registry=r,
        )
        self.step_failure_requests = _with_series(
            Counter(
                p + "engine_step_failure_requests",
                "Requests of a failed engine step, by outcome: resumed, or lost (failed).",
                ["outcome"],
                registry=r,
            ),
            "outcome",
            ["resumed", "lost"],
        )  # fmt: skip  (0, not "no data", until a step fails)
        self.running = Gauge(p + "requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge(p + "requests_waiting", "Requests waiting to run.", registry=r)
        self.kv_used = Gauge(p + "kv_blocks_used", "KV blocks in use.", registry=r)
        self.kv_total = Gauge(p + "kv_blocks_total", "KV blocks in the pool.", registry=r)
        self.sessions = Gauge(
            p + "sessions_active", "Open sessions by tenant.", ["tenant"], registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def set_sessions(self, counts: dict[str, int], tenants: Sequence[str]) -> None:
        for name in set(tenants) | set(counts):
            self.sessions.labels(tenant=name).set(counts.get(name, 0))


class MetricsObserver:
    """The engine loop's observer: step statistics, occupancy gauges, KV zeroing audit."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def on_admit(self, owner: str, queue_seconds: float) -> None:
        self.metrics.queue_time.observe(queue_seconds)

    def on_step(
        self, outputs: Sequence[Any], step_seconds: float, decode_budget: str | None = None
    ) -> None:
        m = self.metrics
        if decode_budget is not None:
            m.decode_steps.labels(budget=decode_budget).inc()
        for out in outputs:
            accepted = getattr(out, "step_accepted", None)
            if accepted is None:
                continue
            m.verify_steps.inc()
            m.accepted_per_step.observe(accepted)
            m.draft_tokens.inc(getattr(out, "step_drafted", None) or 0)
            m.accepted_tokens.inc(accepted)
            for position in range(accepted):
                m.accepted_per_position.labels(position=str(position)).inc()

    def on_stats(self, stats: LoopStats) -> None:
        m = self.metrics
        m.running.set(stats.running)
        m.waiting.set(stats.waiting)
        m.kv_used.set(stats.kv_blocks_used)
        m.kv_total.set(stats.kv_blocks_total)

    def on_step_failed(self, resumed: int, lost: int) -> None:
        m = self.metrics
        m.step_failures.inc()
        m.step_failure_requests.labels(outcome="resumed").inc(resumed)
        m.step_failure_requests.labels(outcome="lost").inc(lost)

    def on_zero_events(self, events: Sequence[Any]) -> None:
        total = sum(int(getattr(ev, "bytes", 0)) for ev in events)
        if total:
            self.metrics.zeroed_bytes.inc(total)
        audit_zero_events(events)
