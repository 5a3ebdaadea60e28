"""A stack for fault tests and ``perf/chaos_bench.py``: real NATS, prefill and decode workers that
run as ``staged_worker.py`` (stages slowed on demand through gate files), one gateway; killing,
pausing and restarting workers; what every worker holds, as the gateway's /metrics says.

    stack = ChaosStack(logs, model_dir, prefill=("p0", "p1"), decode=("d0", "d1"))
    stack.start(); stack.wait_ready()
    stack.gate("prefill.step", 0.3)      # every prefill forward pass now takes 0.3 s longer
    held = stack.held()                  # worker -> Held(blocks, running, waiting)
    seconds = stack.wait_idle(30)        # until no worker holds a block or a sequence
    stack.stop()
"""

from __future__ import annotations

import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.integration.stack import (
    Child,
    NatsServer,
    free_port,
    log_text,
    start_nats,
    start_service,
    stop_all,
)

WORKER_OPTIONS: dict[str, object] = {
    "dtype": "float32",
    "block_size": 16,
    "num_kv_blocks": 128,
    "max_num_batched_tokens": 64,  # long prompts prefill in several chunks: a stage to catch
    "heartbeat_seconds": 0.1,
    "local_prefill_threshold": 6,
    "kv_failure_policy": "recompute",
}
GATEWAY_OPTIONS: dict[str, object] = {"worker_timeout": 2.0, "request_timeout": 120.0}


@dataclass(frozen=True)
class Held:
    blocks: float
    running: float
    waiting: float

    def idle(self) -> bool:
        return not (self.blocks or self.running or self.waiting)


class ChaosStack:
    def __init__(
        self,
        logs: Path,
        model_dir: Path | str,
        prefill: tuple[str, ...] = ("p0",),
        decode: tuple[str, ...] = ("d0",),
        worker_options: dict[str, object] | None = None,
        gateway_options: dict[str, object] | None = None,
    ) -> None:
        self.logs = Path(logs)
        self.model = str(model_dir)
        self.roles = {**{w: "prefill" for w in prefill}, **{w: "decode" for w in decode}}
        self.worker_options = {**WORKER_OPTIONS, **(worker_options or {})}
        self.gateway_options = {**GATEWAY_OPTIONS, **(gateway_options or {})}
        self.gates = self.logs / "gates"
        self.gates.mkdir(parents=True, exist_ok=True)
        self.nats: NatsServer | None = None
        self.children: dict[str, Child] = {}
        self.base = ""

    # -- processes ---------------------------------------------------------------------------

    def start(self) -> None:
        self.nats = start_nats(self.logs)
        for name in self.roles:
            self.start_worker(name)
        port = free_port()
        options = {**self.gateway_options, "model": self.model, "port": port}
        self.children["gw"] = start_service("gateway", self.nats.url, self.logs, options=options)
        self.base = f"http://127.0.0.1:{port}"

    def start_worker(self, name: str, options: dict[str, object] | None = None) -> None:
        """Start ``name`` (again: a new incarnation under the same id), as a supervisor would;
        ``options`` override the stack's worker options for it."""
        assert self.nats is not None
        role = self.roles[name]
        options = {**self.worker_options, **(options or {}), "model": self.model, "worker_id": name}
        argv = [sys.executable, "-m", "tests.integration.staged_worker", role]
        env = {"STAGE_GATES": str(self.gates)}
        self.children[name] = start_service(
            role, self.nats.url, self.logs, env=env, options=options, name=name, argv=argv
        )

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Every live worker is registered with the gateway."""
        deadline = time.monotonic() + timeout
        while set(self.held()) != self.live_workers():
            for child in self.children.values():
                assert child.alive() or child.name in self.roles, f"{child.name} died"
            assert time.monotonic() < deadline, f"the stack did not come up:\n{self.tail()}"
            time.sleep(0.2)

    def live_workers(self) -> set[str]:
        return {n for n in self.roles if n in self.children and self.children[n].alive()}

    def stop(self) -> None:
        stop_all(list(self.children.values()))
        if self.nats is not None:
            self.nats.stop()

    def tail(self, chars: int = 1500) -> str:
        return "\n".join(f"--- {c.name}\n{log_text(c, chars)}" for c in self.children.values())

    # -- stages ------------------------------------------------------------------------------

    def gate(self, stage: str, seconds: float) -> None:
        """Slow ``stage`` (see staged_worker.py) by ``seconds`` on every worker; 0 lifts it."""
        path = self.gates / stage
        if seconds:
            path.write_text(str(seconds))
        else:
            path.unlink(missing_ok=True)

    def ungate_all(self) -> None:
        for path in self.gates.iterdir():
            path.unlink()

    # -- what the workers hold ---------------------------------------------------------------

    def held(self) -> dict[str, Held]:
        """Worker -> what it holds, from the gateway's /metrics (empty while it is down)."""
        try:
            with urllib.request.urlopen(self.base + "/metrics", timeout=2) as r:
                text = r.read().decode()
        except OSError:
            return {}
        series: dict[str, dict[str, float]] = {}
        names = {
            "pdserve_kv_cache_used_blocks": "blocks",
            "pdserve_running_requests": "running",
            "pdserve_waiting_requests": "waiting",
        }
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in names:
                    series.setdefault(sample.labels["worker"], {})[names[sample.name]] = (
                        sample.value
                    )
        return {w: Held(**values) for w, values in series.items() if len(values) == 3}

    def wait_idle(self, timeout: float, since: float | None = None) -> float:
        """Seconds from ``since`` (monotonic; default now) until every live worker is
        registered and holds nothing; AssertionError with what is held after ``timeout``."""
        since = time.monotonic() if since is None else since
        deadline = since + timeout
        while True:
            held = self.held()
            if set(held) >= self.live_workers() and all(h.idle() for h in held.values()):
                return time.monotonic() - since
            assert time.monotonic() < deadline, f"still held after {timeout:.0f}s: {held}"
            time.sleep(0.05)
