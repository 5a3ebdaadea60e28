"""Incremental detokenization for streaming, and stop strings matched on the text it yields.

Decoding token by token breaks text in two ways: a byte-level token may hold only part of a
multi-byte UTF-8 character (it decodes to U+FFFD until the rest arrives), and some decoders
change a token's text depending on what precedes it (e.g. SentencePiece's leading space). So we
decode a short window of recent tokens twice, with and without the new ones, and emit only the
difference, holding it back while it ends in an incomplete character. ``finish`` reconciles with
the full decode, so the streamed pieces always concatenate to ``decode(all_ids)``.

A stop string can straddle chunks, so the tail of the text that could still grow into one is
held back until it either completes the match (the request stops, and neither the stop string
nor anything after it is sent, as OpenAI does) or stops being a possible prefix.
"""

from __future__ import annotations

from pdserve.gateway.tokenizer import ModelTokenizer


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
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:k]):
                    longest = k
                    break
        return longest

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
