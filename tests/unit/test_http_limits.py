"""The HTTP parser's limits and deadlines, over raw sockets against the real app: a request line,
a header line or a header count past ``--http-max-line-size``, ``--http-max-field-size`` and
``--http-max-headers`` gets a 400 and the gateway keeps serving; a client that sends its headers
a byte at a time is cut off after ``--http-keepalive-timeout``, and one that stalls in its body
gets a 408 after ``--http-body-timeout``. The limits are set below aiohttp's own defaults, so
these fail if the options do not reach the server."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import pytest

from pdserve.gateway.http_log import LOGGER_NAME
from tests.unit.fake_workers import MODEL
from tests.unit.gateway_fixtures import serving, train_byte_level, write_model_dir

LIMITS = {
    "http_max_line_size": 1024,
    "http_max_field_size": 1024,
    "http_max_headers": 20,
    "http_keepalive_timeout": 1.0,
    "http_body_timeout": 0.5,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / MODEL
    return write_model_dir(path, train_byte_level(300), max_position_embeddings=1024)


async def exchange(port: int, raw: bytes) -> tuple[int, bytes]:
    """Send ``raw`` on a new connection: the answer's status and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        status = int(head.split(b" ", 2)[1])
        length = next(
            (
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ),
            0,
        )
        body = await asyncio.wait_for(reader.readexactly(length), 5) if length else b""
        return status, body
    finally:
        writer.close()


def get(path: str, headers: list[str] = ()) -> bytes:
    lines = [f"GET {path} HTTP/1.1", "Host: gateway", *headers, "Connection: close", "", ""]
    return "\r\n".join(lines).encode()


async def test_oversized_request_lines_and_headers_get_400_and_the_gateway_serves_on(model_dir):
    async with serving(model_dir, **LIMITS) as (client, _):
        port = client.server.port
        assert port is not None
        assert (await exchange(port, get("/health")))[0] == 200
        too_long_path = "/health?" + "a" * 1100
        too_long_header = ["X-Filler: " + "b" * 1100]
        too_many = [f"X-Header-{i}: {i}" for i in range(30)]
        for raw in (get(too_long_path), get("/health", too_long_header), get("/health", too_many)):
            status, _ = await exchange(port, raw)
            assert status in (400, 431)
        # within the limits all is well, and the gateway still answers
        fine = [f"X-Header-{i}: {i}" for i in range(10)]
        assert (await exchange(port, get("/health?" + "a" * 500, fine)))[0] == 200


async def test_a_client_trickling_its_headers_is_cut_off(model_dir):
    async with serving(model_dir, **LIMITS) as (client, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", client.server.port)
        started = time.monotonic()
        writer.write(b"GET /health HTTP/1.1\r\nHost: gateway\r\n")
        closed = False
        try:
            for _ in range(50):  # 10 s of a header byte every 0.2 s, unless cut off
                writer.write(b"X")
                await writer.drain()
                try:
                    closed = await asyncio.wait_for(reader.read(1), 0.2) == b""
                except TimeoutError:
                    continue
                break
        except ConnectionError:
            closed = True
        finally:
            writer.close()
        assert closed and time.monotonic() - started < 3.0


async def test_a_body_that_stalls_gets_408(model_dir):
    async with serving(model_dir, **LIMITS) as (client, _):
        head = (
            "POST /tokenize HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
            "Content-Length: 100\r\n\r\n"
        )
        started = time.monotonic()
        status, body = await exchange(client.server.port, head.encode() + b'{"prompt": ')
        assert status == 408 and time.monotonic() - started < 3.0
        error = json.loads(body)["error"]
        assert error["code"] == "request_timeout" and "--http-body-timeout" in error["message"]


async def test_malformed_requests_are_logged_briefly(model_dir, caplog, monkeypatch):
    """aiohttp would log each with its traceback at ERROR: a flood of them would flood the log."""
    async with serving(model_dir, **LIMITS) as (client, _):
        (limiter,) = logging.getLogger(LOGGER_NAME).filters
        monkeypatch.setattr(limiter, "_next", 0.0)  # earlier tests' lines are not this one's
        with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
            for _ in range(5):
                assert (await exchange(client.server.port, get("/health?" + "a" * 1100)))[0] == 400
    records = [r for r in caplog.records if r.name == LOGGER_NAME]
    assert len(records) == 1  # within a second: the others are left out, and said so later
    (record,) = records
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert "Got more than 1024 bytes" in record.getMessage()
