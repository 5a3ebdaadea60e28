"""The warm pool of ``pdserve up --autoscale --warm-prefill-workers N --warm-decode-workers M``.

Cold start is the slowest part of a scale-up (a model loads for seconds on a laptop, minutes on
a GPU host), so the autoscaler keeps N prefill and M decode workers loaded, connected and
registered on standby (services/standby.py: the gateway never routes to them, their event loops
sleep). A scale-up takes the oldest pooled worker of the role that has registered and promotes
it with SIGUSR1; it serves its next request with no load time. Then the pool is refilled by a
cold start in the background, where its load time costs nobody a request.

The planner sizes the pool (services/control/planner/decide.py, the ``pool`` rule): it holds
what the forecast says the load will need by the time a cold start could serve, beyond what
serves now, and at least ``--warm-*-workers`` (the floor) of capacity available at once. Pooled
workers cost budget like serving ones; serving comes first, so a pool at the edge of the budget
gives way to the workers the load needs.

The pool is bookkeeping only (which worker ids are pooled, by role, and how many are wanted):
the autoscaler starts, signals, places and stops the processes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from pdserve.services.control.planner.inputs import ROLES
from pdserve.shared.config import UpConfig
from pdserve.shared.errors import StartupError


@dataclass
class WarmPool:
    wanted: dict[str, int]  # role -> how many standby workers to keep (the planner's, or the floor)
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

    def resize(self, wanted: Mapping[str, int]) -> None:
        """The planner's new size per role."""
        self.wanted = {role: max(0, int(wanted[role])) for role in ROLES}

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self.members

    def of(self, role: str) -> list[str]:
        return [w for w, r in self.members.items() if r == role]

    def add(self, worker_id: str, role: str) -> None:
        self.members[worker_id] = role

    def remove(self, worker_id: str) -> None:
        self.members.pop(worker_id, None)

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

    def surplus(self, ready: Callable[[str], bool]) -> list[str]:
        """The pooled workers beyond the wanted size, newest first, among those ``ready`` (loaded
        and registered: one still loading is not stopped, as no worker is drained mid-load;
        it is stopped once it has loaded, if the pool is still too large then)."""
        out = []
        for role in ROLES:
            extra = len(self.of(role)) - self.wanted[role]
            out += [w for w in reversed(self.of(role)) if ready(w)][: max(0, extra)]
        return out
