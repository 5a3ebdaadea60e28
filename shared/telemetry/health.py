"""What a worker's ``/ready`` and ``/live`` answer (served beside ``/metrics``, metrics.py).

Orchestrators ask two different questions, and a worker answers them separately:

- ``/ready``: may traffic count on this worker? 200 only once its model is loaded, it is on the
  bus and has announced itself (its first heartbeat is out, so gateways can route to it), and
  it is not draining. 503 otherwise, with the phase and a reason in the JSON body, plus what it
  still has in flight (requests, KV leases) - what a drain waits for.
- ``/live``: is the process alive? 200 while it answers, also while loading a checkpoint and
  while draining. 503 only when its event loop has not turned for ``stall_seconds``: the HTTP
  server runs in its own thread, so "it answers" alone would not notice a wedged loop that no
  longer serves the bus.

The worker moves forward with ``enter`` (loading -> joining -> ready -> draining) and calls ``tick``
from its event loop; the HTTP thread only reads them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

LOADING, JOINING, READY, DRAINING = "loading", "joining", "ready", "draining"
WHY_NOT_READY = {
    LOADING: "loading the model",
    JOINING: "connecting to NATS and announcing itself",
    DRAINING: "draining: takes no new requests, finishing those in flight",
}
# Generous: a liveness failure restarts the process, and a loop stuck this long serves no one.
STALL_SECONDS = 30.0

Answer = tuple[int, dict]  # HTTP status, JSON body


@dataclass
class Health:
    """A worker's readiness and liveness, as the HTTP probes report them."""

    # Counts of work in flight (e.g. {"requests": 2, "leases": 5}); shown by /ready.
    work_counts: Callable[[], dict[str, int]] = dict
    # Whether the NATS connection is up right now: a worker cut off from the bus gets no work.
    connected: Callable[[], bool] = lambda: True
    stall_seconds: float = STALL_SECONDS
    phase: str = LOADING
    _tick: float = field(default_factory=time.monotonic)

    def tick(self) -> None:
        """The event loop turned (called from the worker's periodic housekeeping)."""
        self._tick = time.monotonic()

    def enter(self, phase: str) -> None:
        """Move to ``phase`` (from the event loop: it counts as a turn)."""
        self.tick()
        self.phase = phase

    def ready(self) -> Answer:
        phase = self.phase
        body: dict = {"status": phase}
        if phase in (READY, DRAINING):
            body.update(self.work_counts())
        if phase == READY and not self.connected():
            return 503, {**body, "reason": "not connected to NATS (reconnecting)"}
        if phase != READY:
            return 503, {**body, "reason": WHY_NOT_READY.get(phase, phase)}
        return 200, body

    def live(self) -> Answer:
        # Before the loop runs (loading a checkpoint can take minutes) there is nothing to stall.
        if self.phase in (READY, DRAINING):
            idle = time.monotonic() - self._tick
            if idle > self.stall_seconds:
                reason = f"the event loop has not turned for {idle:.0f} s"
                return 503, {"status": "stalled", "phase": self.phase, "reason": reason}
        return 200, {"status": "alive", "phase": self.phase}

    def probes(self) -> dict[str, Callable[[], Answer]]:
        """The HTTP paths this serves, for ``start_metrics_server(probes=...)``."""
        return {"/ready": self.ready, "/live": self.live}
