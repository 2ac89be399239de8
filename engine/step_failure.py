"""StepFailed: an engine step raised, and only the requests it was running are lost.

A step runs one batch: the sequences being prefilled and those decoding. When its code raises
(a bug, a device error), those sequences are in an unknown state: tokens appended for some and
not others, KV entries written past what is committed, an MTP catch-up half done, a step launched
ahead on the device. ``LLMEngine.step`` then takes them out of the engine (their KV blocks
zeroed and freed; a session's turn rolled back, its cache recomputed at its next turn), puts its
device-step state back to rest, and raises ``StepFailed`` naming their requests. Requests still
waiting for a batch slot took no part in the step and carry on, as do later requests.
"""

from __future__ import annotations


class StepFailed(RuntimeError):
    """An engine step raised; ``request_ids``: the requests it took down (the cause is chained)."""

    def __init__(self, request_ids: frozenset[str], cause: BaseException) -> None:
        self.request_ids = request_ids
        names = ", ".join(sorted(request_ids)[:8]) + (", ..." if len(request_ids) > 8 else "")
        super().__init__(f"engine step failed ({type(cause).__name__}: {cause}); "
                         f"{len(request_ids)} request(s) lost: {names or 'none'}")  # fmt: skip
