"""The engine's options for the order requests are served in: vLLM's ``--scheduling-policy``,
the aging that bounds a low priority's wait, and the deadline past which a prompt waits behind
the ones still on time (``services/engine/wait_queue.py``). A mixin of
``EngineConfig``, so that the gateway (which refuses a priority fcfs cannot honour) and every
worker read the same values."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.shared.errors import StartupError
from pdserve.shared.options import opt

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class SchedulingOptions:
    scheduling_policy: str = opt(
        "fcfs",
        "the order waiting requests are admitted in, on every worker: fcfs = arrival; priority "
        "= the request's priority (lower first), then arrival; under fcfs a request with a "
        "non-zero priority is refused (400), as vLLM does",
        choices=SCHEDULING_POLICIES,
    )
    priority_aging_s: float = opt(
        60.0,
        "under --scheduling-policy priority, a waiting request gains one priority level per this "
        "many seconds it has waited, so a low priority waits a bounded time behind a stream of "
        "higher ones; 0 = no aging (strict priority)",
    )
    # services/engine/wait_queue.py ("Late prompts"): under overload, first come first served
    # makes every queued request miss a TTFT target; this keeps as many on time as there is speed
    prompt_deadline_ms: float = opt(
        -1.0,
        "under --scheduling-policy fcfs, a prompt that has waited this long for its first token "
        "goes behind those that have not (they can still meet the TTFT target; it cannot); "
        "0 = off (strict arrival order); -1 = pdserve up --autoscale's --slo-ttft-ms, else off",
    )

    def check_scheduling(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:  # argparse skips env defaults
            raise StartupError(
                f"--scheduling-policy must be fcfs or priority, got {self.scheduling_policy!r}"
            )
        if self.prompt_deadline_ms < -1:
            raise StartupError(
                f"--prompt-deadline-ms must be >= 0, or -1 (auto), got {self.prompt_deadline_ms}"
            )
        if self.prompt_deadline_ms > 0 and self.scheduling_policy != "fcfs":
            raise StartupError("--prompt-deadline-ms orders an fcfs queue: not with priority")
        if self.priority_aging_s < 0:
            raise StartupError(
                f"--priority-aging-s must be >= 0 (0 = no aging), got {self.priority_aging_s}"
            )
