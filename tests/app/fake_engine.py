"""A deterministic stand-in for ``engine.LLMEngine`` with the same service-facing API.

Tokenizer: byte level. Ids 0/1/2 are <pad>/<bos>/<eos>; byte ``b`` is id ``3 + b``.
Generation: the token at position ``p`` of a sequence (prompt included) is byte
``REPLY[p % len(REPLY)]``, so the output depends only on the sequence length; a session turn
and one request over the same whole sequence produce the same tokens. Each step emits 1, 2 or 3
tokens in turn (as if 0, 1 or 2 of 3 drafts were accepted), so multi-byte characters and stop
strings straddle steps. Asked for log-probabilities, every token has -0.25 (``fake_logprob``).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

from engine.logprobs import TokenLogprob
from engine.outputs import RequestOutput, SpecStats, ZeroEvent
from engine.params import SamplingParams
from engine.step_failure import StepFailed

REPLY = "Hello, wörld! The quick brown fox 🦊 jumps. ".encode()
BOS, EOS, OFFSET = 1, 2, 3
BLOCK_SIZE = 4
BYTES_PER_BLOCK = 256


class KVCacheFull(ValueError):
    pass


class FakeTokenizer:
    chat_template = None
    eos_token_id = EOS
    bos_token_id = BOS

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [OFFSET + b for b in text.encode("utf-8")]
        return ([BOS] if add_special_tokens else []) + ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            if i >= OFFSET:
                out.append(i - OFFSET)
            elif not skip_special_tokens:
                out.extend(b"<s>" if i == BOS else b"</s>")
        return out.decode("utf-8", errors="replace")


def expected_text(total_len: int, n: int) -> str:
    """What the fake engine generates after ``total_len`` tokens, ``n`` tokens long."""
    data = bytes(REPLY[(total_len + i) % len(REPLY)] for i in range(n))
    return data.decode("utf-8", errors="replace")


def fake_logprob(token: int, k: int) -> TokenLogprob:
    """The stand-in's log-probability of ``token`` (-0.25), and its top ``k``: the token, then
    the ids after it at -1, -2, ..."""
    top = ((token, -0.25), *((token + i, -float(i)) for i in range(1, k)))
    return TokenLogprob(token, -0.25, top[:k])


@dataclass
class _Seq:
    request_id: str
    tokens: list[int]
    sampling: SamplingParams
    owner: str
    session_id: str | None = None
    output_start: int = 0
    num_prompt_tokens: int = 0
    running: bool = False
    step_index: int = 0
    stats: SpecStats = field(default_factory=SpecStats)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.output_start :]


class FakeEngine:
    def __init__(
        self,
        max_model_len: int = 512,
        num_blocks: int = 1000,
        step_delay_s: float = 0.0,
        max_batch: int = 64,
    ) -> None:
        self.tokenizer = FakeTokenizer()
        self.eos_token_ids = frozenset({EOS})
        self.max_model_len = max_model_len
        self.kv_blocks_total = num_blocks
        self.step_delay_s = step_delay_s
        self.max_batch = max_batch
        self.fail_next_step = False  # the next step raises StepFailed (recovered, as LLMEngine's)
        self.break_next_step = False  # the next step raises a plain error (recovery failed)
        self.fail_empty_steps = 0  # this many steps raise StepFailed with no request in them
        self.last_decode_budget: str | None = None
        self.eos_after: int | None = None  # emit EOS after this many generated tokens
        self._requests: dict[str, _Seq] = {}
        self._sessions: dict[str, _Seq] = {}
        self._zero_events: list[ZeroEvent] = []
        self._blocks: dict[int, int] = {}  # id(seq) -> blocks held
        self.thread_ids: set[int] = set()
        self.prefilled_tokens: list[int] = []  # tokens prefilled per admitted request

    # -------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        session_id: str | None = None,
        owner: str = "",
    ) -> None:
        self.thread_ids.add(threading.get_ident())
        if request_id in self._requests:
            raise ValueError("request_id already in use")
        if any(not 0 <= t < 259 for t in prompt_token_ids):
            raise ValueError("prompt_token_ids must be integers in [0, 259)")
        if any(t >= 259 for t, _ in sampling.logit_bias):
            raise ValueError("logit_bias token ids must be in [0, 259)")
        if session_id is not None:
            seq = self._sessions.get(session_id)
            if seq is None:
                raise ValueError("unknown session")
            if seq.running:
                raise ValueError("session already has a request running")
            history = len(seq.tokens)
        else:
            if not prompt_token_ids:
                raise ValueError("prompt_token_ids must not be empty")
            seq = _Seq(request_id, [], sampling, owner)
            history = 0
        total = history + len(prompt_token_ids) + sampling.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"{total} tokens exceed the context length {self.max_model_len}")
        if math.ceil(total / BLOCK_SIZE) > self.kv_blocks_total:
            raise KVCacheFull("request can never fit in the KV pool")
        seq.request_id = request_id
        seq.sampling = sampling
        seq.tokens.extend(prompt_token_ids)
        seq.output_start = len(seq.tokens)
        seq.num_prompt_tokens = len(prompt_token_ids)
        seq.running = False
        seq.step_index = 0
        seq.stats = SpecStats()
        self.prefilled_tokens.append(len(prompt_token_ids))
        self._requests[request_id] = seq

    def resume_request(self, request_id: str, num_delivered: int) -> bool:
        return False  # the stand-in never resumes: its failed requests are lost

    def abort_request(self, request_id: str) -> None:
        seq = self._requests.pop(request_id, None)
        if seq is not None:
            self._end(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # -------------------------------------------------------------- sessions
    def open_session(self, session_id: str, owner: str = "") -> None:
        if session_id in self._sessions:
            raise ValueError("session already exists")
        self._sessions[session_id] = _Seq("", [], SamplingParams(), owner, session_id)

    def close_session(self, session_id: str) -> int:
        seq = self._sessions.pop(session_id, None)
        if seq is None:
            raise ValueError("unknown session")
        self._requests.pop(seq.request_id, None)
        return self._release(seq)

    def session_num_tokens(self, session_id: str) -> int:
        seq = self._sessions.get(session_id)
        if seq is None:
            raise ValueError("unknown session")
        return len(seq.tokens)

    def session_cached_tokens(self, session_id: str) -> int:
        return self.session_num_tokens(session_id)  # the stand-in keeps its whole history

    # -------------------------------------------------------------- stats
    @property
    def num_running(self) -> int:
        return sum(1 for s in self._requests.values() if s.running)

    @property
    def num_waiting(self) -> int:
        return sum(1 for s in self._requests.values() if not s.running)

    @property
    def kv_blocks_used(self) -> int:
        return sum(self._blocks.values())

    def drain_zero_events(self) -> list[ZeroEvent]:
        events, self._zero_events = self._zero_events, []
        return events

    def acceptance_snapshot(self) -> dict[str, object]:
        return {"num_sequences": len(self._requests), "per_depth": [0.5, 0.25]}

    # -------------------------------------------------------------- stepping
    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        batch = list(self._requests.values())[: self.max_batch]
        if self.fail_next_step:
            self.fail_next_step = False
            raise StepFailed(frozenset(seq.request_id for seq in batch), RuntimeError("simulated"))
        if self.fail_empty_steps:
            self.fail_empty_steps -= 1
            raise StepFailed(frozenset(), RuntimeError("simulated failure before any request ran"))
        if self.break_next_step:
            self.break_next_step = False
            raise RuntimeError("simulated engine failure, not recovered")
        outputs = []
        for seq in batch:
            outputs.append(self._advance(seq))
        self.last_decode_budget = "chain-2" if outputs else None
        return outputs

    def _advance(self, seq: _Seq) -> RequestOutput:
        drafted = accepted = None
        prompt_logprobs = None
        if not seq.running:
            seq.running = True
            n = 1  # prefill emits the first token
            k = seq.sampling.prompt_logprobs
            if k is not None:
                prompt = seq.tokens[seq.output_start - seq.num_prompt_tokens : seq.output_start]
                prompt_logprobs = [None, *(fake_logprob(t, k) for t in prompt[1:])]
        else:
            n = 1 + seq.step_index % 3
            drafted, accepted = 3, n - 1
            seq.step_index += 1
        new: list[int] = []
        reason = None
        for _ in range(n):
            made = len(seq.generated)
            if self.eos_after is not None and made == self.eos_after:
                token = EOS
            else:
                token = OFFSET + REPLY[len(seq.tokens) % len(REPLY)]
            seq.tokens.append(token)
            new.append(token)
            if token == EOS:
                reason = "stop"
                break
            if len(seq.generated) >= seq.sampling.max_tokens:
                reason = "length"
                break
        if drafted is not None and accepted is not None:
            seq.stats.record_step(drafted, min(accepted, len(new) - 1))
            accepted = min(accepted, len(new) - 1)
        self._blocks[id(seq)] = math.ceil(len(seq.tokens) / BLOCK_SIZE)
        k = seq.sampling.logprobs
        new_logprobs = None if k is None else [fake_logprob(t, k) for t in new]
        out = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new,
            token_ids=list(seq.generated),
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            stats=seq.stats,
            step_drafted=drafted,
            step_accepted=accepted,
            new_logprobs=new_logprobs,
            prompt_logprobs=prompt_logprobs,
        )
        if reason is not None:
            del self._requests[seq.request_id]
            self._end(seq)
        return out

    def _end(self, seq: _Seq) -> None:
        seq.running = False
        if seq.session_id is None:
            self._release(seq)

    def _release(self, seq: _Seq) -> int:
        blocks = self._blocks.pop(id(seq), 0)
        nbytes = blocks * BYTES_PER_BLOCK
        self._zero_events.append(
            ZeroEvent(seq.owner, seq.request_id or None, seq.session_id, blocks, nbytes)
        )
        return nbytes
