"""The faults a request in flight may end with; its consumer answers each differently
(``gateway/generation.py:fault_error``: 503, 400, 504, 502)."""

from __future__ import annotations


class NoWorker(Exception):
    """No worker can take the request now (answer 503 with Retry-After)."""


class NotSendable(Exception):
    """The request does not fit the wire protocol (its bounds or the bus message size)."""


class StageTimeout(Exception):
    """A stage passed its deadline."""


class WorkerFailure(Exception):
    """A worker failed the request or vanished mid-request (a server fault, not bad input)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


def check_ending(finish_reason: str | None, worker_id: str) -> None:
    """Only "stop" and "length" are a normal end; a worker-side abort or error without a
    message must still reach the client as an error, never as a short successful answer."""
    if finish_reason not in (None, "stop", "length"):
        raise WorkerFailure(
            f"worker {worker_id} ended the request ({finish_reason})", finish_reason
        )
