"""One choice of a response as it is generated: its text (incremental detokenization, then stop
strings), its tokens' log-probs, and how it ended.

Decoding token by token breaks text in two ways: a byte-level token may hold only part of a
multi-byte UTF-8 character (it decodes to U+FFFD until the rest arrives), and some decoders
change a token's text depending on what precedes it (e.g. SentencePiece's leading space). So we
decode a short window of recent tokens twice, with and without the new ones, and emit only the
difference, holding it back while it ends in an incomplete character. ``finish`` reconciles with
the full decode, so the streamed pieces always concatenate to ``decode(all_ids)``.

A stop string can straddle chunks, so the tail of the text that could still grow into one is
held back until it either completes the match (the request stops, and neither the stop string
nor anything after it is sent, as OpenAI does) or stops being a possible prefix.

With ``--reasoning-parser``, a chat choice's text first goes through a ``ReasoningSplitter``
(``gateway/reasoning.py``): its reasoning becomes ``reasoning_content`` deltas, and only the
rest is content. A chat choice whose request has tools (``ToolSetup.parses_calls``) then runs
that content through a ``ToolCallStream``: a piece carries the message's content and
``tool_calls`` deltas, and a choice that ends on its own with calls ends with ``tool_calls``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.gateway.inflight.delivery import TokenEvent
from pdserve.gateway.logprob_format import LogprobEntry, LogprobList
from pdserve.gateway.reasoning import Event, ReasoningSetup, ReasoningSplitter
from pdserve.gateway.tokenizer import ModelTokenizer
from pdserve.gateway.tools.formats import partial_suffix
from pdserve.gateway.tools.setup import ToolSetup
from pdserve.gateway.tools.stream import ToolCallStream
from pdserve.shared.sampling import TokenLogprobs


class StopStringMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        """Add new text; return (text safe to emit, whether a stop string matched)."""
        if self.matched is not None:
            return "", True
        if not self.stops:
            return text, False
        buf = self._pending + text
        first = -1
        for stop in self.stops:
            at = buf.find(stop)
            if at != -1 and (first == -1 or at < first):
                first, self.matched = at, stop
        if first != -1:
            self._pending = ""
            return buf[:first], True
        hold = self._partial_suffix(buf)
        self._pending = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that is a proper prefix of some stop string."""
        return max(partial_suffix(buf, stop) for stop in self.stops)

    def flush(self) -> str:
        """The generation ended without a match: release the held tail."""
        held, self._pending = self._pending, ""
        return "" if self.matched is not None else held


REPLACEMENT = "\ufffd"


CONTEXT_TOKENS = 4  # emitted tokens kept in the decode window as context


