"""One choice of a response as it is generated: its text (incremental detokenization, then stop
strings), its tokens' log-probs, and how it ended."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.gateway.detokenizer import IncrementalDetokenizer, StopStringMatcher
from pdserve.gateway.inflight_types import TokenEvent
from pdserve.gateway.logprob_format import LogprobEntry, LogprobList
from pdserve.gateway.tokenizer import ModelTokenizer
from pdserve.shared.logprobs import TokenLogprobs


class OutputText:
    """Tokens in, client text out: incremental detokenization, then stop strings."""

    def __init__(self, tok: ModelTokenizer, stops: list[str]) -> None:
        self.detok = IncrementalDetokenizer(tok)
        self.stops = StopStringMatcher(stops)
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        text, self.stopped = self.stops.feed(self.detok.add(token_ids))
        return text

    def finish(self) -> str:
        if self.stopped:
            return ""
        text, self.stopped = self.stops.feed(self.detok.finish())
        return text if self.stopped else text + self.stops.flush()


@dataclass
class Piece:
    """What one token event adds to a choice: text (maybe empty), the new tokens'
    log-prob entries (empty unless asked) and the new tokens' ids."""

    text: str
    logprobs: list[LogprobEntry] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


class ResponseChoice:
    """One choice: ``index`` is its place in the response (prompt i's choice j is i * n + j),
    ``prompt`` the prompt it answers."""

    def __init__(
        self,
        index: int,
        tok: ModelTokenizer,
        stops: list[str],
        with_logprobs: bool,
        prompt: int = 0,
    ) -> None:
        self.index = index
        self.prompt = prompt
        self.out = OutputText(tok, stops)
        self.token_ids: list[int] = []
        self.logprobs: LogprobList | None = LogprobList() if with_logprobs else None
        self.finish_reason: str | None = None
        self.pieces: list[str] = []  # the text so far, for a non-streamed answer
        self.cumulative_logprob = 0.0  # of the generated tokens (best_of ranks by it)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def prepend_prompt(
        self, text: str, prompt_ids: list[int], prompt_logprobs: TokenLogprobs | None
    ) -> Piece:
        """Echo: the prompt's text (and tokens with their log-probs) before the output."""
        entries: list[LogprobEntry] = []
        if self.logprobs is not None:
            self.logprobs.add_prompt(prompt_ids, prompt_logprobs)
            entries = list(self.logprobs.entries)
        self.pieces.append(text)
        return Piece(text, entries)

    def add(self, event: TokenEvent) -> Piece:
        """Take the choice's next token event; ``done`` tells whether it ended the choice."""
        if self.done:
            return Piece("")
        entries: list[LogprobEntry] = []
        if event.logprobs is not None:
            self.cumulative_logprob += sum(event.logprobs.token_logprobs)
            if self.logprobs is not None:
                entries = self.logprobs.add(event.token_ids, event.logprobs)
        self.token_ids.extend(event.token_ids)
        text = self.out.add(event.token_ids)
        if self.out.stopped:
            self.finish_reason = "stop"
        elif event.finish_reason is not None:
            text += self.out.finish()
            self.finish_reason = "stop" if self.out.stopped else event.finish_reason
        self.pieces.append(text)
        return Piece(text, entries, list(event.token_ids))

    def end(self, reason: str) -> Piece:
        """The request ended without this choice's own finish (it cannot happen on a normal
        end; kept so a choice never stays open)."""
        if self.done:
            return Piece("")
        text = self.out.finish()
        self.finish_reason = "stop" if self.out.stopped else reason
        self.pieces.append(text)
        return Piece(text)
