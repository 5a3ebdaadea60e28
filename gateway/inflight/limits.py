"""What a request in flight runs under: its deadlines, as the gateway's options say when it
arrives (``Limits``; how they follow progress: ``bus_request.py``), and how often a stage is
tried on another worker.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

PREFILL_ATTEMPTS = 3  # prefill is idempotent: a dead or overloaded worker's request goes elsewhere
DECODE_ATTEMPTS = 3  # a decode worker that refuses a request before its first token
RETRYABLE_CODES = ("overloaded", "draining")
DEFAULT_MAX_MIGRATIONS = 3  # a request's re-dispatches after losing its decode worker
# The latest deadline a message carries when no limit applies: the wire's bound is 1e12 (a
# deadline is a Unix time) and infinity is not JSON; this is the year 5138.
WIRE_NO_DEADLINE = 1e11


@dataclass(frozen=True)
class Limits:
    """What one request runs under, as the dispatcher's options say when it arrives (seconds,
    0 = no limit; see ``bus_request.py``)."""

    request_timeout: float  # a total cap, only where the operator sets one
    prefill_timeout: float  # per prefill attempt
    first_token_timeout: float  # of the request, and of each leg on a new decode worker
    stall_timeout: float  # between two tokens
    max_migrations: int  # re-dispatches after losing a decode worker
    worker_timeout: float  # the registry's: a stream check waits CHECK_TIMEOUTS of these

    def overdue(self, limit: str, stage: str) -> str:
        """Why a wait timed out: ``limit`` ("request", "prefill", "stall" or "first_token")
        passed, during ``stage``; the message names the option."""
        seconds = getattr(self, f"{limit}_timeout")
        why = {
            "request": f"the request took longer than --request-timeout ({seconds:g} s)",
            "prefill": f"the stage passed its --prefill-timeout ({seconds:g} s)",
            "stall": f"no new token for --stall-timeout ({seconds:g} s)",
            "first_token": f"no first token within --first-token-timeout ({seconds:g} s)",
        }[limit]
        return f"{why} in the {stage} stage"


def due_in(seconds: float) -> float:
    """The time ``seconds`` from now, or never when the limit is off (0)."""
    return time.time() + seconds if seconds > 0 else math.inf


def on_wire(deadline: float) -> float:
    return min(deadline, WIRE_NO_DEADLINE)
