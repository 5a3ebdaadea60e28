"""Stop strings, matched on the detokenized text as it streams.

A stop string can straddle chunks, so the tail of the text that could still grow into one is
held back until it either completes the match (the request stops, and neither the stop string
nor anything after it is sent, as OpenAI does) or stops being a possible prefix.
"""

from __future__ import annotations


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