class IncrementalDetokenizer:
    def __init__(self, tokenizer: ModelTokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # everything emitted so far
        # Tokens [prefix, read) are context whose text is fully emitted; tokens from read on
        # end mid-character so far, and of their text only ``_partial`` has been emitted.
        self._prefix_offset = 0
        self._read_offset = 0
        self._partial = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int]) -> str:
        """Take newly generated tokens; return the text that is now safe to emit (maybe '')."""
        if not new_ids:
            return ""
        self.token_ids.extend(new_ids)
        base = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        after = self._decode(self.token_ids[self._prefix_offset :])
        if not after.startswith(base):
            return ""  # the decoder rewrote context text (rare normalisation): wait for more
        new_text = after[len(base) :]
        # Byte-level merges may cross character boundaries, so several tokens in a row can
        # each end mid-character: emit the complete characters, hold the incomplete tail.
        complete = not new_text.endswith(REPLACEMENT)
        safe = new_text if complete else new_text.rstrip(REPLACEMENT)
        if not safe.startswith(self._partial):
            return ""
        delta = safe[len(self._partial) :]
        if complete:
            self._read_offset = len(self.token_ids)
            self._prefix_offset = self._context_start(self._read_offset)
            self._partial = ""
        else:
            self._partial = safe
        self.text += delta
        return delta

    def _context_start(self, end: int) -> int:
        """Start of a context window ending at ``end`` with a few non-special tokens in it.

        Decoders treat the first token specially (SentencePiece drops its leading space) and
        skipped special tokens decode to nothing, so the context must hold real tokens.
        """
        start, seen = end, 0
        while start > 0 and seen < CONTEXT_TOKENS:
            start -= 1
            if self.token_ids[start] not in self.tokenizer.special_ids:
                seen += 1
        return start

    def finish(self) -> str:
        """Emit whatever is still held so the stream matches the full decode."""
        full = self._decode(self.token_ids)
        self._prefix_offset = self._read_offset = len(self.token_ids)
        self._partial = ""
        if full.startswith(self.text):
            delta = full[len(self.text) :]
            self.text = full
            return delta
        # Unreachable for byte-level and SentencePiece decoders; keep what was sent consistent.
        return ""


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
    log-prob entries (empty unless asked) and the new tokens' ids. With tools or a reasoning
    parser, ``text`` is the content only and ``deltas`` the chat deltas in order
    (``{"content"}`` / ``{"reasoning_content"}`` / ``{"tool_calls"}``); else ``deltas`` is
    None."""

    text: str
    logprobs: list[LogprobEntry] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    deltas: list[dict[str, Any]] | None = None


class ResponseChoice:
    """One choice: ``index`` is its place in the response (prompt i's choice j is i * n + j),
    ``prompt`` the prompt it answers, ``tools`` what its chat request asked of tool calls,
    ``reasoning`` how its answer's reasoning is split out (chat with ``--reasoning-parser``)."""

    def __init__(
        self,
        index: int,
        tok: ModelTokenizer,
        stops: list[str],
        with_logprobs: bool,
        prompt: int = 0,
        tools: ToolSetup | None = None,
        reasoning: ReasoningSetup | None = None,
    ) -> None:
        self.index = index
        self.prompt = prompt
        self.out = OutputText(tok, stops)
        self.token_ids: list[int] = []
        self.logprobs: LogprobList | None = LogprobList() if with_logprobs else None
        self.finish_reason: str | None = None
        self.pieces: list[str] = []  # the text so far, for a non-streamed answer
        self.cumulative_logprob = 0.0  # of the generated tokens (best_of ranks by it)
        self.tools = tools if tools is not None and tools.parses_calls else None
        self.calls = ToolCallStream(self.tools) if self.tools is not None else None
        self.reasoning = reasoning
        self._thoughts = ReasoningSplitter(reasoning) if reasoning is not None else None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The generated text, reasoning and calls included (``reasoning.split`` and
        ``tools.parsers.parse`` split it)."""
        return "".join(self.pieces)

    @property
    def reply_finish(self) -> str | None:
        """The finish reason the client sees: ``tool_calls`` for an answer with calls that
        ended on its own (``finish_reason`` itself stays ``stop``: the request's stop logic
        reads it)."""
        if self.finish_reason == "stop" and self.calls is not None and self.calls.has_calls:
            return "tool_calls"
        return self.finish_reason

    def _piece(self, text: str, entries: list[LogprobEntry], ids: list[int]) -> Piece:
        """Record the choice's new text; split its reasoning out, and read the rest for calls."""
        self.pieces.append(text)
        if self.calls is None and self._thoughts is None:
            return Piece(text=text, logprobs=entries, token_ids=ids)
        events: list[Event] = [("content", text)]
        if self._thoughts is not None:
            events = self._thoughts.feed(text) + (self._thoughts.finish() if self.done else [])
        deltas: list[dict[str, Any]] = []
        for kind, value in events:
            if kind == "reasoning":
                deltas.append({"reasoning_content": value})
            elif self.calls is None:
                deltas.append({"content": value})
            else:
                deltas += self.calls.feed(value)  # calls are read in the content only
        if self.done and self.calls is not None:
            deltas += self.calls.finish()
        content = "".join(d.get("content", "") for d in deltas)
        return Piece(text=content, logprobs=entries, token_ids=ids, deltas=deltas)

    def prepend_prompt(
        self, text: str, prompt_ids: list[int], prompt_logprobs: TokenLogprobs | None
    ) -> Piece:
        """Echo: the prompt's text (and tokens with their log-probs) before the output."""
        entries: list[LogprobEntry] = []
        if self.logprobs is not None:
            self.logprobs.add_prompt(prompt_ids, prompt_logprobs)
            entries = list(self.logprobs.entries)
        self.pieces.append(text)
        return Piece(text=text, logprobs=entries)

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
        return self._piece(text, entries, list(event.token_ids))

    def end(self, reason: str) -> Piece:
        """The request ended without this choice's own finish (it cannot happen on a normal
        end; kept so a choice never stays open)."""
        if self.done:
            return Piece("")
        text = self.out.finish()
        self.finish_reason = "stop" if self.out.stopped else reason
        return self._piece(text, [], [])
