"""One admitted generation request: tokens from the dispatcher in, each choice's text out.

A ``Generation`` sends each of the request's prompts to the workers (a prompt array becomes
independent requests; ``n``/``best_of`` choices are forked on one decode worker) and yields every
choice's pieces as they come; a ``ResponseChoice`` assembles each choice's text and log-probs,
and ``Progress`` counts usage and latency. Serving it - streamed or whole - is
``gateway/serving.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from pdserve.gateway.api_models import GenerationParams
from pdserve.gateway.app_state import Gateway
from pdserve.gateway.errors import APIError, overloaded, timeout_error
from pdserve.gateway.inflight.delivery import OpenChoices, TokenEvent
from pdserve.gateway.inflight.faults import NotSendable, NoWorker, StageTimeout, WorkerFailure
from pdserve.gateway.logprob_format import (
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    trim_alternatives,
)
from pdserve.gateway.response_choice import Piece, ResponseChoice
from pdserve.shared.sampling import SamplingParams, TokenLogprobs


@dataclass
class Prompt:
    ids: list[int]
    text: str  # what echo sends back: the prompt as given, or its ids' decoding


@dataclass
class Progress:
    """What one request has produced so far, for usage, metrics and spans."""

    prompt_tokens: int
    arrived: float = field(default_factory=time.monotonic)
    completion_tokens: int = 0
    cached_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: str | None = None
    # charges completion tokens to the caller's API key as they arrive (gateway/key_limits.py)
    charge: Callable[[int], None] | None = None

    def tokens(self, gw: Gateway, event: TokenEvent) -> None:
        now = time.monotonic()
        n = len(event.token_ids)
        if event.cached_tokens is not None:
            self.cached_tokens += event.cached_tokens
        if n == 0:
            return
        if self.charge is not None:
            self.charge(n)
        if self.first_token_at is None:
            self.first_token_at = now
            gw.metrics.ttft.observe(now - self.arrived)
            n -= 1
        if n > 0 and self.last_token_at is not None:
            gap = (now - self.last_token_at) / n
            for _ in range(n):
                gw.metrics.itl.observe(gap)
        self.completion_tokens += len(event.token_ids)
        self.last_token_at = now

    def usage(self) -> dict[str, Any]:
        return {
            **self.running_usage(),
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def running_usage(self) -> dict[str, Any]:
        """The usage so far, in the shape vLLM's continuous_usage_stats puts on every chunk."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


FAULTS = (NotSendable, NoWorker, StageTimeout, WorkerFailure)


def fault_error(exc: Exception) -> APIError:
    if isinstance(exc, NotSendable):
        return APIError(400, f"The request cannot be sent to the workers: {exc}")
    if isinstance(exc, NoWorker):
        return overloaded(f"{exc}; retry shortly", retry_after=1.0)
    if isinstance(exc, StageTimeout):
        return timeout_error(f"request timed out: {exc}")
    if isinstance(exc, WorkerFailure) and exc.code in ("overloaded", "draining"):
        return overloaded(f"workers are busy: {exc}; retry shortly", retry_after=1.0)
    if isinstance(exc, WorkerFailure) and exc.code == "deadline":
        return timeout_error(f"request timed out on a worker: {exc}")
    if isinstance(exc, WorkerFailure):
        return APIError(
            502, f"worker error: {exc}", type="server_error", code=exc.code or "worker_error"
        )
    raise exc


