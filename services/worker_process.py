"""Process-level helpers of a worker: its default id, torch's thread pool, a fast exit."""

from __future__ import annotations

import logging
import os
import re
import socket
import sys


def default_worker_id(role: str) -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40]
    return f"{role}-{host}-{os.getpid()}"


def set_torch_threads(requested: int) -> int:
    """Size torch's CPU thread pool: ``requested``, else ``OMP_NUM_THREADS`` if set, else one
    thread per CPU this process may run on. Its affinity, not the machine's CPU count: ``pdserve
    up`` gives each worker its own CPUs, and two workers each running a thread per machine CPU
    on the same cores only preempt each other mid-GEMM."""
    import torch

    if requested > 0:
        torch.set_num_threads(requested)
    elif not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    return torch.get_num_threads()


def exit_now(rc: int) -> None:
    """Leave without interpreter teardown.

    Everything that matters is already flushed (bus, spans, logs); tearing down torch's and
    UCX's native state takes seconds, which every drain, ``pdserve up`` shutdown and test
    would otherwise wait for.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
