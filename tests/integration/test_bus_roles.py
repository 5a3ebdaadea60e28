"""A real ``pdserve up`` whose NATS has one user per role (shared/bus/roles.py): the stack serves
end to end as its roles, a decode worker's credentials are refused on the gateway's request and
admin subjects, and junk published on the workers' and the gateway's subjects is dropped,
counted (``pdserve_bus_rejected_messages_total``) and never stops a real request after it."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from pathlib import Path

import msgpack
import nats
import pytest

from pdserve.shared.bus.protocol import PROTOCOL_VERSION
from tests.integration.stack import descendants, free_port, pdserve_up, wait_until
from tests.integration.test_up import metric, scrape

JUNK = [
    b"\xc1",  # not msgpack
    b"\x91" * 3000 + b"\x00",  # nested past msgpack's stack
    b"\xdd\xff\xff\xff\xff",  # announces 4 G items
    msgpack.packb({"v": PROTOCOL_VERSION, "type": "prefill_request", "bus_id": 7}),
    msgpack.packb({"v": PROTOCOL_VERSION, "type": "no_such_type"}),
    b"\xde\x00\x01\xa1v" + b"\xdd\x00\x01\x00\x00" + b"\x80" * 65536,  # many empty maps
]


def complete(url: str, prompt: list[int]) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def child_env(proc_pid: int, role: str) -> dict[str, str]:
    """The environment of the stack's ``role`` process: what it logs in with."""
    for pid, _ in descendants(proc_pid).items():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"pdserve.cli" in cmd and cmd[-2:] == [role.encode(), b""]:
            raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            return dict(e.decode().split("=", 1) for e in raw if b"=" in e)
    raise AssertionError(f"no {role} process under {proc_pid}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, llama_dir):
    port = free_port()
    log = tmp_path_factory.mktemp("roles") / "up.log"
    env = {"PDSERVE_NUM_KV_BLOCKS": "64", "PDSERVE_SERVED_MODEL_NAME": "m"}
    env["PDSERVE_METRICS_PORT"] = str(free_port())
    with pdserve_up(["--model", str(llama_dir), "--port", str(port)], log, env) as proc:
        text = log.read_text()
        control = Path(re.search(r"control's in (\S+?)\)", text).group(1))
        nats_log = Path(re.search(r"nats: \S+, log (\S+),", text).group(1))
        yield proc, f"http://127.0.0.1:{port}", control, nats_log


class Client:
    """A raw nats-py connection that records the server's permission errors."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc = None

    async def connect(self, url: str, user: str, password: str) -> Client:
        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc))

        self.nc = await nats.connect(
            url, user=user, password=password, error_cb=on_error, allow_reconnect=False
        )
        return self

    async def violations(self, what: str, timeout: float = 5.0) -> list[str]:
        for _ in range(int(timeout / 0.05)):
            found = [
                e for e in self.errors if "permissions violation" in e.lower() and what in e.lower()
            ]
            if found:
                return found
            await asyncio.sleep(0.05)
        return []


def control_login(control: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in control.read_text().splitlines() if "=" in line)


def test_each_process_logs_in_as_its_role(stack) -> None:
    proc, url, control, nats_log = stack
    assert complete(url, list(range(10, 60)))["usage"]["completion_tokens"] == 4
    # ... and stored a response in the gateway's JetStream bucket, as the gateway
    body = {"model": "m", "input": "hi", "max_output_tokens": 2, "store": True}
    req = urllib.request.Request(
        url + "/v1/responses", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        stored = json.loads(resp.read())["id"]
    with urllib.request.urlopen(f"{url}/v1/responses/{stored}", timeout=60) as resp:
        assert json.loads(resp.read())["id"] == stored
    refused = [line for line in nats_log.read_text().splitlines() if "Violation" in line]
    assert refused == [], "a role lacks a permission it needs"
    roles = {role: child_env(proc.pid, role) for role in ("gateway", "prefill", "decode")}
    for role, env in roles.items():
        assert env["PDSERVE_NATS_USER"] == role
    passwords = {env["PDSERVE_NATS_PASSWORD"] for env in roles.values()}
    assert len(passwords) == 3, "each role has a password of its own"
    assert oct(control.stat().st_mode & 0o777) == "0o600"
    assert control_login(control)["PDSERVE_NATS_USER"] == "control"


async def test_decode_credentials_are_refused_on_the_gateways_subjects(stack) -> None:
    proc, url, control, _ = stack
    env = child_env(proc.pid, "decode")
    nats_url = control_login(control)["PDSERVE_NATS_URL"]
    decode = await Client().connect(
        nats_url, env["PDSERVE_NATS_USER"], env["PDSERVE_NATS_PASSWORD"]
    )
    try:
        await decode.nc.publish("pdserve.prefill.prefill-0", b"\x80")
        await decode.nc.publish("pdserve.admin.prefill-0", b"\x80")
        await decode.nc.flush()
        assert await decode.violations('publish to "pdserve.prefill.prefill-0"')
        assert await decode.violations('publish to "pdserve.admin.prefill-0"')
        await decode.nc.subscribe("pdserve.gw.>")  # every token stream
        await decode.nc.flush()
        assert await decode.violations('subscription to "pdserve.gw.>"')
        # what a decode worker does say is allowed: no error for its lease releases
        before = len(decode.errors)
        await decode.nc.publish("pdserve.lease.prefill-0", b"\x80")
        await decode.nc.flush()
        await asyncio.sleep(0.3)
        assert decode.errors[before:] == []
    finally:
        await decode.nc.close()
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(
            nats_url, user="decode", password="guess", allow_reconnect=False, connect_timeout=2
        )


async def test_junk_on_the_bus_is_counted_and_serving_goes_on(stack) -> None:
    proc, url, control, _ = stack
    login = control_login(control)
    ops = await Client().connect(
        login["PDSERVE_NATS_URL"], login["PDSERVE_NATS_USER"], login["PDSERVE_NATS_PASSWORD"]
    )
    worker_metrics = int(child_env(proc.pid, "decode")["PDSERVE_METRICS_PORT"])
    try:
        for subject in (
            "pdserve.prefill.prefill-0",
            "pdserve.decode.decode-0",
            "pdserve.lease.prefill-0",
            "pdserve.cancel",
            "pdserve.load.decode.nobody",  # the gateway's registry and the decode worker's
        ):
            for data in JUNK:
                await ops.nc.publish(subject, data)
        await ops.nc.flush()
    finally:
        await ops.nc.close()
    name = "pdserve_bus_rejected_messages_total{"
    wait_until(lambda: metric(scrape(url), name) >= len(JUNK), 20, "the gateway's count")
    assert 'subject_kind="load"' in scrape(url)
    decode_url = f"http://127.0.0.1:{worker_metrics}"
    wait_until(lambda: metric(scrape(decode_url), name) >= 2 * len(JUNK), 20, "decode's count")
    text = scrape(decode_url)
    assert 'reason="malformed",subject_kind="decode"' in text
    assert 'reason="schema",subject_kind="cancel"' in text
    assert complete(url, list(range(20, 70)))["usage"]["completion_tokens"] == 4
