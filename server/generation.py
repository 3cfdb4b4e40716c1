"""From engine token deltas to OpenAI choices: detokenize, apply stop strings, finish early,
and abort on the worker when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from scheduler.protocol import LogprobEntry
from scheduler.sampling_params import SamplingParams
from server.detokenizer import IncrementalDetokenizer, StopStringMatcher
from server.engine_client import EngineClient, RequestError


@dataclass
class ChoiceEvent:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[LogprobEntry] | None
    finish_reason: str | None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0


@dataclass
class ChoiceSpec:
    index: int
    request_id: str
    prompt: list[int]
    params: SamplingParams


async def run_choice(client: EngineClient, tokenizer, spec: ChoiceSpec, stops: list[str],
                     skip_special_tokens: bool = True) -> AsyncIterator[ChoiceEvent]:
    stream = client.submit(spec.request_id, spec.prompt, spec.params)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    matcher = StopStringMatcher(stops)
    try:
        while True:
            item = await stream.queue.get()
            if isinstance(item, RequestError):
                raise item
            final = item.finished
            text = matcher.feed(detok.push(item.token_ids, final=final), final=final)
            reason = item.finish_reason if final else None
            if matcher.stopped:
                reason = "stop"
                if not final:
                    await client.abort(spec.request_id, "stop")
            yield ChoiceEvent(spec.index, text, item.token_ids, item.logprobs, reason,
                              stream.num_prompt_tokens, stream.num_output_tokens)
            if reason is not None:
                return
    finally:
        if not stream.done:  # cancelled: the client went away
            await client.abort(spec.request_id)


async def merge_choices(gens: list[AsyncIterator[ChoiceEvent]]) -> AsyncIterator[ChoiceEvent]:
    """Interleave the events of several choices as they come."""
    if len(gens) == 1:
        try:
            async for ev in gens[0]:
                yield ev
        finally:
            await gens[0].aclose()  # runs run_choice's abort-on-disconnect now, not at GC
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(g):
        try:
            async for ev in g:
                await queue.put(ev)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put(e)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(g)) for g in gens]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
