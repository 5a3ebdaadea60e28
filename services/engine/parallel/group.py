"""Rank 0's side of a tensor-parallel worker: it starts ranks 1..N-1, joins them into one
torch.distributed group, sends each step's inputs, and notices when one dies.

Each rank gets a control connection (a local socket, shown a random key first) besides the
process group. Steps travel on it, not as a collective: a rank at rest blocks in a plain read
(no CPU, and no collective timeout however long the worker idles), and a rank 0 that dies
ends that read at once, so the other ranks exit with it. The process group carries only the
all-reduces inside a step: gloo on CPU, NCCL on CUDA (a GPU per rank).
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdserve.services.engine.model_config import ModelConfig
from pdserve.services.engine.outputs import StepInputs
from pdserve.services.engine.parallel.shard import Shard
from pdserve.services.engine.parallel.tier_mirror import TierOps
from pdserve.shared.config import EngineConfig

log = logging.getLogger(__name__)

START_SECONDS = 600.0  # ranks connecting and joining the group (they load afterwards)
COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # a collective waits at most for a rank's load
LOST_WAIT_SECONDS = 2.0  # a failed step waits this long for a dead rank's watcher


class RankFailed(RuntimeError):
    """A rank of this worker died or cannot be reached: the worker cannot step any more."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_cpus(cpus: list[int], size: int) -> list[list[int]] | None:
    """Contiguous CPU shares, one per rank, or None when there are fewer CPUs than ranks."""
    if len(cpus) < size:
        return None
    per, extra = divmod(len(cpus), size)
    shares, start = [], 0
    for r in range(size):
        end = start + per + (1 if r < extra else 0)
        shares.append(cpus[start:end])
        start = end
    return shares


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join_group(device: torch.device, rank: int, size: int, port: int) -> tuple[object, object]:
    """This worker's process group, and its store (rank 0 hosts it: keep it as long as the
    group). The group is its own, not torch.distributed's default one, so one process may hold
    several TP engines (tests, benchmarks)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=COLLECTIVE_TIMEOUT)
    if backend_for(device) == "nccl":
        group = dist.ProcessGroupNCCL(store, rank, size)
    else:
        group = dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT)
    return group, store


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: one GPU each from rank 0's, the CPU for all on CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


@dataclasses.dataclass
class RankSpec:
    """Everything a rank process needs to build its shard (sent as JSON on its command line)."""

    rank: int
    size: int
    control: tuple[str, int]
    key: str
    init_port: int
    config: dict
    model_dir: str
    device: str
    cpus: list[int] | None
    threads: int  # the rank's torch threads


class RankGroup:
    """Ranks 1..N-1 of this worker, as rank 0 sees them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.shard = Shard(rank=0, size=size)
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []  # steps, rank r at index r - 1
        self.kv_conns: list[Connection] = []  # the ranks' KV agents (kv_link.py)
        self.ready: list[dict] = []  # what each rank reported once built (index: rank - 1)
        self.failure: str | None = None
        self._closing = False
        self._listeners: list[Callable[[str], None]] = []
        self.store: object | None = None  # the process group's store, hosted here
        self._restore: tuple[set[int], int] | None = None  # rank 0's CPUs and threads before

    @classmethod
    def start(
        cls, config: EngineConfig, model_dir: Path, cfg: ModelConfig, device: torch.device
    ) -> RankGroup:
        """Start the other ranks, join the process group with them; they then load their shards
        while the caller loads rank 0's. The CPUs of this process are split between the ranks
        (unless ``--torch-threads`` fixes the threads)."""
        group = cls(config.tensor_parallel_size)
        group.shard.vocab_parallel = config.tp_lm_head == "vocab"
        shares = None
        if not config.torch_threads:
            shares = split_cpus(sorted(os.sched_getaffinity(0)), group.size)
        # fewer CPUs than ranks: they share them, a thread each (more would only preempt)
        threads = config.torch_threads or (len(shares[0]) if shares else 1)
        group._restore = (os.sched_getaffinity(0), torch.get_num_threads())
        if shares is not None:
            os.sched_setaffinity(0, shares[0])
        torch.set_num_threads(threads)
        server = socket.create_server(("127.0.0.1", 0))
        server.settimeout(1.0)
        key, init_port = secrets.token_hex(16), free_port()
        try:
            for rank in range(1, group.size):
                spec = RankSpec(
                    rank=rank,
                    size=group.size,
                    control=server.getsockname()[:2],
                    key=key,
                    init_port=init_port,
                    config=dataclasses.asdict(config),
                    model_dir=str(model_dir),
                    device=str(device),
                    cpus=shares[rank] if shares else None,
                    threads=len(shares[rank]) if shares else threads,
                )
                argv = [sys.executable, "-m", "pdserve.services.engine.rank_process"]
                group.procs.append(subprocess.Popen([*argv, json.dumps(dataclasses.asdict(spec))]))
            group._accept(server, key)
            for rank, proc in enumerate(group.procs, start=1):
                threading.Thread(target=group._watch, args=(rank, proc), daemon=True).start()
            group.shard.group, group.store = join_group(device, 0, group.size, init_port)
        except BaseException:
            group.close()
            raise
        finally:
            server.close()
        log.info(
            "tensor parallel: %d ranks (%s), pids %s",
            group.size,
            backend_for(device),
            [p.pid for p in group.procs],
        )
        return group

    def _accept(self, server: socket.socket, key: str) -> None:
        by_rank: dict[tuple[int, str], Connection] = {}
        deadline = time.monotonic() + START_SECONDS
        while len(by_rank) < 2 * (self.size - 1):
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None:
                    raise RankFailed(f"TP rank {rank} exited with code {proc.returncode} at start")
            if time.monotonic() > deadline:
                raise RankFailed(f"TP ranks did not connect within {START_SECONDS:.0f}s")
            try:
                sock, _ = server.accept()
            except TimeoutError:
                continue
            sock.settimeout(None)
            conn = Connection(sock.detach())
            hello = conn.recv()
            if not (isinstance(hello, tuple) and hmac.compare_digest(str(hello[0]), key)):
                conn.close()  # not one of ours
                continue
            by_rank[int(hello[1]), str(hello[2])] = conn
        self.conns = [by_rank[r, "step"] for r in range(1, self.size)]
        self.kv_conns = [by_rank[r, "kv"] for r in range(1, self.size)]

    def wait_ready(self) -> None:
        """Wait until every rank has built its shard; keep what each reported."""
        self.ready = [self._recv(rank, conn) for rank, conn in enumerate(self.conns, start=1)]

    def _recv(self, rank: int, conn: Connection) -> Any:
        try:
            kind, body = conn.recv()
        except (EOFError, OSError) as exc:
            raise RankFailed(self.failure or f"TP rank {rank} is gone ({exc!r})") from exc
        if kind == "error":
            raise RankFailed(f"TP rank {rank} failed: {body}")
        return body

    def on_failure(self, callback: Callable[[str], None]) -> None:
        self._listeners.append(callback)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self._closing:
            return
        self.failure = f"TP rank {rank} (pid {proc.pid}) exited with code {code}"
        log.error("%s: this worker cannot step any more", self.failure)
        for callback in self._listeners:
            callback(self.failure)

    def raise_if_lost(self, exc: BaseException, wait: float = LOST_WAIT_SECONDS) -> None:
        """A step failed on rank 0 (a collective's peer reset, say): if a rank died, raise
        RankFailed naming it. Its watcher may hear of the death a moment after the collective
        does, so wait that moment; otherwise return, and the caller re-raises ``exc``."""
        deadline = time.monotonic() + wait
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.failure is not None:
            raise RankFailed(self.failure) from exc

    def send_step(self, inputs: StepInputs) -> None:
        """The step's inputs to every other rank: once per step, before rank 0's own pass."""
        if self.failure is not None:
            raise RankFailed(self.failure)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send(("step", inputs))
            except OSError as exc:
                raise RankFailed(self.failure or f"TP rank {rank} is gone ({exc!r})") from exc

    def sync_tiers(self, ops: list[TierOps]) -> list[list[np.ndarray]]:
        """Each rank's tier work of this step (``tier_mirror.py``; rank 1's first), applied
        before this returns; each rank's shard of the gathered slots."""
        for rank, (conn, rank_ops) in enumerate(zip(self.conns, ops, strict=True), start=1):
            try:
                conn.send(("tier", rank_ops))
            except OSError as exc:
                raise RankFailed(self.failure or f"TP rank {rank} is gone ({exc!r})") from exc
        return [self._recv(rank, conn) for rank, conn in enumerate(self.conns, start=1)]

    def close(self, timeout: float = 5.0) -> None:
        self._closing = True
        for conn in self.conns:
            try:
                conn.send(("stop", None))
                conn.close()
            except OSError:
                pass
        for conn in self.kv_conns:
            try:
                conn.close()
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # a test or benchmark may go on in this process: give it its CPUs back
        if self._restore is not None:
            cpus, threads = self._restore
            self._restore = None
            os.sched_setaffinity(0, cpus)
            torch.set_num_threads(threads)
