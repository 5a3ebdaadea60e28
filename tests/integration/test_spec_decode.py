"""Speculative decoding through a real 1P1D stack, n-gram and draft model: the decode worker
drafts and verifies, the prefill worker never does; greedy answers are HF's token for token; the worker's
/metrics, the gateway's re-export, ``pdserve bench``'s reader and the ``decode.generate`` span
all see the drafts; a request that opts out (``"speculate": false``) drafts nothing.

Real nats-server, UCX and HTTP, a tiny HF checkpoint (HF float64 is the oracle); its random
weights fall into loops, and the prompts quote themselves, so n-gram drafts are accepted; the
draft model is the checkpoint itself, so its drafts are too (the draft's own cache is filled
on the decode worker after the prompt's KV is pulled)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.services.control.bench.spec_counters import scrape_spec
from tests.engine_support import random_prompts
from tests.integration.stack import (
    free_port,
    start_nats,
    start_service,
    stop_all,
    wait_http,
    wait_until,
)
from tests.oracle import hf_greedy
from tests.otlp_receiver import OtlpReceiver

MAX_TOKENS = 24
PROMPTS = [p + p[: len(p) // 2] + p for p in random_prompts(4, seed=11, max_len=30)]


METHODS = {
    "ngram": {"speculative": "ngram", "ngram_min": 1},
    # the target drafting for itself: a draft model with its tokenizer that is always right
    "draft": {"speculative": "draft", "draft_model": "{model}"},
}


@pytest.fixture(scope="module", params=list(METHODS))
def stack(request, tmp_path_factory, checkpoints):
    logs = tmp_path_factory.mktemp("spec")
    model = str(checkpoints["llama-gqa"])
    method = {
        k: v.format(model=model) if isinstance(v, str) else v
        for k, v in METHODS[request.param].items()
    }
    rx = OtlpReceiver()
    rx.start_in_thread()
    nats = start_nats(logs)
    port, metrics_port = free_port(), free_port()
    # speculation options on every process, as `pdserve up` passes them: only decode drafts
    spec = {"model": model, **method, "spec_token_cost": 0}
    env = rx.env()
    children = [
        start_service(
            "prefill", nats.url, logs, env={**env, "PDSERVE_WORKER_ID": "spec-p0"}, options=spec
        ),
        start_service(
            "decode",
            nats.url,
            logs,
            env={**env, "PDSERVE_WORKER_ID": "spec-d0"},
            options={**spec, "metrics_port": metrics_port},
        ),
        start_service(
            "gateway", nats.url, logs, env={**env, "PDSERVE_PORT": str(port)}, options=spec
        ),
    ]
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/health", 120, children)
        wait_until(lambda: "spec-p0" in scrape(base), 30, "prefill worker")
        yield base, f"http://127.0.0.1:{metrics_port}", model, rx
    finally:
        stop_all(children)
        nats.stop()
        rx.stop_in_thread()


def scrape(url: str) -> str:
    return urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()


def counters(url: str, prefix: str) -> dict[str, float]:
    """Every ``prefix*`` sample of ``url``'s /metrics, summed by name (and position)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(scrape(url)):
        for s in family.samples:
            if s.name.startswith(prefix):
                key = s.name + (f"[{s.labels['position']}]" if "position" in s.labels else "")
                out[key] = out.get(key, 0.0) + s.value
    return out


