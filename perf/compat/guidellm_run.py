"""guidellm with its default request settings against a running pdserve: streaming
``/v1/chat/completions`` with ``stream_options: {include_usage, continuous_usage_stats}``,
``max_completion_tokens`` and ``ignore_eos: true``, and token counts taken from the server's
usage. Only the load is kept small: 4 concurrent streams, 16 requests of 64 prompt tokens (plus
the chat template) and 16 output tokens."""

from __future__ import annotations

import json
from pathlib import Path

from perf.compat.stack import Stack
from perf.compat.tool import ToolResult, installed_version, pdserve_errors, run_logged, venv_bin

TIMEOUT_S = 600.0
STREAMS = 4
REQUESTS = 16
PROMPT_TOKENS = 64
OUTPUT_TOKENS = 16


def command(stack: Stack, tokenizer_dir: Path, report: Path) -> list[str]:
    return [
        str(venv_bin("guidellm", "guidellm")),
        "run",
        "--backend",
        f"kind=openai_http,target={stack.base_url},model={stack.model}",
        "--profile",
        f"kind=concurrent,streams={STREAMS}",
        "--constraint",
        f"kind=max_requests,count={REQUESTS}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
        "--tokenizer",  # synthetic prompts are sized with it; the hub is not reachable
        f"kind=huggingface_auto,model={tokenizer_dir}",
        "--output",
        f"kind=json,path={report}",
        "--disable-console-interactive",
    ]


def _median(metrics: dict, name: str) -> float:
    return metrics[name]["successful"]["median"]


def run_guidellm(stack: Stack, tokenizer_dir: Path, out: Path) -> ToolResult:
    version = installed_version("guidellm", "guidellm")
    report = out / "guidellm.json"
    log = out / "guidellm.log"
    rc, seconds = run_logged(command(stack, tokenizer_dir, report), log, TIMEOUT_S)
    text = log.read_text(errors="replace")
    if rc != 0 or not report.exists():
        errors = pdserve_errors(text) or [f"exit {rc}; see {log}"]
        return ToolResult(
            "guidellm", version, False, f"exit {rc}: {errors[0]}", errors, {}, seconds
        )
    bench = json.loads(report.read_text())["benchmarks"][0]
    totals = bench["metrics"]["request_totals"]
    errored = bench["requests"].get("errored") or []
    errors = pdserve_errors(json.dumps(errored)) or [
        str(r["info"].get("error")) for r in errored[:3] if r["info"].get("error")
    ]
    metrics = bench["metrics"]
    output_tokens = [r["output_tokens"] for r in bench["requests"]["successful"]]
    details = {
        "requests": totals,
        "output_tokens_per_request": sorted(set(output_tokens)),
        "ttft_ms_p50": _median(metrics, "time_to_first_token_ms"),
        "itl_ms_p50": _median(metrics, "inter_token_latency_ms"),
        "output_tok_per_s": metrics["output_tokens_per_second"]["successful"]["mean"],
    }
    # ignore_eos: every answer is exactly OUTPUT_TOKENS long, as counted by the server's usage
    lengths_ok = output_tokens == [OUTPUT_TOKENS] * REQUESTS
    ok = totals["successful"] == REQUESTS and not errored and lengths_ok
    lengths = (
        f"{OUTPUT_TOKENS} tokens each" if lengths_ok else f"tokens {sorted(set(output_tokens))}"
    )
    summary = (
        f"{totals['successful']}/{REQUESTS} requests ok ({totals['errored']} errored, "
        f"{totals['incomplete']} incomplete), {lengths}, TTFT p50 "
        f"{details['ttft_ms_p50']:.0f} ms, ITL p50 {details['itl_ms_p50']:.0f} ms, "
        f"{details['output_tok_per_s']:.1f} output tok/s"
    )
    return ToolResult("guidellm", version, ok, summary, errors, details, seconds)
