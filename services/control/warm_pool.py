"""The warm pool of ``pdserve up --autoscale --warm-prefill-workers N --warm-decode-workers M``.

Cold start is the slowest part of a scale-up (a model loads for seconds on a laptop, minutes on
a GPU host), so the autoscaler keeps N prefill and M decode workers loaded, connected and
registered on standby (services/standby.py: the gateway never routes to them, their event loops
sleep). A scale-up takes the oldest pooled worker of the role that has registered and promotes
it with SIGUSR1; it serves its next request with no load time. Then the pool is refilled by a
cold start in the background, where its load time costs nobody a request.

The pool is bookkeeping only (which worker ids are pooled, by role): the autoscaler starts,
signals and places the processes. Pooled workers count against the budget: the planner's limits
are computed for the budget minus the pool's cost, so serving workers plus a full pool never
exceed it, and a promotion followed by its refill keeps that true.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from pdserve.services.control.planner.inputs import ROLES
from pdserve.shared.config import UpConfig
from pdserve.shared.errors import StartupError


@dataclass
class WarmPool:
    wanted: dict[str, int]  # role -> how many standby workers to keep
    members: dict[str, str] = field(default_factory=dict)  # worker id -> role, oldest first

    @classmethod
    def from_flags(cls, up: UpConfig) -> WarmPool:
        wanted = {role: getattr(up, f"warm_{role}_workers") for role in ROLES}
        if any(n < 0 for n in wanted.values()):
            raise StartupError("--warm-prefill-workers and --warm-decode-workers must be >= 0")
        if any(wanted.values()) and not up.autoscale:
            raise StartupError("a warm pool is what --autoscale scales up from: add --autoscale")
        return cls(wanted)

    def size(self) -> int:
        return sum(self.wanted.values())

    def cost(self, costs: Mapping[str, float]) -> float:
        """What a full pool takes of the budget."""
        return sum(n * costs[role] for role, n in self.wanted.items())

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self.members

    def of(self, role: str) -> list[str]:
        return [w for w, r in self.members.items() if r == role]

    def add(self, worker_id: str, role: str) -> None:
        self.members[worker_id] = role

    def forget_gone(self, alive: Collection[str]) -> list[str]:
        """Drop members that are no longer running (crashed, or stopped); returns them."""
        gone = [w for w in self.members if w not in alive]
        for worker_id in gone:
            del self.members[worker_id]
        return gone

    def take(self, role: str, ready: Callable[[str], bool]) -> str | None:
        """The oldest pooled worker of ``role`` that is ready to serve (registered: promoting
        one still loading would gain little), out of the pool; None when there is none."""
        for worker_id in self.of(role):
            if ready(worker_id):
                del self.members[worker_id]
                return worker_id
        return None

    def missing(self) -> list[str]:
        """One role name per worker the pool lacks (prefill first)."""
        return [role for role in ROLES for _ in range(self.wanted[role] - len(self.of(role)))]
