"""The log of the HTTP connections' own faults (aiohttp's ``logger``, ``create_app``): a malformed
request - a line or header past ``--http-max-*``, garbage on the port - is aiohttp's to answer
(400) and to log, by default at ERROR with its traceback, once per request. A flood of them
would flood the log, so here each is one WARNING line without traceback, at most one a second,
the next one saying how many were left out."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from aiohttp.http_exceptions import HttpProcessingError

LOGGER_NAME = "pdserve.gateway.http"


class ProtocolErrorFilter(logging.Filter):
    def __init__(self, interval: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval = interval
        self._clock = clock
        self._next = 0.0
        self.left_out = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True  # anything else is logged as aiohttp says
        now = self._clock()
        if now < self._next:
            self.left_out += 1
            return False
        self._next = now + self.interval
        text = record.getMessage() + f": {exc.message}"
        if self.left_out:
            text += f" ({self.left_out} more such requests left out of the log)"
            self.left_out = 0
        record.msg, record.args, record.exc_info, record.exc_text = text, None, None, None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def http_logger() -> logging.Logger:
    """The logger the gateway's connections use, with its filter (added once per process)."""
    logger = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(f, ProtocolErrorFilter) for f in logger.filters):
        logger.addFilter(ProtocolErrorFilter())
    return logger
