"""The simulated workers: a prefill worker and a decode worker driven by a ``Profile``'s curves.

A **prefill worker** serves its queue first come, first served, a prompt in ``ISL /
throughput(ISL)`` seconds. With a prompt deadline (``--prompt-deadline-ms``, which ``pdserve up
--autoscale`` sets to the TTFT target) a prompt that has waited longer goes behind the ones that
have not, as the engine's wait queue orders them (services/engine/wait_queue.py). Where the
profile gives the engine's token budget per step (``prefill_batch_tokens``,
``--max-num-batched-tokens``), a step takes every waiting prompt that fits it, as the real
scheduler does: the step lasts as long as its prompts one after another and all of them get
their first token at its end. Three prompts that arrive together while a fourth
is in progress thus wait for each other: through ``pdserve up`` they took 2.08 s all three, where
one at a time would have averaged 1.4 s. With no budget (0) the worker takes one prompt a step.

A **decode worker** runs a continuous batch. Stepping it token by token would cost millions of
Python steps per simulated minute, so it advances in *segments*: between two events that change
its batch (a sequence joins or finishes, a prompt's last chunk is done) every step takes the same
time, ``ITL(batch, mean context)`` from the profile, so a whole segment is one computation. An
arrival in mid-segment settles the worker to the next step boundary and starts a new segment. The
mean context is kept as running sums, so a step's cost is O(1) whatever the batch.

As in the real engine, a sequence that arrives while a batch runs joins it two boundaries on: the
first admits it (its blocks allocated, its KV pull started), the pull lands during the next step,
and the boundary after that adds it to the batch. On an idle worker it joins at once. Through
``pdserve up`` (SmolLM2, 0.8 req/s) the gap to the second token was 2.7 steps; the simulator's
was 1.5 before it modelled the pull's step.

Admission reserves a sequence's whole KV (ISL + OSL tokens) and never preempts: a sequence waits
in the queue until its KV fits and the batch is below the profile's ``max_batch``. That is more
conservative than a paged engine (which allocates as tokens come and preempts), and it makes KV
capacity limit the batch, as it should.

An **aggregated** worker (``chunk_tokens`` > 0) is a decode worker that also prefills: each step
carries up to ``chunk_tokens`` of the oldest waiting prompt beside the decode batch, costing
``chunk / throughput(ISL)`` more, so every running sequence's ITL is inflated while a prompt is in
progress (chunked prefill, as vLLM and SGLang schedule it). One prompt per step; the prompt's
sequence joins the batch when its last chunk is done (that step is its first token).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.services.control.planner.profile import Profile

# a pooled worker loads as STARTING, then waits as POOLED (loaded, never routed to) until it is
# promoted to ACTIVE or stopped
STARTING, POOLED, ACTIVE, DRAINING, GONE = "starting", "pooled", "active", "draining", "gone"


@dataclass(slots=True)
class SimRequest:
    index: int
    arrival: float
    isl: int
    osl: int
    first_token: float = math.nan  # s; TTFT = first_token - arrival
    join: float = math.nan  # when it joined a decode batch
    done: float = math.nan

    @property
    def ttft_ms(self) -> float:
        return (self.first_token - self.arrival) * 1000.0

    @property
    def itl_ms(self) -> float:
        """Mean inter-token latency (TPOT): NaN while unfinished, 0 for a one-token answer."""
        if self.osl <= 1:
            return 0.0 if self.done == self.done else math.nan
        return (self.done - self.first_token) * 1000.0 / (self.osl - 1)


@dataclass
class Gaps:
    """Token gaps seen in the current window: (ms, how many tokens had that gap)."""

    samples: list[tuple[float, int]] = field(default_factory=list)

    def add(self, gap_ms: float, count: int) -> None:
        if count > 0:
            self.samples.append((gap_ms, count))

    def percentile(self, q: float) -> float | None:
        total = sum(n for _, n in self.samples)
        if total == 0:
            return None
        seen = 0
        for gap, n in sorted(self.samples):
            seen += n
            if seen >= q * total:
                return gap
        return self.samples[-1][0]


@dataclass
class Worker:
    worker_id: str
    role: str  # "prefill", "decode" or "aggregated"
    created: float  # started loading: costs from here
    ready_at: float
    state: str = STARTING
    retired: float = math.nan
    pooled: bool = False  # started for the warm pool, not promoted yet
    asked: float = 0.0  # when the planner asked for it (a start may wait for budget)
    promoted: float = math.nan  # when it left the pool to serve

    def age(self, now: float) -> float:
        return now - self.ready_at

    def idle(self) -> bool:
        """Nothing queued or in progress (each role says what that means)."""
        raise NotImplementedError

    def load(self) -> tuple[float, int, int]:
        """KV usage, queued, running."""
        raise NotImplementedError


class PrefillWorker(Worker):
    def __init__(
        self,
        worker_id: str,
        created: float,
        ready_at: float,
        profile: Profile,
        deadline_s: float = 0.0,
    ) -> None:
        super().__init__(worker_id, "prefill", created, ready_at)
        self.profile = profile
        self.deadline_s = deadline_s  # a prompt waiting longer is late (0: none ever is)
        self.queue: deque[SimRequest] = deque()  # waiting for the next step, on time
        self.late: deque[SimRequest] = deque()  # waited past the deadline: behind the queue
        self.batch: list[SimRequest] = []  # the step in progress: its prompts finish together
        self.backlog_tokens = 0  # queued + in progress: the router's cost

    def idle(self) -> bool:
        return not self.queue and not self.late and not self.batch

    def load(self) -> tuple[float, int, int]:  # kv usage, queued, running
        return 0.0, len(self.queue) + len(self.late), len(self.batch)

    def add(self, req: SimRequest, now: float) -> float | None:
        """Queue a prompt; returns when it finishes if the worker was idle (else None)."""
        self.queue.append(req)
        self.backlog_tokens += req.isl
        return None if self.batch else self._start(now)

    def finish(self, now: float) -> tuple[list[SimRequest], float | None]:
        """The step in progress is done at ``now``: its prompts, and the next step's end."""
        done, self.batch = self.batch, []
        for req in done:
            self.backlog_tokens -= req.isl
            req.first_token = now
        return done, self._start(now) if self.queue or self.late else None

    def _start(self, now: float) -> float:
        """The next step: the queue's head, and behind it, with a token budget
        (``Profile.prefill_batch_tokens``), the prompts that fit it beside the head. The late
        come after every on-time prompt, and admission stops at the first that does not fit,
        as the engine's does."""
        if self.deadline_s > 0:
            while self.queue and now - self.queue[0].arrival > self.deadline_s:
                self.late.append(self.queue.popleft())
        budget, tokens = self.profile.prefill_batch_tokens, 0
        while source := self.queue or self.late:
            if self.batch and tokens + source[0].isl > budget:
                break
            tokens += source[0].isl
            self.batch.append(source.popleft())
        return now + sum(self.profile.prefill_seconds(req.isl) for req in self.batch)


