"""The choices of one API request, each its own engine request (a ``Generation``), answered
together: ``n`` per prompt, and on ``/v1/completions`` a batch of prompts.

Choice ``i`` of prompt ``p`` has index ``p * n + i``, as in OpenAI's and vLLM's responses. With a
seed, choice ``i`` samples with ``seed + i``: the ``n`` choices differ and each stays
reproducible. Admission is all or nothing: every choice is queued at once, and if one is refused
(quota, full queue, an input the engine rejects) the others are closed, which aborts their
engine requests and zeroes their KV. The usage counts each prompt's tokens once and sums the
completions and the speculative statistics over the choices.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from itertools import zip_longest

from fastapi import Request

from app.generation import Generation, GenerationInput, build_usage, until_done_or_disconnect
from app.schemas import MAX_SEED, Usage
from app.service import Service
from app.tenants import Tenant
from engine.logprobs import TokenLogprob
from engine.outputs import SpecStats

# (choice index, text or None, finish reason or None, log-probabilities received since the
# choice's last event or None where not asked for): one piece of a choice's stream.
Event = tuple[int, str | None, str | None, list[TokenLogprob] | None]


class Choices:
    def __init__(self, gens: list[Generation], n: int) -> None:
        if not gens or len(gens) % n:
            raise ValueError(f"{len(gens)} generations do not make choices of n={n} per prompt")
        self.gens = gens
        self.n = n
        self.request_id = gens[0].request_id
        self.created = gens[0].created
        self.tokenizer = gens[0].service.engine.tokenizer

    @classmethod
    def build(
        cls, service: Service, tenant: Tenant, prompts: list[GenerationInput], n: int, prefix: str
    ) -> Choices:
        """``n`` choices of each input, the seed of choice ``i`` moved on by ``i``."""
        gens = [
            Generation(service, tenant, _seed_moved_on(inp, i), prefix)
            for inp in prompts
            for i in range(n)
        ]
        return cls(gens, n)

    async def start(self, request: Request) -> None:
        """Queue every choice, then wait until the engine accepted them all."""
        try:
            for gen in self.gens:
                await gen.submit()
            for gen in self.gens:
                await gen.wait_admitted(request)
        except BaseException:
            self.close()
            raise

    async def events(self) -> AsyncIterator[Event]:
        """Every choice's text pieces as they become final, interleaved as they come, and
        each choice's finish (text None, its finish reason) after its last piece; each with
        the log-probabilities received since the choice's last event."""
        queue: asyncio.Queue[Event | BaseException] = asyncio.Queue()

        async def pump(index: int, gen: Generation) -> None:
            try:
                async for text in gen.deltas():
                    queue.put_nowait((index, text, None, gen.take_logprobs()))
                queue.put_nowait((index, None, gen.finish_reason or "stop", gen.take_logprobs()))
            except Exception as exc:  # RequestFailed: the stream reports it
                queue.put_nowait(exc)

        tasks = [asyncio.create_task(pump(i, gen)) for i, gen in enumerate(self.gens)]
        try:
            for _ in range(len(self.gens)):
                while True:
                    item = await queue.get()
                    if isinstance(item, BaseException):
                        raise item
                    yield item
                    if item[2] is not None:
                        break
        finally:
            for task in tasks:
                task.cancel()

    async def collect(self, request: Request) -> list[str]:
        """Every choice's whole text (raises ClientGone if the client leaves first)."""

        async def run() -> list[str]:
            parts: list[list[str]] = [[] for _ in self.gens]
            async for index, text, *_ in self.events():
                if text:
                    parts[index].append(text)
            return ["".join(p) for p in parts]

        texts: list[str] = await until_done_or_disconnect(request, run())
        return texts

    def usage(self) -> Usage:
        if len(self.gens) == 1:
            return self.gens[0].usage()
        stats = SpecStats()
        for gen in self.gens:
            if gen.stats is not None:
                stats.num_steps += gen.stats.num_steps
                stats.num_draft_tokens += gen.stats.num_draft_tokens
                stats.num_accepted_tokens += gen.stats.num_accepted_tokens
                stats.accepted_per_position = [
                    a + b
                    for a, b in zip_longest(
                        stats.accepted_per_position, gen.stats.accepted_per_position, fillvalue=0
                    )
                ]
        prompt = sum(
            len(gen.inp.prompt_token_ids) for gen in self.gens[:: self.n]
        )  # each prompt once
        completion = sum(gen.completion_tokens for gen in self.gens)
        return build_usage(prompt, completion, stats if stats.num_steps else None, None)

    def close(self, error: bool = False) -> None:
        """Idempotent, never awaits: closes every choice (aborting those still running)."""
        for gen in self.gens:
            gen.close(error=error)


def _seed_moved_on(inp: GenerationInput, by: int) -> GenerationInput:
    """``inp`` with its sampling seed (if any) moved on by ``by``."""
    seed = inp.sampling.seed
    if not by or seed is None:
        return inp
    sampling = dataclasses.replace(inp.sampling, seed=(seed + by) % (MAX_SEED + 1))
    return dataclasses.replace(inp, sampling=sampling)