@dataclass
class Generation:
    """One admitted generation request: its prompts, their choices, and what they produced."""

    gw: Gateway
    operation: str
    params: GenerationParams
    prompts: list[Prompt]
    samplings: list[SamplingParams]  # one per prompt
    client_id: str
    progress: Progress
    choices: list[ResponseChoice] = field(init=False)

    def __post_init__(self) -> None:
        tok = self.gw.model.tokenizer if self.gw is not None else None
        self.texts = TokenTexts(tok) if tok is not None else None
        with_logprobs = self.params.logprobs is not None
        self.choices = [
            ResponseChoice(
                i,
                tok,
                self.params.stop,
                with_logprobs,
                i // self.per_prompt,
                self.params.tools,
                self.params.reasoning,
            )
            for i in range(len(self.prompts) * self.per_prompt)
        ]
        # each prompt's log-probs, when the engine computed them (echo, prompt_logprobs)
        self.prompt_logprobs: list[TokenLogprobs | None] = [None] * len(self.prompts)

    @property
    def chat(self) -> bool:
        return self.operation == "chat"

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.client_id

    @property
    def per_prompt(self) -> int:
        """Choices generated per prompt: best_of of them when the n best are returned."""
        return max(self.params.n, self.params.best_of or 1)

    def logprobs_json(self, choice: ResponseChoice, piece: Piece, offset: int) -> Any:
        """A piece's log-probs in the endpoint's shape (None when none were asked)."""
        if choice.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(piece.logprobs, self.texts)
        return completion_logprobs(piece.logprobs, self.texts, offset)

    async def pieces(self) -> AsyncGenerator[tuple[ResponseChoice, Piece], None]:
        """Every choice's text as it is generated, in arrival order: ``(choice, piece)``; after
        a choice's last piece ``choice.done`` is true. Raises the dispatcher's faults."""
        if len(self.prompts) == 1:
            async with contextlib.aclosing(self._prompt_pieces(0)) as pieces:
                async for item in pieces:
                    yield item
            return
        queue: asyncio.Queue[tuple[ResponseChoice, Piece] | BaseException | None] = asyncio.Queue()

        async def feed(p: int) -> None:
            try:
                async with contextlib.aclosing(self._prompt_pieces(p)) as pieces:
                    async for item in pieces:
                        queue.put_nowait(item)
                queue.put_nowait(None)
            except Exception as exc:  # handed to the consumer, which raises it
                queue.put_nowait(exc)

        tasks = [asyncio.ensure_future(feed(p)) for p in range(len(self.prompts))]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()  # closes their dispatcher streams, which cancels the requests
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _prompt_pieces(self, p: int) -> AsyncIterator[tuple[ResponseChoice, Piece]]:
        prompt, sampling = self.prompts[p], self.samplings[p]
        mine = self.choices[p * self.per_prompt : (p + 1) * self.per_prompt]
        # max_tokens 0 generates nothing: one engine choice stands for all of them
        fanout = sampling.n == 1 and len(mine) > 1
        choices = OpenChoices(sampling.n)
        context = trace.set_span_in_context(trace.get_current_span())
        events = self.gw.dispatcher.generate(
            self.client_id if len(self.prompts) == 1 else f"{self.client_id}-{p}",
            prompt.ids,
            sampling,
            context,
            choices,
            lora=self.gw.lora_of(self.params.model),
        )
        started: set[int] = set()
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    self.progress.tokens(self.gw, event)
                    # The prompt's log-probs come once, with choice 0's first event; echo
                    # repeats them in every choice of the prompt, as OpenAI and vLLM do.
                    if event.prompt_logprobs is not None:
                        self.prompt_logprobs[p] = event.prompt_logprobs
                    for choice in mine if fanout else [mine[event.index]]:
                        if self.params.echo and choice.index not in started:
                            started.add(choice.index)
                            echoed = self._echoed_logprobs(p)
                            yield choice, choice.prepend_prompt(prompt.text, prompt.ids, echoed)
                        piece = choice.add(event)
                        if (
                            choice.done
                            and choice.finish_reason == "stop"
                            and event.finish_reason is None
                        ):
                            choices.stop(event.index)  # a stop string: the workers stop it
                        yield choice, piece
                    if not choices.open:
                        break
        except FAULTS:
            self.progress.finish_reason = "error"
            raise
        for choice in mine:
            if not choice.done:
                yield choice, choice.end("stop")
        self.progress.finish_reason = mine[-1].finish_reason

    def _echoed_logprobs(self, p: int) -> TokenLogprobs | None:
        """Prompt ``p``'s log-probs with echo's ``logprobs`` alternatives (prompt_logprobs may
        have asked the engine for more)."""
        logprobs, k = self.prompt_logprobs[p], self.params.logprobs
        return logprobs if logprobs is None or k is None else trim_alternatives(logprobs, k)

    def returned(self) -> list[ResponseChoice]:
        """The choices a complete answer returns: with best_of, each prompt's n likeliest
        (highest cumulative log-prob of their tokens), renumbered in that order."""
        n, per = self.params.n, self.per_prompt
        if per == n:
            return self.choices
        best: list[ResponseChoice] = []
        for p in range(len(self.prompts)):
            group = self.choices[p * per : (p + 1) * per]
            ranked = sorted(group, key=lambda c: c.cumulative_logprob, reverse=True)[:n]
            for j, choice in enumerate(ranked):
                choice.index = p * n + j
                best.append(choice)
        return best