class DecodeWorker(Worker):
    def __init__(
        self,
        worker_id: str,
        created: float,
        ready_at: float,
        profile: Profile,
        gaps: Gaps,
        chunk_tokens: int = 0,
    ) -> None:
        super().__init__(worker_id, "aggregated" if chunk_tokens else "decode", created, ready_at)
        self.profile = profile
        self.gaps = gaps
        self.chunk = chunk_tokens
        # heap of (finish step, request index, join step, request)
        self.running: list[tuple[int, int, int, SimRequest]] = []
        self.waiting: deque[SimRequest] = deque()  # first token done, KV not yet admitted
        # admitted while a batch ran: (the step it joins at, request), its KV pulled meanwhile
        self.pulling: deque[tuple[int, SimRequest]] = deque()
        self.prompts: deque[SimRequest] = deque()  # aggregated: admitted, prefill in progress
        self.prompt_left = 0  # tokens of prompts[0] still to prefill
        self.step = 0  # steps done so far
        self.t_sync = 0.0  # when step `step` ended
        self.reserved = 0  # KV tokens reserved by running sequences and prompts
        self.sum_isl = 0  # over running sequences, for their mean context
        self.sum_join = 0  # join steps of running sequences
        self.seg_steps = 0  # the current segment: its length in steps, step time, chunk size
        self.seg_step_s = 0.0
        self.seg_chunk = 0
        self.version = 0  # bumps when a segment is replanned: older events are stale
        self.on_first_token: Callable[[SimRequest], None] = lambda req: None

    def idle(self) -> bool:
        return not (self.running or self.waiting or self.pulling or self.prompts)

    def load(self) -> tuple[float, int, int]:
        return (
            self.used_tokens() / self.profile.kv_capacity_tokens,
            len(self.waiting),
            len(self.running),
        )

    def used_tokens(self) -> int:
        b = len(self.running)
        return self.sum_isl + b * self.step - self.sum_join

    def load_tokens(self) -> int:
        """The router's cost: KV reserved plus what waits to be admitted."""
        return self.reserved + sum(r.isl + r.osl for r in self.waiting)

    def add(self, req: SimRequest, now: float) -> float | None:
        """A sequence arrives (its KV pulled; or, aggregated, its raw prompt). Returns when the
        worker's next event is due, or None when it is idle."""
        self.settle(now)
        self.waiting.append(req)
        return self.replan()

    def settle(self, now: float) -> None:
        """Run the current segment up to the first step boundary at or after ``now`` (never past
        the segment's end), then retire finished sequences and complete a finished prompt."""
        if self.seg_steps == 0:
            self.t_sync = max(self.t_sync, now)
            return
        k = max(0, math.ceil((now - self.t_sync) / self.seg_step_s - 1e-9))
        k = min(k, self.seg_steps)
        if k:
            self.gaps.add(self.seg_step_s * 1000.0, k * len(self.running))
            self.step += k
            self.t_sync += k * self.seg_step_s
            self.seg_steps -= k
            self.prompt_left -= k * self.seg_chunk
        while self.running and self.running[0][0] <= self.step:
            _, _, joined, req = heapq.heappop(self.running)
            req.done = self.t_sync
            self.reserved -= req.isl + req.osl
            self.sum_isl -= req.isl
            self.sum_join -= joined
        while self.pulling and (self.pulling[0][0] <= self.step or not self.running):
            self._join(self.pulling.popleft()[1])
        if self.prompts and self.prompt_left <= 0:
            req = self.prompts.popleft()
            req.first_token = self.t_sync
            self.on_first_token(req)
            self._join(req)
            self.prompt_left = self.prompts[0].isl if self.prompts else 0

    def _join(self, req: SimRequest) -> None:
        req.join = self.t_sync
        if req.osl <= 1:  # the first token was the whole answer
            req.done = self.t_sync
            self.reserved -= req.isl + req.osl
            return
        self.sum_isl += req.isl
        self.sum_join += self.step
        heapq.heappush(self.running, (self.step + req.osl - 1, req.index, self.step, req))
        # the wait between the first token and the first decode step is part of one token gap
        self.gaps.add((self.t_sync - req.first_token) * 1000.0, 1)

    def _admit(self) -> None:
        cap, limit = self.profile.kv_capacity_tokens, self.profile.max_batch
        while self.waiting:
            req = self.waiting[0]
            batch = len(self.running) + len(self.prompts)
            fits = batch < limit and self.reserved + req.isl + req.osl <= cap
            if not fits and batch:  # one larger than the whole pool still runs, alone
                return
            self.waiting.popleft()
            self.reserved += req.isl + req.osl
            if self.chunk:
                self.prompts.append(req)
                if len(self.prompts) == 1:
                    self.prompt_left = req.isl
            elif self.running:
                self.pulling.append((self.step + 1, req))
            else:
                self._join(req)

    def replan(self) -> float | None:
        """Admit what fits, then plan the next segment; returns when it ends (None: idle)."""
        self._admit()
        self.version += 1
        b = len(self.running)
        steps_to_finish = self.running[0][0] - self.step if b else math.inf
        if self.pulling:  # the segment ends where the pulled sequences join
            steps_to_finish = min(steps_to_finish, self.pulling[0][0] - self.step)
        step_s, chunk, steps = 0.0, 0, steps_to_finish
        if b:
            context = (self.sum_isl + b * self.step - self.sum_join) / b
            step_s = self.profile.decode_itl(b, context) / 1000.0
        if self.prompts:
            head = self.prompts[0]
            # full chunks first, the last (partial) chunk as a segment of its own
            full = (self.prompt_left - 1) // self.chunk
            chunk = self.chunk if full else self.prompt_left
            steps = min(steps, full or 1)
            step_s += chunk / self.profile.prefill_throughput(head.isl)
        if steps == math.inf:
            self.seg_steps = 0
            return None
        self.seg_steps, self.seg_step_s, self.seg_chunk = int(steps), step_s, chunk
        return self.t_sync + self.seg_steps * step_s
