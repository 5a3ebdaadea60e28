"""``pdserve rollout`` against a real ``pdserve up`` (nats-server, workers, gateway, HTTP) under a
steady stream of requests, with two tiny checkpoints (one config, two seeds: two versions whose
greedy answers differ):

1. a version whose workers cannot load (a path with no checkpoint) is rolled back: exit 1 with
   the reason, the old version still serves;
2. v2 rolls out: exit 0, /v1/models switches from v1 to v2, a greedy answer changes to v2's,
   the old workers drain and exit 0, and pdserve up does not report them as crashes;
3. a version whose probe answer is wrong (``--expect-tokens`` it does not produce) is rolled
   back, v2 still serves.

Throughout, every request of the load completes with 200 and all its tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import aiohttp

from tests.checkpoints import build_checkpoint
from tests.integration.stack import free_port, pdserve_up

MAX_TOKENS = 12
SERVED = "tiny"


def card(gateway: str) -> dict:
    with urllib.request.urlopen(gateway + "/v1/models", timeout=5) as resp:
        return json.loads(resp.read())["data"][0]


async def answer(session: aiohttp.ClientSession, gateway: str) -> list[int]:
    body = {
        "model": SERVED,
        "prompt": [5, 6, 7, 8, 9],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    async with session.post(gateway + "/v1/completions", json=body) as resp:
        data = await resp.json()
        assert resp.status == 200, data
        return data["choices"][0].get("token_ids") or data["choices"][0]["text"]


async def steady(
    gateway: str, until: asyncio.Event, errors: list[dict], clients: int = 2
) -> list[tuple[int, int]]:
    """(status, completion tokens) of each request until ``until``; ``errors`` gets the
    bodies of the ones that failed."""
    results: list[tuple[int, int]] = []
    body = {
        "model": SERVED,
        "prompt": "roll me out " * 4,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
    }

    async def client(session: aiohttp.ClientSession) -> None:
        while not until.is_set():
            async with session.post(gateway + "/v1/completions", json=body) as resp:
                data = await resp.json(content_type=None)
                results.append((resp.status, (data.get("usage") or {}).get("completion_tokens")))
                if resp.status != 200:
                    errors.append(data)
            await asyncio.sleep(0.05)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return results


async def rollout(control: Path, *args: str) -> tuple[int, str, str]:
    """``pdserve rollout ARGS`` logged in as the stack's control role (its ``control.env``)."""
    login = dict(line.split("=", 1) for line in control.read_text().splitlines() if "=" in line)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pdserve.cli",
        "rollout",
        *args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**env, **login},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 300)
    return proc.returncode, out.decode(), err.decode()


async def test_rollout_under_load_switches_versions_and_rolls_back_bad_ones(
    tmp_path: Path,
) -> None:
    v1 = build_checkpoint("llama-gqa", tmp_path / "v1" / "tiny", seed=0)
    v2 = build_checkpoint("llama-gqa", tmp_path / "v2" / "tiny", seed=1)
    port = free_port()
    gateway = f"http://127.0.0.1:{port}"
    args = [
        "--model",
        str(v1),
        "--served-model-name",
        SERVED,
        "--port",
        str(port),
        "--model-version",
        "v1",
    ]
    env = {"PDSERVE_HEARTBEAT_SECONDS": "0.2", "PDSERVE_DRAIN_SECONDS": "20"}
    log = tmp_path / "up.log"
    with pdserve_up(args, log, env):
        control = Path(re.search(r"control's in (\S+?)\)", log.read_text()).group(1))
        assert card(gateway)["model_versions"] == ["v1"]
        async with aiohttp.ClientSession() as session:
            before = await answer(session, gateway)
        stop = asyncio.Event()
        errors: list[dict] = []
        load = asyncio.create_task(steady(gateway, stop, errors))
        await asyncio.sleep(1.0)

        # 1. the new workers cannot load: rolled back, v1 serves on
        rc, out, err = await rollout(
            control, "--model", str(tmp_path / "missing"), "--model-version", "broken"
        )
        assert rc == 1 and "exited with" in err and "while loading" in err, (out, err)
        assert json.loads(out)["rolled_back"] is True
        assert card(gateway)["model_versions"] == ["v1"]

        # 2. v2 under load: switch, old drained
        rc, out, err = await rollout(control, "--model", str(v2), "--model-version", "v2")
        assert rc == 0, (out, err)
        done = json.loads(out)
        assert done["version"] == "v2" and done["old_versions"] == ["v1"]
        assert set(done["exited"].values()) == {0}, done  # drained and exited on their own
        assert card(gateway)["model_versions"] == ["v2"]
        assert not load.done()
        async with aiohttp.ClientSession() as session:
            after = await answer(session, gateway)
        assert after != before  # other weights answer: v2 serves

        # 3. the probe's answer is wrong: rolled back, v2 serves on
        rc, out, err = await rollout(
            control, "--model", str(v1), "--model-version", "v1-again", "--expect-tokens", "0,0,0,0"
        )
        assert rc == 1 and "verification failed" in err, (out, err)
        assert card(gateway)["model_versions"] == ["v2"]
        await asyncio.sleep(1.0)
        stop.set()
        results = await load
        text = log.read_text(errors="replace")

    assert len(results) >= 10 and set(results) == {(200, MAX_TOKENS)}, (errors, results)
    assert not re.search(r"pdserve: (prefill|decode)-\d+ exited with", text), text[-4000:]
    print(f"rollout: {done['seconds']} ({len(results)} requests, all 200)")
