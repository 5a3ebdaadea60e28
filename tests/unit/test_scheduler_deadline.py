"""``--prompt-deadline-ms`` (``services/engine/wait_queue.py``, "Late prompts"): a prompt that
has waited past the deadline for its first token goes behind the prompts still on time, under
fcfs. No model: the fake runner of test_scheduler.py; arrivals are set back in time instead of
waiting for the clock."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pdserve.cli import make_parser
from pdserve.services.control.launcher import Launcher
from pdserve.services.control.planner.profile import Profile
from pdserve.services.engine.sequence import Sequence
from pdserve.services.engine.wait_queue import WaitQueue
from pdserve.shared.config import EngineConfig
from pdserve.shared.errors import StartupError
from pdserve.shared.sampling import SamplingParams
from tests.unit.test_scheduler import TOKEN, add, create_scheduler, step

ONE = SamplingParams(max_tokens=1, ignore_eos=True)


def seq_at(bus_id: str, arrival: float, output: tuple[int, ...] = ()) -> Sequence:
    seq = Sequence(bus_id, [1, 2], ONE, 0, arrival)
    seq.token_ids.extend(output)
    return seq


def test_late_prompts_go_behind_the_on_time_ones_in_the_order_they_fell_late():
    q = WaitQueue("fcfs", prompt_deadline_s=1.0)
    now = time.monotonic()
    old, older, fresh = seq_at("old", now - 2), seq_at("older", now - 3), seq_at("fresh", now)
    for seq in (older, old, fresh):
        q.append(seq)
    q.demote_late(now)
    assert [s.bus_id for s in q] == ["fresh", "older", "old"] and q.num_late == 2
    assert q[0] is fresh and q[1] is older and len(q) == 3
    assert q.popleft() is fresh
    q.remove(old)  # an abort while late
    assert list(q) == [older] and q.popleft() is older and not q


def test_a_sequence_with_a_token_is_never_late():
    q = WaitQueue("fcfs", prompt_deadline_s=1.0)
    now = time.monotonic()
    pulled = seq_at("pulled", now - 5, output=(TOKEN,))  # a decode worker's: its TTFT is past
    pulled.remote_kv = True
    preempted = seq_at("preempted", now - 5, output=(TOKEN, TOKEN))
    q.append(pulled)
    q.appendleft(preempted)
    q.demote_late(now)
    assert [s.bus_id for s in q] == ["preempted", "pulled"] and q.num_late == 0


def test_without_a_deadline_the_queue_keeps_arrival_order():
    q = WaitQueue("fcfs")
    now = time.monotonic()
    for seq in (seq_at("a", now - 100), seq_at("b", now)):
        q.append(seq)
    q.demote_late(now)
    assert [s.bus_id for s in q] == ["a", "b"] and q.num_late == 0


def first_tokens_in_order(deadline_s: float) -> list[str]:
    """Three prompts queued behind one that runs, one slot: the order of their first tokens
    when the two oldest waited 10 s and the newest just came."""
    sch = create_scheduler(max_num_seqs=1, prompt_deadline_s=deadline_s)
    for bus_id in ("old1", "old2", "new"):
        add(sch, bus_id, [3, 4, 5], ONE)
    for bus_id in ("old1", "old2"):
        sch.seqs[bus_id].arrival -= 10.0
    firsts = []
    while sch.has_work():
        _, outs, _ = step(sch)
        firsts += [o.bus_id for o in outs]
    return firsts


def test_the_scheduler_admits_an_on_time_prompt_before_late_ones_and_loses_none():
    assert first_tokens_in_order(0.0) == ["old1", "old2", "new"]
    assert first_tokens_in_order(1.0) == ["new", "old1", "old2"]


def test_the_deadline_is_refused_with_priority_or_below_minus_one():
    with pytest.raises(StartupError, match="fcfs"):
        EngineConfig(scheduling_policy="priority", prompt_deadline_ms=500.0)
    with pytest.raises(StartupError, match="-1"):
        EngineConfig(prompt_deadline_ms=-2.0)
    with pytest.raises(ValueError, match="fcfs"):
        WaitQueue("priority", prompt_deadline_s=0.5)
    EngineConfig(scheduling_policy="priority")  # the default (-1, auto) is off there


def test_pdserve_up_gives_autoscaled_workers_the_ttft_target_as_their_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PDSERVE_PROMPT_DEADLINE_MS", raising=False)
    profile = tmp_path / "profile.json"
    Profile.synthetic().save(profile)
    scaled = ["--autoscale", "--planner-profile", str(profile), "--slo-ttft-ms", "800"]

    def deadline(*flags: str) -> float:
        return Launcher(make_parser().parse_args(["up", *flags])).engine.prompt_deadline_ms

    assert deadline(*scaled) == 800.0
    assert deadline(*scaled, "--prompt-deadline-ms", "0") == 0.0  # off, as asked
    assert deadline("--prompt-deadline-ms", "300") == 300.0
    assert deadline() == 0.0  # no planner, no target: arrival order
