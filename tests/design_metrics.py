"""The metric names that DESIGN.md fixes (one list for every test that checks them)."""

from __future__ import annotations

HISTOGRAMS = frozenset(
    {
        "mtpserve_time_to_first_token_seconds",
        "mtpserve_inter_token_latency_seconds",
        "mtpserve_time_per_output_token_seconds",
        "mtpserve_e2e_request_latency_seconds",
        "mtpserve_queue_time_seconds",
        "mtpserve_accepted_tokens_per_step",
    }
)
COUNTERS_AND_GAUGES = frozenset(
    {
        "mtpserve_spec_verify_steps_total",
        "mtpserve_spec_draft_tokens_total",
        "mtpserve_spec_accepted_tokens_total",
        "mtpserve_spec_accepted_tokens_per_position_total",
        "mtpserve_requests_total",
        "mtpserve_prompt_tokens_total",
        "mtpserve_completion_tokens_total",
        "mtpserve_kv_zeroed_bytes_total",
        "mtpserve_requests_running",
        "mtpserve_requests_waiting",
        "mtpserve_kv_blocks_used",
        "mtpserve_kv_blocks_total",
        "mtpserve_sessions_active",
    }
)
DESIGN_METRICS = HISTOGRAMS | COUNTERS_AND_GAUGES
# Exported beyond DESIGN.md's list ("more may be added").
EXTRA_METRICS = frozenset({"mtpserve_decode_steps_total", "mtpserve_engine_step_failures_total",
                           "mtpserve_engine_step_failure_requests_total"})
EXPORTED_METRICS = DESIGN_METRICS | EXTRA_METRICS
