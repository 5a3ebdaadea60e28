"""A worker on standby: loaded, connected and announced, but never routed to.

Two users: the warm pool of ``pdserve up --warm-*-workers`` (the autoscaler promotes a pooled
worker instead of cold-starting one) and ``pdserve rollout`` (a new version's workers wait,
unrouted, until their probe passed). ``--standby`` starts a worker that way; its heartbeats say
``standby=True`` and the gateway's registry leaves it out of routing, exactly as it leaves out
a draining worker.

Promotion is SIGUSR1, the way the drain is SIGTERM: the launcher owns its workers' processes
(and Kubernetes can ``kill -USR1`` too), so no control subject has to be secured. The worker
then announces itself as serving at once (an immediate heartbeat), not at its next beat.

At rest a standby worker does what an idle serving worker does: its event loop waits on its
sockets, a heartbeat every ``--heartbeat-seconds``; nothing polls for the promotion.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
import signal
import threading
from typing import Any

from pdserve.shared.config import EngineConfig

log = logging.getLogger(__name__)

PROMOTE_SIGNAL = signal.SIGUSR1


@functools.cache
def derive_version(model: str | None) -> str:
    """A version name from ``--model``: the checkpoint's name and a short hash of its absolute
    path, so two copies of one model in two directories are two versions."""
    name = os.path.basename(os.path.normpath(model or "")) or "model"
    if not model or not os.path.exists(model):
        return name  # a built-in name (demo, smollm2-135m-instruct): the name is the version
    path = os.path.abspath(model).encode()
    return f"{name}@{hashlib.blake2b(path, digest_size=4).hexdigest()}"


def model_version(engine: EngineConfig) -> str:
    return (engine.model_version or derive_version(engine.model))[:128]


def load_fields(worker: Any) -> dict[str, Any]:
    """What a heartbeat (``WorkerLoad``) says of standby and version."""
    return {
        "standby": worker.standby,
        "model_version": model_version(worker.engine_config),
    }


def arm(worker: Any) -> bool:
    """Before the model loads: a promotion that comes early is remembered, not fatal (SIGUSR1's
    default action ends the process). Returns whether the worker starts on standby."""

    def early(signum: int, frame: object) -> None:
        worker.standby = False

    if threading.current_thread() is threading.main_thread():  # tests build workers in threads
        signal.signal(PROMOTE_SIGNAL, early)
    return bool(worker.config.standby)


def install(worker: Any, loop: asyncio.AbstractEventLoop) -> None:
    """On the worker's event loop: SIGUSR1 promotes it."""
    loop.add_signal_handler(PROMOTE_SIGNAL, promote, worker)


def promote(worker: Any) -> None:
    if not worker.standby:
        return
    worker.standby = False
    log.info("promoted from standby: serving")
    worker.tasks.spawn(worker.presence.publish_load())  # into the gateways' routing tables now
