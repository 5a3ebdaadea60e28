"""``pdserve up --nats-cluster 3``: three routed NATS nodes on loopback, the workers spread over
them. Killing the decode worker's node must not stop the service, nor lose a stored response
(the gateway's JetStream bucket is kept on all three nodes). Needs no namespaces."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.integration.stack import descendants, free_port, pdserve_up, wait_until


def chat(base: str, timeout: float = 30.0) -> dict:
    body = {
        "model": served_model(base, timeout),
        "max_tokens": 6,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Hello there, cluster."}],
    }
    return post(base + "/v1/chat/completions", body, timeout)


def served_model(base: str, timeout: float) -> str:
    with urllib.request.urlopen(base + "/v1/models", timeout=timeout) as resp:
        return json.load(resp)["data"][0]["id"]


def post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.load(resp)


def stored_response(base: str, timeout: float = 30.0) -> dict | None:
    """A response stored on request (``store: true`` is refused, not skipped, while the
    gateway's bucket is not open yet: it opens once the cluster has elected its leaders)."""
    body = {
        "model": served_model(base, timeout),
        "input": "Remember me.",
        "max_output_tokens": 4,
        "store": True,
    }
    try:
        return post(base + "/v1/responses", body, timeout)
    except urllib.error.HTTPError:
        return None


def nats_nodes(launcher_pid: int) -> dict[str, int]:
    """node name -> pid of each nats-server the launcher started (from their command lines)."""
    found = {}
    for pid in descendants(launcher_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for arg in argv:
            name = Path(arg.decode(errors="replace")).name
            if name.startswith("node-") and name.endswith(".conf"):
                found[name.removesuffix(".conf")] = pid
    return found


def test_up_with_a_3_node_cluster_survives_a_node(tmp_path: Path) -> None:
    port = free_port()
    args = ["--model", "demo", "--nats-cluster", "3", "--port", str(port), "--num-kv-blocks", "64"]
    log = tmp_path / "up.log"
    with pdserve_up(args, log) as proc:
        text = log.read_text()
        assert "nats: cluster of 3 at nats://127.0.0.1:" in text, text
        base = f"http://127.0.0.1:{port}"
        first = chat(base)["choices"][0]["message"]["content"]
        stored = wait_until(lambda: stored_response(base), 30, "the response store")
        nodes = nats_nodes(proc.pid)
        assert set(nodes) == {"node-1", "node-2", "node-3"}, nodes
        # prefill-0 prefers node-1, decode-0 node-2 (slot 1): kill the decode worker's node
        os.kill(nodes["node-2"], signal.SIGKILL)
        started = time.monotonic()
        again = wait_until(lambda: _try_chat(base), 30, "a reply after node-2 died")
        assert again["choices"][0]["message"]["content"] == first
        assert time.monotonic() - started < 15
        assert proc.poll() is None  # the launcher serves on while a node lives
        wait_until(lambda: "NATS node-2 exited" in log.read_text(), 10, "the launcher's report")
        # the bucket's other two copies answer (after JetStream elects new leaders if node-2 led)
        again = wait_until(lambda: _try_get(f"{base}/v1/responses/{stored['id']}"), 30, "stored")
        assert again["output"] == stored["output"]


def _try_get(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.load(resp)
    except OSError:
        return None


def _try_chat(base: str) -> dict | None:
    try:
        return chat(base, timeout=10)
    except OSError:
        return None
