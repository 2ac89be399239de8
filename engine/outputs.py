"""What the engine hands back: per-request outputs, speculative statistics, zeroing events."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Speculation statistics of one request (see docs/internals.md and DESIGN.md).

    num_steps: target forwards after the prefill (verify steps; autoregressive: decode steps).
    num_draft_tokens: drafted tokens offered for verification, summed over steps.
    num_accepted_tokens: drafted tokens accepted, summed over steps (bonus tokens not counted).
    accepted_per_position[d]: number of steps whose accepted path reached depth d + 1.
    """

    num_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target forward: 1 + accepted / steps (1.0 before any step)."""
        if self.num_steps == 0:
            return 1.0
        return 1.0 + self.num_accepted_tokens / self.num_steps

    def record_step(self, drafted: int, accepted: int) -> None:
        self.num_steps += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < accepted:
            self.accepted_per_position.extend([0] * (accepted - len(self.accepted_per_position)))
        for d in range(accepted):
            self.accepted_per_position[d] += 1


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    stats: SpecStats
    step_drafted: int | None = None  # drafts offered to this request in this step (None: no verify)
    step_accepted: int | None = None  # drafts accepted in this step


@dataclass(frozen=True)
class ZeroEvent:
    """KV memory of a finished request or closed session was zeroed (for the audit log)."""

    owner: str
    request_id: str | None
    session_id: str | None
    blocks: int
    bytes: int
