"""The whole served stack vs HF transformers ``generate``, on engine_bench's model and workload.

``perf/engine_bench.py`` measures the engine in-process; this measures what a user gets: the
same 48 requests sent at once over HTTP to a real ``pdserve up`` (gateway, NATS, workers as
processes), once disaggregated (1 prefill + 1 decode worker, KV pulled over UCX) and once
aggregated (1 decode worker that prefills itself), against HF ``generate`` on static batches of
8 in the same run. Reports output tok/s of each and the ratios to HF.

    python -m perf.stack_bench [--requests 48] [--json perf/results/stack_bench.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from pdserve.services.control.processes import free_port
from perf.engine_bench import Workload, make_model, make_workload, run_hf

READY_TIMEOUT = 300.0
STACK_OPTIONS = {
    # engine_bench's engine settings, so the engine is the same and only the serving differs
    "PDSERVE_DTYPE": "float32",
    "PDSERVE_NUM_KV_BLOCKS": "2048",
    "PDSERVE_MAX_NUM_SEQS": "64",
    "PDSERVE_MAX_NUM_BATCHED_TOKENS": "2048",
    "PDSERVE_SERVED_MODEL_NAME": "bench",
}


@dataclass
class StackRun:
    name: str
    prefill_workers: int
    seconds: float
    tokens_per_s: float
    vs_hf: float


@dataclass
class Result:
    requests: int
    output_tokens: int
    hf_seconds: float
    hf_tokens_per_s: float
    stacks: list[StackRun]
    cpus: int


def add_tokenizer(model_dir: Path, vocab: int) -> None:
    """The gateway needs a tokenizer; requests here are token ids, so any with the model's
    vocabulary serves: one word per id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(model_dir / "tokenizer.json"))


def start_stack(
    model_dir: Path | str, prefill_workers: int, log: Path, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, str]:
    """``pdserve up`` (1 decode worker) with the bench's engine settings and ``extra`` flags."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    env.update(STACK_OPTIONS, UCX_WARN_UNUSED_ENV_VARS="n", TOKENIZERS_PARALLELISM="false")
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--model", str(model_dir)]
    argv += ["--prefill-workers", str(prefill_workers), "--decode-workers", "1"]
    argv += ["--port", str(port), *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + READY_TIMEOUT
    while "pdserve ready at" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"pdserve up did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return proc, f"http://127.0.0.1:{port}"


def stop_stack(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def serve_all(url: str, wl: Workload) -> float:
    """Seconds from sending every request at once to the last one's answer."""
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(prompt: list[int], n: int) -> None:
            body = {"model": "bench", "prompt": prompt, "max_tokens": n, "temperature": 0.0}
            body["ignore_eos"] = True
            async with session.post(url + "/v1/completions", json=body) as resp:
                answer = await resp.json()
                if resp.status != 200 or answer["usage"]["completion_tokens"] != n:
                    raise RuntimeError(f"bad answer ({resp.status}): {str(answer)[:300]}")

        await one(wl.prompts[0][:8], 2)  # warm-up: first pull endpoints, first forward
        start = time.perf_counter()
        await asyncio.gather(*map(one, wl.prompts, wl.output_lens))
        return time.perf_counter() - start


def run_stack(model_dir: Path, wl: Workload, prefill_workers: int, log: Path) -> float:
    proc, url = start_stack(model_dir, prefill_workers, log)
    try:
        return asyncio.run(serve_all(url, wl))
    finally:
        stop_stack(proc)


def main(argv: list[str] | None = None) -> Result:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args(argv)
    wl = make_workload(args.requests, args.vocab)
    sides = [("disaggregated 1P1D", 1), ("aggregated 1D", 0)]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "llama", args.layers, args.hidden, args.vocab)
        add_tokenizer(model_dir, args.vocab)
        seconds = {
            name: run_stack(model_dir, wl, p, Path(tmp) / f"up-{p}.log") for name, p in sides
        }
        hf_s = run_hf(model_dir, wl)
    tokens = wl.output_tokens
    stacks = [
        StackRun(name, p, round(s, 2), round(tokens / s, 1), round(hf_s / s, 2))
        for (name, p), s in zip(sides, seconds.values(), strict=True)
    ]
    res = Result(
        args.requests,
        tokens,
        round(hf_s, 2),
        round(tokens / hf_s, 1),
        stacks,
        len(os.sched_getaffinity(0)),
    )
    print(
        f"HF generate (static batches of 8): {res.hf_tokens_per_s:8.1f} output tok/s ({hf_s:.1f} s)"
    )
    for s in stacks:
        print(
            f"pdserve up, {s.name:18s}   {s.tokens_per_s:8.1f} output tok/s ({s.seconds:.1f} s)  {s.vs_hf:.2f}x HF"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(asdict(res), indent=2))
    return res


if __name__ == "__main__":
    main()
