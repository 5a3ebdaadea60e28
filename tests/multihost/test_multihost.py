"""pdserve over three "hosts" (network namespaces on one bridge in a namespace of its own, on
198.18.S.0/24, the driver reaching them over link-local addresses only), a 3-node NATS cluster,
KV over UCX TCP between namespaces (see ``netns.py`` and ``hosts.py`` for the layout).

HF transformers (float64) on the same tiny checkpoint is the oracle of every greedy token; the
faults - a NATS node killed under running streams, host B's cable pulled - are judged against
it too, and against the clock: nothing may hang.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from transformers import PreTrainedTokenizerFast

from tests.integration.migration_stack import worker_blocks
from tests.integration.stack import QUIET_ENV
from tests.multihost import netns
from tests.multihost.hosts import NATS_PORT, ROUTE_PORT
from tests.multihost.netns import Host
from tests.oracle import hf_greedy

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "def add(a, b):\n    return a + b\n",
]
SHORT = 8
LONG = 160  # long enough to be mid-stream when a NATS node dies


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return PreTrainedTokenizerFast.from_pretrained(str(llama_dir))


@pytest.fixture(scope="module")
def expected_short(llama_dir, tokenizer) -> list[str]:
    ids = [tokenizer.encode(p) for p in PROMPTS]
    return [tokenizer.decode(o, skip_special_tokens=True) for o in hf_greedy(llama_dir, ids, SHORT)]


async def complete(base: str, prompt: str, max_tokens: int, on_text=None) -> tuple[str, str]:
    """Stream one greedy completion; (text, finish_reason)."""
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    try:
        model = (await client.models.list()).data[0].id
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
                if on_text is not None:
                    on_text(text)
        return text, finish
    finally:
        await client.close()


def established(host: Host) -> set[tuple[str, int, str, int]]:
    """(local address, port, remote address, port) of the established TCP connections of a
    namespace, read from its /proc/net/tcp."""
    text = subprocess.run(
        host.argv("cat", "/proc/net/tcp"), capture_output=True, text=True, check=True
    ).stdout
    out = set()
    for line in text.splitlines()[1:]:
        cols = line.split()
        if cols[3] != "01":  # ESTABLISHED
            continue
        ends = []
        for col in cols[1:3]:
            addr, port = col.split(":")
            ends += [socket.inet_ntoa(bytes.fromhex(addr)[::-1]), int(port, 16)]
        out.add(tuple(ends))
    return out


def test_hosts_talk_on_198_18_and_the_driver_only_on_link_local(topology) -> None:
    """The root namespace (this test process) has no route and no address in the hosts'
    198.18.S.0/24: only the hosts are on that network; it reaches them over their link-local
    addresses. (Another 198.18 network of this machine, a container runtime's, is not ours.)"""
    assert topology.network.subnet_of(netns.BENCHMARK_RANGE)
    assert netns.root_routes_into(topology.network) == []
    for host in topology.hosts.values():
        assert ipaddress.ip_address(host.address) in topology.network
        assert ipaddress.ip_address(host.mgmt).is_link_local
        # the 198.18 address is eth0's primary one, the one --ucx-host checks against
        shown = subprocess.run(
            host.argv("ip", "-4", "-o", "addr", "show", "dev", "eth0"),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert re.findall(r"inet (\S+)/", shown) == [host.address, host.mgmt], shown
    # host B reaches host C's network address through the bridge's namespace
    c = topology.hosts["c"]
    probe = "import socket, sys; socket.create_connection((sys.argv[1], 9), timeout=3)"
    reply = subprocess.run(
        topology.hosts["b"].argv(sys.executable, "-c", probe, c.address),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "ConnectionRefusedError" in reply.stderr, reply.stderr  # C answered: port 9 is shut


def test_nats_nodes_hand_out_and_route_over_198_18_only(stack) -> None:
    """The nodes listen on every address of their host (the driver checks on them over the
    link-local one), yet clients are told only the hosts' 198.18 addresses to fail over to,
    and the routes between nodes run over those addresses."""
    network = stack.topo.network
    a = stack.topo.hosts["a"]
    read_info = (
        "import socket, sys; s = socket.create_connection((sys.argv[1], int(sys.argv[2])), 5);"
        "print(s.recv(65536).decode())"
    )
    info = subprocess.run(
        a.argv(sys.executable, "-c", read_info, a.address, str(NATS_PORT)),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    urls = json.loads(info.removeprefix("INFO "))["connect_urls"]
    expected = {f"{h.address}:{NATS_PORT}" for h in stack.topo.hosts.values()}
    assert set(urls) == expected, urls
    for node in stack.cluster.nodes:
        url = f"http://{node.reach}:{node.monitor_port}/routez"
        with urllib.request.urlopen(url, timeout=5) as resp:
            routes = json.load(resp)["routes"]
        assert routes and all(ipaddress.ip_address(r["ip"]) in network for r in routes), routes


async def test_greedy_output_matches_hf_across_hosts(stack, expected_short) -> None:
    """Prefill on host B, decode on host C, the gateway on host A, every message through the
    NATS cluster's routes: the text is HF's."""
    results = await asyncio.gather(*(complete(stack.base_url, p, SHORT) for p in PROMPTS))
    assert [t for t, _ in results] == expected_short
    assert all(f == "length" for _, f in results)
    await blocks_free(stack.base_url)


async def blocks_free(base: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        loads = worker_blocks(base)
        if set(loads) == {"p0", "d0"} and not any(loads.values()):
            return
        assert time.monotonic() < deadline, f"KV blocks still in use: {loads}"
        await asyncio.sleep(0.2)


async def test_kv_pull_crosses_hosts_over_ucx_tcp(stack, expected_short) -> None:
    """Prompts prefilled on host B are decoded on host C from KV pulled over UCX TCP across the
    bridge (a failed pull fails its request: kv_failure_policy "fail"), and the text is HF's."""
    results = await asyncio.gather(*(complete(stack.base_url, p, SHORT) for p in PROMPTS))
    assert [t for t, _ in results] == expected_short
    assert not re.search(r"KV pull for \S+ from \S+ failed", stack.log("c", 200000))
    # The KV came from host B to host C over UCX TCP: a connection between their addresses
    # that is neither NATS (client port) nor a cluster route.
    b, c = stack.topo.hosts["b"], stack.topo.hosts["c"]
    kv = {
        conn
        for conn in established(c)
        if {conn[0], conn[2]} == {b.address, c.address}
        and not {conn[1], conn[3]} & {NATS_PORT, ROUTE_PORT}
    }
    assert kv, f"no UCX TCP connection between {c.address} and {b.address}"


def doctor_on(stack, host_name: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict]:
    host = stack.topo.hosts[host_name]
    report = tmp_path / "doctor.json"
    argv = host.argv(
        sys.executable,
        "-m",
        "pdserve.cli",
        "doctor",
        "--nats-url",
        stack.nats_url_of(host_name),
        "--ucx-host",
        host.address,
        *("--sizes-mib", "1", "--reps", "2", "--min-ratio", "0", "--discover-seconds", "1"),
        *("--timeout", "5", "--json", str(report)),
    )
    base = netns.inherited_env()
    proc = subprocess.run(
        argv, cwd=ROOT, env={**base, **QUIET_ENV}, capture_output=True, text=True, timeout=180
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    found = json.loads(report.read_text()) if report.exists() else {}
    return proc, {c["name"]: c for c in found.get("checks", [])}


def test_doctor_between_hosts_b_and_c(stack, tmp_path) -> None:
    """The doctor, run where the decode worker runs: its peer test moves KV over host C's
    eth0, and its probe of the real pair (d0 <- p0) pulls across the bridge, bytes verified."""
    proc, checks = doctor_on(stack, "c", tmp_path)
    text = proc.stdout
    assert proc.returncode == 0, text
    pull = next(line for line in text.splitlines() if "d0 <- p0" in line)
    assert pull.startswith("[ OK ] KV pull") and "bytes verified" in pull, text
    lanes = " ".join(checks["selected"]["details"])
    assert "tcp/eth0" in lanes and "/lo" not in lanes, lanes


async def test_nats_node_of_the_decode_worker_dies_under_streams(stack) -> None:
    base = stack.base_url
    undisturbed = await asyncio.gather(*(complete(base, p, LONG) for p in PROMPTS))
    progress = [""] * len(PROMPTS)

    def tracker(i):
        def on_text(text: str) -> None:
            progress[i] = text

        return on_text

    tasks = [
        asyncio.create_task(complete(base, p, LONG, tracker(i))) for i, p in enumerate(PROMPTS)
    ]
    deadline = time.monotonic() + 60
    while not all(progress):  # every stream is running
        assert time.monotonic() < deadline, "streams did not start"
        assert not any(t.done() for t in tasks), "a stream ended before the fault"
        await asyncio.sleep(0.01)
    node3 = stack.node_of("c")
    killed_at = time.monotonic()
    node3.child.signal(signal.SIGKILL)
    node3.child.wait(5)
    done, pending = await asyncio.wait(tasks, timeout=60)
    assert not pending, f"streams hung after NATS node-3 died: {progress}"
    results = [t.result() for t in tasks]
    assert results == undisturbed
    # the decode worker left its dead node for another one, and says so in its log
    assert "reconnected to NATS" in stack.log("c", 20000), stack.log("c")
    # new requests are served within a few seconds of the loss
    text, finish = await complete(base, PROMPTS[0], SHORT)
    served_after = time.monotonic() - killed_at
    assert finish == "length" and text == undisturbed[0][0][: len(text)]
    assert served_after < 15, served_after
    # node-3 comes back and the cluster meshes again (its routes are re-dialled)
    node3.start()
    deadline = time.monotonic() + 20
    while not stack.cluster.meshed():
        assert time.monotonic() < deadline, "node-3 did not rejoin the cluster"
        await asyncio.sleep(0.2)


async def test_host_b_unplugged_prefill_moves_and_nothing_hangs(stack, expected_short) -> None:
    base = stack.base_url
    stack.topo.link("b", up=False)
    try:
        # At once: the gateway may still send this prefill to p0 - its deadline bounds it, and
        # the request is served another way or fails, never hangs.
        started = time.monotonic()
        try:
            text, finish = await asyncio.wait_for(complete(base, PROMPTS[1], SHORT), 30)
            assert text == expected_short[1], text
        except openai.APIError:
            pass
        assert time.monotonic() - started < 30
        # Once p0 has left the registry, prompts are prefilled by the decode worker itself.
        deadline = time.monotonic() + 20
        while "p0" in worker_blocks(base):
            assert time.monotonic() < deadline, "p0 is still in the gateway's registry"
            await asyncio.sleep(0.2)
        served = time.monotonic()
        results = await asyncio.gather(*(complete(base, p, SHORT) for p in PROMPTS))
        assert [t for t, _ in results] == expected_short
        assert time.monotonic() - served < 15
    finally:
        stack.topo.link("b", up=True)
    # plugged back in, p0 rejoins (its node re-routes to the cluster)
    deadline = time.monotonic() + 30
    while "p0" not in worker_blocks(base):
        assert time.monotonic() < deadline, "p0 did not come back after the link came up"
        await asyncio.sleep(0.2)
