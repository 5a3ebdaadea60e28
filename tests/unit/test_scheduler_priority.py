"""``--scheduling-policy priority`` in the scheduler (``services/engine/wait_queue.py``): the
waiting queue admits by priority then arrival, aging bounds a low priority's wait, preemption
takes the worst-ranked sequence, and a decode worker reserves (so pulls) the KV of the
best-ranked first. No model: the fake runner of test_scheduler.py."""

from __future__ import annotations

import time

from pdserve.services.engine.sequence import Sequence, SequenceStatus
from pdserve.services.engine.wait_queue import WaitQueue
from pdserve.shared.sampling import SamplingParams
from tests.unit.test_scheduler import TOKEN, add, create_scheduler, fake_run, said, step


def prio(p: int, max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, priority=p)


def test_the_queue_admits_by_priority_then_arrival_and_fcfs_by_arrival_only():
    orders = {}
    for policy in ("fcfs", "priority"):
        # one sequence runs at a time: the admission order is the order of first tokens
        sch = create_scheduler(max_num_seqs=1, scheduling_policy=policy)
        for bus_id, p in (("low1", 5), ("low2", 5), ("high", -1), ("mid", 0)):
            add(sch, bus_id, [3, 4, 5], prio(p, max_tokens=1))
        firsts = []
        while sch.has_work():
            _, outs, _ = step(sch)
            firsts += [o.bus_id for o in outs]
        orders[policy] = firsts
    assert orders == {
        "fcfs": ["low1", "low2", "high", "mid"],
        "priority": ["high", "mid", "low1", "low2"],
    }


def seq_at(bus_id: str, p: int, arrival: float) -> Sequence:
    return Sequence(bus_id, [1, 2], prio(p), 0, arrival)


def test_aging_gives_a_waiting_request_one_level_per_aging_period():
    q = WaitQueue("priority", aging_s=10.0)
    now = time.monotonic()
    old_low = seq_at("old_low", 2, now - 25)  # waited 2.5 periods: effectively -0.5
    fresh_high = seq_at("fresh_high", 0, now)
    recent_low = seq_at("recent_low", 2, now - 15)  # 1.5 periods: effectively 0.5
    for s in (fresh_high, recent_low, old_low):
        q.append(s)
    assert [s.bus_id for s in q] == ["old_low", "fresh_high", "recent_low"]
    strict = WaitQueue("priority", aging_s=0.0)  # no aging: priority alone, then arrival
    for s in (fresh_high, recent_low, old_low):
        strict.append(s)
    assert [s.bus_id for s in strict] == ["fresh_high", "old_low", "recent_low"]
    assert strict.popleft() is fresh_high and len(strict) == 2
    strict.remove(recent_low)
    assert list(strict) == [old_low] and strict[0] is old_low


def test_sent_back_sequences_keep_their_rank_under_priority_and_go_first_under_fcfs():
    now = time.monotonic()
    high, low = seq_at("high", 0, now), seq_at("low", 9, now - 5)
    for policy, expected in (("fcfs", ["low", "high"]), ("priority", ["high", "low"])):
        q = WaitQueue(policy)
        q.append(high)
        q.appendleft(low)  # a preempted low-priority sequence
        assert [s.bus_id for s in q] == expected


def test_preemption_takes_the_lowest_priority_not_the_newest():
    victims = {}
    for policy in ("fcfs", "priority"):
        sch = create_scheduler(num_blocks=6, prefix_cache=False, scheduling_policy=policy)
        add(sch, "low", [3, 4, 5, 6], prio(9, max_tokens=10))
        step(sch)  # "low" runs before the others arrive: it is the oldest
        add(sch, "high", [8, 9, 10, 11], prio(0, max_tokens=10))
        add(sch, "mid", [12, 13, 14, 15], prio(4, max_tokens=10))
        while sch.num_preemptions == 0:  # each fills its second block, then needs a third
            step(sch)
        victims[policy] = [b for b, s in sch.seqs.items() if s.status is SequenceStatus.PREEMPTED]
    assert victims == {"fcfs": ["mid"], "priority": ["low"]}


def test_a_decode_worker_reserves_and_pulls_the_best_ranked_kv_first():
    sch = create_scheduler(max_num_seqs=2, scheduling_policy="priority")
    for bus_id, p in (("a", 3), ("b", 1), ("c", 2)):
        add(sch, bus_id, [3, 4, 5, 6, 7], prio(p), output=(TOKEN,), remote_kv=True)
    batch = sch.schedule()
    assert [s.bus_id for s in batch.pulls] == ["b", "c"]  # "a" waits for a slot
    fcfs = create_scheduler(max_num_seqs=2)
    for bus_id, p in (("a", 3), ("b", 1), ("c", 2)):
        add(fcfs, bus_id, [3, 4, 5, 6, 7], prio(p), output=(TOKEN,), remote_kv=True)
    assert [s.bus_id for s in fcfs.schedule().pulls] == ["a", "b"]


def test_an_aborted_waiting_request_leaves_the_priority_queue():
    sch = create_scheduler(max_num_seqs=1, scheduling_policy="priority")
    add(sch, "x", [3, 4], prio(1, max_tokens=1))
    add(sch, "y", [3, 4], prio(2, max_tokens=1))
    sch.abort("y")
    batch = sch.schedule()
    outs, _ = sch.update_from_output(batch, fake_run(batch, lambda s: [TOKEN]))
    assert said(outs) == [("x", [TOKEN], "length")] and not sch.has_work()


def test_a_high_priority_arrival_is_admitted_while_a_low_prompt_is_mid_prefill():
    sch = create_scheduler(num_blocks=32, max_num_batched_tokens=4, scheduling_policy="priority")
    add(sch, "low", list(range(10, 30)), prio(5, max_tokens=1))  # five chunks of 4
    step(sch)
    add(sch, "high", [3, 4, 5], prio(0, max_tokens=1))
    _, outs, _ = step(sch)  # the low prompt's chunk waits: the budget admits "high"
    assert said(outs) == [("high", [TOKEN], "length")]
    firsts = []
    while sch.has_work():
        _, outs, _ = step(sch)
        firsts += [o.bus_id for o in outs]
    assert firsts == ["low"]


def test_a_prompt_is_never_deferred_for_a_head_that_cannot_be_admitted():
    sch = create_scheduler(
        num_blocks=32, max_num_seqs=1, max_num_batched_tokens=4, scheduling_policy="priority"
    )
    add(sch, "low", list(range(10, 30)), prio(5, max_tokens=1))
    step(sch)
    add(sch, "high", [3, 4, 5], prio(0, max_tokens=1))  # no slot while "low" runs
    firsts = []
    for _ in range(10):
        _, outs, _ = step(sch)
        firsts += [o.bus_id for o in outs]
    assert firsts == ["low", "high"] and not sch.has_work()