def labelled(url: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples on ``url``'s /metrics whose labels include ``labels``."""
    return sum(
        s.value
        for family in text_string_to_metric_families(scrape(url))
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


def complete(base: str, prompt: list[int], client_id: str, **extra) -> str:
    body = {
        "model": "llama-gqa",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    req = urllib.request.Request(
        f"{base}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "x-request-id": client_id},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        answer = json.loads(resp.read())
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    assert answer["choices"][0]["finish_reason"] == "length"
    return answer["choices"][0]["text"]


def text(model: str, tokens: list[int]) -> str:
    from pdserve.gateway.tokenizer import ModelTokenizer

    return ModelTokenizer.from_dir(model).decode(tokens)


def test_decode_worker_drafts_and_answers_are_hf_s(stack):
    base, worker, model, rx = stack
    expected = hf_greedy(model, PROMPTS, MAX_TOKENS)
    for i, prompt in enumerate(PROMPTS):
        assert complete(base, prompt, f"spec-{i}") == text(model, expected[i])
    w = counters(worker, "pdserve_worker_spec_decode_")
    drafts = w["pdserve_worker_spec_decode_num_drafts_total"]
    draft_tokens = w["pdserve_worker_spec_decode_num_draft_tokens_total"]
    accepted = w["pdserve_worker_spec_decode_num_accepted_tokens_total"]
    assert draft_tokens >= drafts > 0 and 0 < accepted <= draft_tokens
    per_pos = [
        w.get(f"pdserve_worker_spec_decode_num_accepted_tokens_per_pos_total[{j}]", 0.0)
        for j in range(4)
    ]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)

    # the gateway re-exports the worker's totals (from its heartbeats); bench reads them there
    def gateway_caught_up() -> bool:
        g = counters(base, "pdserve_spec_decode_")
        return g.get("pdserve_spec_decode_num_accepted_tokens_total") == accepted

    wait_until(gateway_caught_up, 10, "the gateway's spec_decode counters")
    totals = scrape_spec(base)
    assert (totals.drafts, totals.draft_tokens, totals.accepted_tokens) == (
        drafts,
        draft_tokens,
        accepted,
    )

    # each request's decode.generate span tells its own drafts
    def generate_spans(spans):
        return [
            s
            for s in spans
            if s.name == "decode.generate"
            and str(s.attributes.get("pdserve.request_id", "")).startswith("spec-")
        ]

    spans = rx.wait_for_sync(lambda s: len(generate_spans(s)) == len(PROMPTS), timeout=30)
    spans = generate_spans(spans)
    # the roofline (shared/telemetry/roofline.py): every span of a decode lifetime says which
    # bound its steps hit, against the worker's measured peaks
    for s in spans:
        assert s.attributes["pdserve.roofline.bound"] in ("compute", "memory")
        assert s.attributes["pdserve.roofline.intensity"] > 0
        assert 0 < s.attributes["pdserve.roofline.bandwidth_fraction"]
        assert 0 < s.attributes["pdserve.roofline.compute_fraction"]
    assert sum(s.attributes.get("pdserve.spec.accepted_tokens", 0) for s in spans) == accepted
    for s in spans:
        if "pdserve.spec.draft_tokens" in s.attributes:
            rate = (
                s.attributes["pdserve.spec.accepted_tokens"]
                / s.attributes["pdserve.spec.draft_tokens"]
            )
            assert s.attributes["pdserve.spec.acceptance_rate"] == pytest.approx(rate)


def test_worker_and_gateway_report_the_steps_roofline(stack):
    """The worker's /metrics counts its forward passes' FLOPs, bytes and seconds by phase, with
    its peaks and per-step fractions; the gateway re-exports the totals per worker from the
    heartbeats; prefill.forward spans carry their step's roofline."""
    base, worker, model, rx = stack
    complete(base, PROMPTS[1], "roof-1")
    decode = {"phase": "decode", "role": "decode"}
    flops = labelled(worker, "pdserve_worker_step_flops_total", **decode)
    moved = labelled(worker, "pdserve_worker_step_bytes_total", **decode)
    busy = labelled(worker, "pdserve_worker_step_busy_seconds_total", **decode)
    assert flops > 0 and moved > 0 and busy > 0
    assert labelled(worker, "pdserve_worker_peak_bytes_per_second", role="decode") > 0
    assert labelled(worker, "pdserve_worker_peak_flops_per_second", role="decode") > 0
    steps = labelled(worker, "pdserve_worker_step_bandwidth_fraction_count", **decode)
    assert steps == labelled(worker, "pdserve_worker_step_arithmetic_intensity_count", **decode)
    assert steps > 0

    def gateway_caught_up() -> bool:
        # the heartbeat after the latest step (the worker is idle now)
        return labelled(base, "pdserve_step_flops_total", worker="spec-d0", phase="decode") == flops

    wait_until(gateway_caught_up, 10, "the gateway's roofline counters")
    got = labelled(base, "pdserve_step_bytes_total", worker="spec-d0", phase="decode")
    assert got == moved
    assert labelled(base, "pdserve_step_flops_total", worker="spec-p0", phase="prefill") > 0
    assert labelled(base, "pdserve_peak_bytes_per_second", worker="spec-p0") > 0

    def forwards(spans):
        return [
            s
            for s in spans
            if s.name == "prefill.forward" and s.attributes.get("pdserve.request_id") == "roof-1"
        ]

    (span,) = forwards(rx.wait_for_sync(lambda s: forwards(s), timeout=30))
    assert span.attributes["pdserve.roofline.bound"] in ("compute", "memory")
    assert span.attributes["pdserve.roofline.compute_fraction"] > 0


def test_a_request_may_opt_out(stack):
    base, worker, model, _ = stack
    before = counters(worker, "pdserve_worker_spec_decode_num_drafts")
    expected = hf_greedy(model, PROMPTS[:1], MAX_TOKENS)[0]
    assert complete(base, PROMPTS[0], "spec-out", speculate=False) == text(model, expected)
    assert counters(worker, "pdserve_worker_spec_decode_num_drafts") == before


def test_bench_reports_each_phases_bottleneck(stack, tmp_path, capsys):
    """``pdserve bench`` against the stack: its report's bottleneck section, per phase, from the
    gateway's per-worker roofline totals before and after the run (services/control/bench/bottleneck.py),
    beside the speculation it reads the same way."""
    from pdserve.cli import main as cli_main
    from pdserve.services.engine.model_config import ModelConfig
    from pdserve.shared.telemetry.roofline import ModelCost, ModelShape, Storage, step_shape

    base, _, model, _ = stack
    rc = cli_main(
        [
            "bench",
            "--base-url",
            base,
            "--num-requests",
            "4",
            "--input-len",
            "24",
            "--output-len",
            "12",
            "--request-rate",
            "inf",
            "--result-dir",
            str(tmp_path),
            "--result-name",
            "roof",
            "--no-plots",
            "--no-progress",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "bottleneck (forward passes during the run" in out
    doc = json.loads((tmp_path / "roof.json").read_text())
    m = doc["runs"][0]["metrics"]
    assert m["completed"] == 4 and m["spec_drafts"] > 0
    phases = m["bottleneck"]
    assert phases["prefill"]["workers"] == ["spec-p0"] and phases["decode"]["workers"] == [
        "spec-d0"
    ]
    for phase, b in phases.items():
        assert b["flops"] > 0 and b["bytes"] > 0 and b["busy_seconds"] > 0
        assert b["intensity"] == pytest.approx(b["flops"] / b["bytes"])
        # a tiny model's passes are overhead, far below either roof; never above one
        assert 0 < b["compute_fraction"] < 1 and 0 < b["bandwidth_fraction"] < 1
        assert b["bound"] in ("compute", "memory") and b["advice"].startswith(f"{phase} at ")
        assert f"  {phase}: {b['bound']}-bound: " in out
    # the run's passes only, not the warm-up request's before it: the prefill FLOPs are those
    # of its 4 prompts of 24 tokens (one logits row each), however they were packed into passes
    cfg = ModelConfig.from_dir(Path(model))
    shape = ModelShape(
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size,
    )
    prompts = step_shape([24] * 4, [0] * 4, 0, False, logit_rows=4, lm_head_calls=4)
    expected = ModelCost(shape, Storage(0, 0, 0, 0)).cost(prompts).flops
    assert phases["prefill"]["flops"] == pytest.approx(expected, rel=1e-9)
    md = (tmp_path / "roof.md").read_text()
    assert "## Bottleneck" in md and "| pdserve @ inf req/s | decode |" in md
