"""Issue 28: a tensor-parallel rank that dies takes its worker down cleanly, and the worker's
streams migrate as for any dead worker: they finish on the other decode worker, identical to an
undisturbed run (float64, greedy). Real processes: NATS, a prefill worker, two decode workers
of TP 2 (rank processes over gloo), a gateway; kill -9 of a rank that is not rank 0."""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import pytest

from tests.integration.migration_stack import (
    GATEWAY_OPTIONS,
    WORKER_OPTIONS,
    DecodeSpy,
    Stream,
    stream,
    until,
    worker_blocks,
)
from tests.integration.stack import descendants, free_port, start_nats, start_service, stop_all

MODEL = "llama-mha-tied"  # the checkpoint directory's name; 4 KV heads split over 2 ranks


def body(i: int) -> dict:
    return {
        "model": MODEL,
        "prompt": f"Tensor parallel ranks share one step {i}",
        "max_tokens": 240,
        "temperature": 0,
        "ignore_eos": True,
    }


@pytest.fixture
def stack(tmp_path, checkpoints):
    nats = start_nats(tmp_path)
    model = str(checkpoints[MODEL])
    options = {**WORKER_OPTIONS, "model": model, "local_prefill_threshold": 0}
    port = free_port()
    children = {
        "p0": start_service("prefill", nats.url, tmp_path, options={**options, "worker_id": "p0"}),
        **{
            name: start_service(
                "decode",
                nats.url,
                tmp_path,
                options={**options, "worker_id": name, "tensor_parallel_size": 2},
            )
            for name in ("d0", "d1")
        },
        "gw": start_service(
            "gateway",
            nats.url,
            tmp_path,
            name="gw",
            options={**GATEWAY_OPTIONS, "model": model, "port": port},
        ),
    }
    try:
        yield children, nats.url, f"http://127.0.0.1:{port}"
    finally:
        stop_all(list(children.values()))
        nats.stop()


async def test_a_dead_rank_migrates_its_workers_streams(stack, tmp_path):
    children, nats_url, base = stack
    await until(lambda: set(worker_blocks(base)) == {"p0", "d0", "d1"}, "the stack", 180)
    spy = await DecodeSpy().start(nats_url)
    bodies = {f"tp-{i}": body(i) for i in range(4)}
    try:
        async with aiohttp.ClientSession() as session:
            reference = await asyncio.gather(
                *(stream(session, base, f"ref-{rid}", b) for rid, b in bodies.items())
            )
            seen = {rid: Stream() for rid in bodies}
            tasks = [
                asyncio.create_task(stream(session, base, rid, b, seen[rid]))
                for rid, b in bodies.items()
            ]
            await until(lambda: all(s.tokens_seen() >= 30 for s in seen.values()), "tokens", 60)
            where = {rid: spy.worker_of(rid) for rid in bodies}
            victim = max(set(where.values()), key=list(where.values()).count)
            ranks = list(descendants(children[victim].pid))
            assert len(ranks) == 1, ranks  # rank 1, started by the worker (rank 0)
            os.kill(ranks[0], signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    finally:
        await spy.close()
    for rid, got, want in zip(bodies, results, reference, strict=True):
        assert got.error is None and got.done, (rid, got.error)
        assert dict(got.texts) == dict(want.texts), rid
        assert got.finish == want.finish == {0: "length"}, rid
    moved = [rid for rid, w in where.items() if w == victim]
    assert moved
    for rid in moved:  # went on elsewhere, from the tokens it had
        assert spy.sent[rid][-1] != victim
    assert children[victim].wait(30) is not None  # the worker left, not hung
    assert "TP rank 1" in (tmp_path / f"{victim}.log").read_text()
