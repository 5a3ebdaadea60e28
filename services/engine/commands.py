"""What crosses into the engine thread: commands, applied in order at the start of a step, and
the one stream that comes out besides step results, the prefix cache's events
(``kv_event_feed.py``).

Other threads never touch engine state. They post a command through ``EngineCommands``, the
engine's base (``LLMEngine.add_request``, ``abort``, ``release``, ``kv_ready``, ``kv_failed``,
``hold_block``), and the thread that steps the engine applies it before it schedules. A command
that needs an answer carries a ``concurrent.futures.Future`` (``asyncio.wrap_future`` awaits it
from an event loop).
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from pdserve.services.engine.kv_event_feed import KVEventFeed  # noqa: F401 (moved there)
from pdserve.shared.sampling import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    bus_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    output_token_ids: tuple[int, ...] = ()  # tokens generated elsewhere (the first token)
    remote_kv: bool = False  # the prompt's KV is pulled from a prefill worker, not computed
    lora: str | None = None  # the LoRA adapter it runs under (--lora-modules), None: the base


@dataclass(frozen=True)
class Abort:
    bus_id: str
    index: int | None = None  # one choice (sampling.n > 1), or None: the whole request


@dataclass(frozen=True)
class Release:
    bus_id: str  # a parked (PREFILLED) request or a held block


@dataclass(frozen=True)
class KVReady:
    bus_id: str
    first_token: int | None = None  # a streamed pull's: the prefill worker's sampled token


@dataclass(frozen=True)
class KVFailed:
    bus_id: str
    error: str


@dataclass(frozen=True)
class HoldBlock:
    hold_id: str
    reply: Future  # -> the block id, or BlockHoldRefused


@dataclass(frozen=True)
class ResetPrefixCache:
    # -> (the pool's cached blocks forgotten, the tiers'), or None: a block in use kept them all
    reply: Future
    external: bool = False  # the offload tiers' blocks too (vLLM's ``reset_external``)


@dataclass(frozen=True)
class LoadLora:
    name: str
    path: str
    reply: Future  # -> None, or ModelLoadError / ValueError: why not


@dataclass(frozen=True)
class UnloadLora:
    name: str
    reply: Future  # -> True: gone now, False: once its requests end; KeyError: unknown


Command = (
    AddRequest
    | Abort
    | Release
    | KVReady
    | KVFailed
    | HoldBlock
    | ResetPrefixCache
    | LoadLora
    | UnloadLora
)


class BlockHoldRefused(Exception):
    """``hold_block`` could not spare a block without taking it from a request."""


class EngineCommands:
    """The engine's face to every other thread (``LLMEngine`` derives from it): each method posts
    a command, and the thread that steps the engine applies them in order (``step()``) - the
    only thread that changes engine state, so none of this needs a lock."""

    def __init__(self) -> None:
        self._commands: deque[Command] = deque()  # a deque's append/popleft are atomic
        self._wakeup = threading.Event()  # the engine thread at rest sleeps on it

    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """ValueError if this engine's model cannot serve the request (the engine's own)."""
        raise NotImplementedError

    def lora_names(self) -> tuple[str, ...]:
        """The LoRA adapters this engine serves (``--lora-modules``), resident or not."""
        return ()

    def add_request(
        self,
        bus_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        output_token_ids: list[int] | tuple[int, ...] = (),
        remote_kv: bool = False,
        lora: str | None = None,
    ) -> None:
        """Queue a request (ValueError at once if this model cannot serve it), to continue after
        ``output_token_ids``; with ``remote_kv`` its prompt's KV is pulled into reserved blocks;
        ``lora``: the adapter it runs under (one of ``--lora-modules``)."""
        self.validate(prompt_token_ids, sampling)
        if lora is not None and lora not in self.lora_names():
            raise ValueError(f"no LoRA adapter {lora!r} on this worker")
        add = AddRequest(
            bus_id=bus_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            output_token_ids=tuple(output_token_ids),
            remote_kv=remote_kv,
            lora=lora,
        )
        self._post(add)

    def abort(self, bus_id: str, index: int | None = None) -> None:
        """Drop a request wherever it is, or only its choice ``index`` (sampling.n > 1); blocks
        return to the free list (after its pull, if KV is being pulled into them). Aborted
        choices produce no output. Unknown ids and choices are ignored."""
        self._post(Abort(bus_id, index))

    def release(self, bus_id: str) -> None:
        """Free a parked (prefill-only) sequence's blocks, or a block from ``hold_block``."""
        self._post(Release(bus_id))

    def kv_ready(self, bus_id: str, first_token: int | None = None) -> None:
        """The pull of a ``KVPull`` completed: the sequence runs (a streamed pull's token too)."""
        self._post(KVReady(bus_id, first_token))

    def kv_failed(self, bus_id: str, error: str) -> None:
        """The pull of a ``KVPull`` failed (or was not attempted): ``kv_failure_policy`` decides
        between computing the prompt here and finishing with an error output."""
        self._post(KVFailed(bus_id, error))

    def hold_block(self, hold_id: str) -> Future:
        """One free block under ``hold_id`` until ``release`` (the doctor's probes); refused
        (``BlockHoldRefused``) while requests wait or admission could not spare it."""
        reply: Future = Future()
        self._post(HoldBlock(hold_id, reply))
        return reply

    def reset_prefix_cache(self, external: bool = False) -> Future:
        """Forget the cached blocks of the pool (and the tiers'): a Future of how many each."""
        self._post(ResetPrefixCache(reply := Future(), external))
        return reply

    def load_lora(self, name: str, path: str) -> Future:
        """Serve adapter ``name`` from the PEFT directory ``path`` (checked on the engine's
        thread, which owns the slots): a Future of None, or of the reason it was refused."""
        self._post(LoadLora(name, path, reply := Future()))
        return reply

    def unload_lora(self, name: str) -> Future:
        """Stop serving adapter ``name``: a Future of True (gone) or False (deferred until the
        requests under it end); KeyError when it is not served."""
        self._post(UnloadLora(name, reply := Future()))
        return reply

    def _post(self, command: Command) -> None:
        self._commands.append(command)
        self._wakeup.set()

    def wake(self) -> None:
        """End a ``wait_for_work`` now (e.g. to stop the thread)."""
        self._wakeup.set()

    def wait_for_work(self, timeout: float) -> None:
        """Sleep until a command is posted (or ``timeout``): the engine thread at rest."""
        if not self._commands:
            self._wakeup.wait(timeout)
        self._wakeup.clear()
