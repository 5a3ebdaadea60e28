"""A short aiperf profile against a running pdserve: streaming ``/v1/chat/completions`` (its
default endpoint), 16 requests at concurrency 4, synthetic prompts of 64 tokens and 16 output
tokens (``max_completion_tokens``)."""

from __future__ import annotations

import json
from pathlib import Path

from perf.compat.stack import Stack
from perf.compat.tool import ToolResult, installed_version, pdserve_errors, run_logged, venv_bin

TIMEOUT_S = 600.0
CONCURRENCY = 4
REQUESTS = 16
PROMPT_TOKENS = 64
OUTPUT_TOKENS = 16


def command(stack: Stack, tokenizer_dir: Path, artifacts: Path) -> list[str]:
    return [
        str(venv_bin("aiperf", "aiperf")),
        "profile",
        "--model",
        stack.model,
        "--url",
        stack.base_url,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--tokenizer",
        str(tokenizer_dir),
        "--isl",
        str(PROMPT_TOKENS),
        "--osl",
        str(OUTPUT_TOKENS),
        "--request-count",
        str(REQUESTS),
        "--concurrency",
        str(CONCURRENCY),
        # its own processes stay few on 2 shared cores
        "--workers-max",
        "2",
        "--record-processors",
        "1",
        "--ui",
        "none",
        "--no-gpu-telemetry",
        "--output-artifact-dir",
        str(artifacts),
    ]


def run_aiperf(stack: Stack, tokenizer_dir: Path, out: Path) -> ToolResult:
    version = installed_version("aiperf", "aiperf")
    artifacts = out / "aiperf"
    log = out / "aiperf.log"
    # aiperf 0.13.0 cannot load a tokenizer from a local directory with HF_HUB_OFFLINE set (it
    # looks the path up as a hub snapshot); without it a local path is read as it is.
    rc, seconds = run_logged(
        command(stack, tokenizer_dir, artifacts), log, TIMEOUT_S, hf_offline=False
    )
    report = artifacts / "profile_export_aiperf.json"
    text = log.read_text(errors="replace")
    if rc != 0 or not report.exists():
        errors = pdserve_errors(text) or [f"exit {rc}; see {log}"]
        return ToolResult("aiperf", version, False, f"exit {rc}: {errors[0]}", errors, {}, seconds)
    data = json.loads(report.read_text())
    completed = int(data.get("completed_request_count", {}).get("avg", 0))
    error_summary = data.get("error_summary") or []
    errors = pdserve_errors(json.dumps(error_summary) + text) or [
        json.dumps(e)[:300] for e in error_summary[:3]
    ]
    details = {
        "completed": completed,
        "errors": error_summary,
        "ttft_ms_p50": data["time_to_first_token"]["p50"],
        "itl_ms_p50": data["inter_token_latency"]["p50"],
        "output_tok_per_s": data["output_token_throughput"]["avg"],
        "output_sequence_length_avg": data["output_sequence_length"]["avg"],
    }
    ok = completed == REQUESTS and not error_summary
    summary = (
        f"{completed}/{REQUESTS} requests ok ({len(error_summary)} error kinds), TTFT p50 "
        f"{details['ttft_ms_p50']:.0f} ms, ITL p50 {details['itl_ms_p50']:.0f} ms, "
        f"{details['output_tok_per_s']:.1f} output tok/s, "
        f"{details['output_sequence_length_avg']:.1f} tokens per answer"
    )
    return ToolResult("aiperf", version, ok, summary, errors, details, seconds)
