"""A request and the receives for its answer, posted together and followed by one future.

A KV pull sends its request and posts every receive of the answer - the reply, the data into
its blocks, the checksums - while the request travels (``transfer/client.py``). Tracked one by
one, each was a future and a stream the driver looks at after every progress call, and the
puller woke through a callback that gathered them: a loop turn of Python after the last byte,
and another while the data moved (issue 29). Here they are one batch of the driver's
(``ucx_progress``), resolved straight into the future the puller awaits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from pdserve.shared.kv.ucx_progress import _API, _Batch, _open, driver


class Exchange(_Batch):
    """A request's send, then the receives posted for its answer (the reply first), seen by the
    driver as one request: ``future`` is completed once all are - or, sooner, with the send's
    error (nothing will answer it), or once the reply is in and ``early()`` says the rest will
    never come. Resolved sooner (or cancelled by its waiter), the operations still running stay
    tracked, their buffers held, until UCX completes them: ``settled`` says when."""

    def __init__(self, requests: list[Any], early: Callable[[], bool] | None) -> None:
        super().__init__(requests)
        self.early = early
        self.future: asyncio.Future | None = None
        self.looked = 0  # 1: the send's outcome was looked at; 2: the reply's too

    @property
    def completed(self) -> bool:
        done = self._advance()  # the driver asks after each of its progress calls
        if done == len(self.requests):
            return True
        future = self.future
        if self.looked < 2 and self.looked < done and future is not None:
            if not future.done():
                self._look(future)
        return False

    def _look(self, future: asyncio.Future) -> None:
        if self.looked == 0:
            self.looked = 1
            try:
                self.requests[0].check_error()
            except Exception as exc:
                self.looked = 2
                future.set_exception(exc)
                return
        if self.done >= 2:
            self.looked = 2
            if self.early is not None and self.early():
                future.set_result(None)

    async def settled(self, timeout: float) -> bool:
        """Whether UCX completes every operation posted within ``timeout`` seconds - with data,
        empty, or failed - so that none can write into its buffer any more. A cancel of the
        caller answers False (it aborts the endpoint, which completes them)."""
        done = driver().track(_Batch(self.requests), None)
        try:
            await asyncio.wait_for(done, max(0.0, timeout))
        except (TimeoutError, asyncio.CancelledError):
            return False
        except Exception:  # one of them failed: completed all the same
            pass
        return True


def ask(ep: Any, buffer: Any, tag: int) -> Any:
    """Post a send of ``buffer`` on ``ep`` with exactly ``tag``, untracked: pass what this
    returns to ``exchange``, which keeps ``buffer`` until the send is done. Raises if the
    endpoint cannot take it."""
    api = _API.load()
    return _open(ep).tag_send(api.Array(buffer), api.Tag(tag))


def exchange(
    ep: Any,
    asked: Any,
    request: Any,
    buffers: list[Any],
    tags: list[int],
    early: Callable[[], bool] | None = None,
) -> tuple[asyncio.Future, Exchange]:
    """Receive one message with each of ``tags`` from ``ep``'s peer into the buffer at its
    place (the first is the reply, which ``early`` may read once it is in), in order per tag;
    one future for them and the send ``asked`` of ``request``, and the exchange it follows (see
    ``Exchange``). A failure to post comes back through the future."""
    api = _API.load()
    progress = driver()
    requests: list[Any] = [asked]
    held = [request, *buffers]
    try:
        raw = _open(ep)
        utags = {tag: api.Tag(tag) for tag in set(tags)}
        mask, array = api.TagMaskFull, api.Array
        for buf, tag in zip(buffers, tags, strict=True):
            arr = buf if type(buf) is array else array(buf)  # ucx_progress.array: built before
            requests.append(raw.tag_recv(arr, utags[tag], mask))
    except Exception as exc:  # UCX owns the buffers of those posted until they complete
        failed = Exchange(requests, None)
        failed.future = future = progress.track(failed, held)
        future.set_exception(exc)
        return future, failed
    batch = Exchange(requests, early)
    batch.future = future = progress.track(batch, held)
    return future, batch
