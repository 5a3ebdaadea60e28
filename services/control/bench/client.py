"""Streaming client for OpenAI-compatible /v1/completions endpoints.

Timing follows `vllm bench serve` so numbers are comparable: the clock starts just before the
request is sent (after waiting for a --max-concurrency slot), every SSE chunk that carries
`choices` is one timestamp, TTFT is the first such chunk, ITLs are the gaps between the later
ones, and E2E latency ends at the last such chunk (not at `[DONE]`).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
from tqdm.asyncio import tqdm

from pdserve.services.control.bench.arrivals import arrival_offsets, paced
from pdserve.services.control.bench.datasets import BenchRequest


@dataclass
class RequestRecord:
    """What the client saw of one request. Times are seconds."""

    index: int
    prompt_len: int
    expected_output_len: int
    success: bool = False
    error: str = ""
    start_time: float = 0.0  # when it was sent, from the start of the run
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2E: sent -> last chunk with choices
    chunk_tokens: int = 0  # tokens counted from the streamed chunks
    usage_tokens: int | None = None  # completion_tokens of the final usage chunk, if sent
    finish_reason: str | None = None

    @property
    def output_tokens(self) -> int:
        # The server's own count wins: a chunk may carry several tokens (or none, while the
        # detokenizer holds back half a UTF-8 character), so chunk counting is a fallback.
        return self.usage_tokens if self.usage_tokens is not None else self.chunk_tokens


@dataclass
class ClientConfig:
    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    timeout: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


@dataclass
class LoadConfig:
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0


@dataclass
class BenchRun:
    records: list[RequestRecord]
    duration: float  # from the first send to the last request's end
    load: LoadConfig
    client_cpu_s: float = 0.0  # CPU time this process spent meanwhile (client saturation check)


def completion_body(cfg: ClientConfig, req: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": cfg.model,
        "prompt": req.prompt_token_ids,
        "max_tokens": req.output_len,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True  # vLLM-style extension: makes output length exact
    body.update(cfg.extra_body)
    return body


def _chunk_token_count(choice: dict[str, Any]) -> int:
    """Tokens in one streamed choice: exact when the server says, else one per non-empty text."""
    if isinstance(choice.get("token_ids"), list):
        return len(choice["token_ids"])
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):
        return len(logprobs["tokens"])
    return 1 if choice.get("text") else 0


async def send_completion(
    session: aiohttp.ClientSession,
    cfg: ClientConfig,
    req: BenchRequest,
    index: int = 0,
    run_start: float | None = None,
) -> RequestRecord:
    rec = RequestRecord(index=index, prompt_len=req.prompt_len, expected_output_len=req.output_len)
    body = completion_body(cfg, req)
    sent = time.perf_counter()
    rec.start_time = sent - (run_start if run_start is not None else sent)
    last = sent
    first = True
    done = False
    try:
        async with session.post(cfg.url, json=body, headers=cfg.headers()) as resp:
            if resp.status != 200:
                text = await resp.text()
                rec.error = f"HTTP {resp.status}: {text[:500]}"
                return rec
            async for raw in resp.content:
                now = time.perf_counter()  # arrival time, before any parsing
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators, ": keep-alive" comments, event: lines
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                data = json.loads(payload)
                if "error" in data:
                    rec.error = f"stream error: {json.dumps(data['error'])[:500]}"
                    return rec
                choices = data.get("choices")
                if choices:
                    if first:
                        rec.ttft = now - sent
                        first = False
                    else:
                        rec.itl.append(now - last)
                    last = now
                    rec.chunk_tokens += _chunk_token_count(choices[0])
                    rec.finish_reason = choices[0].get("finish_reason") or rec.finish_reason
                usage = data.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    rec.usage_tokens = int(usage["completion_tokens"])
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
        return rec
    if first:
        rec.error = "stream ended without a chunk carrying choices"
        return rec
    if not done:
        # a connection cut mid-answer is a failure, however many tokens came before it
        rec.error = f"stream ended without [DONE] after {rec.chunk_tokens} tokens"
        return rec
    rec.latency = last - sent
    rec.success = True
    return rec


def make_session(cfg: ClientConfig, max_concurrency: int | None) -> aiohttp.ClientSession:
    # aiohttp's default pool caps at 100 connections, which would silently become a hidden
    # concurrency limit; size it to what the load asks for (0 = unlimited).
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False)


async def discover_model(base_url: str, api_key: str | None = None, timeout: float = 30) -> str:
    """The first model the endpoint lists under /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async with session.get(base_url.rstrip("/") + "/v1/models", headers=headers) as resp:
            resp.raise_for_status()
            data = await resp.json()
    models = data.get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return str(models[0]["id"])


async def warm_up(cfg: ClientConfig, requests: list[BenchRequest]) -> None:
    """Send a few unmeasured requests first, one at a time, so the run fails fast on a bad
    endpoint and no cold start (lazy allocation, first kernel compile) lands in the numbers.
    They should be prompts the run does not use, or a prefix cache would flatter the run."""
    async with make_session(cfg, None) as session:
        for req in requests:
            rec = await send_completion(session, cfg, req)
            if not rec.success:
                raise RuntimeError(f"warm-up request to {cfg.url} failed: {rec.error}")


async def run_benchmark(
    requests: list[BenchRequest],
    cfg: ClientConfig,
    load: LoadConfig,
    progress: bool = True,
    desc: str = "",
) -> BenchRun:
    """Send every request at its arrival time and wait for all of them."""
    rng = np.random.default_rng(load.seed)
    offsets = arrival_offsets(len(requests), load.request_rate, load.burstiness, rng)
    limit = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    bar = tqdm(total=len(requests), disable=not progress, desc=desc or None, unit="req")

    async with make_session(cfg, load.max_concurrency) as session:

        async def one(index: int, req: BenchRequest, start: float) -> RequestRecord:
            if limit is None:
                rec = await send_completion(session, cfg, req, index, start)
            else:
                async with limit:
                    rec = await send_completion(session, cfg, req, index, start)
            bar.update(1)
            return rec

        cpu_start = time.process_time()
        start = time.perf_counter()
        tasks = [
            asyncio.create_task(one(i, req, start))
            async for i, req in paced(requests, offsets, start)
        ]
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
    bar.close()
    return BenchRun(records=records, duration=duration, load=load, client_cpu_s=cpu)
