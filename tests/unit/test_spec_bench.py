"""`pdserve bench` reports speculative-decoding acceptance from a server's /metrics."""

from __future__ import annotations

from pdserve.services.control.bench.metrics import BenchMetrics, Distribution
from pdserve.services.control.bench.results import RunResult
from pdserve.services.control.bench.spec_counters import SpecTotals, parse_spec
from pdserve.services.control.bench.sweep import print_summary

PDSERVE_GATEWAY = """\
# HELP pdserve_spec_decode_num_drafts_total Speculative drafts verified per decode worker.
# TYPE pdserve_spec_decode_num_drafts_total counter
pdserve_spec_decode_num_drafts_total{role="decode",worker="d0"} 10.0
pdserve_spec_decode_num_drafts_total{role="decode",worker="d1"} 5.0
# TYPE pdserve_spec_decode_num_draft_tokens_total counter
pdserve_spec_decode_num_draft_tokens_total{role="decode",worker="d0"} 40.0
pdserve_spec_decode_num_draft_tokens_total{role="decode",worker="d1"} 20.0
# TYPE pdserve_spec_decode_num_accepted_tokens_total counter
pdserve_spec_decode_num_accepted_tokens_total{role="decode",worker="d0"} 30.0
pdserve_spec_decode_num_accepted_tokens_total{role="decode",worker="d1"} 15.0
# TYPE pdserve_kv_cache_used_blocks gauge
pdserve_kv_cache_used_blocks{role="decode",worker="d0"} 3.0
"""

VLLM = """\
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 7.0
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 21.0
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 14.0
"""


def test_totals_from_pdserve_and_vllm_pages() -> None:
    assert parse_spec(PDSERVE_GATEWAY) == SpecTotals(15, 60, 45)  # summed over workers
    assert parse_spec(VLLM) == SpecTotals(7, 21, 14)
    assert parse_spec("# TYPE up gauge\nup 1.0\n") is None  # no speculation exposed
    assert SpecTotals(15, 60, 45).since(SpecTotals(5, 20, 5)) == SpecTotals(10, 40, 40)


def metrics(**spec) -> BenchMetrics:
    d = Distribution(4, 1.0, 0.0, 1.0, {"p99": 1.0})
    return BenchMetrics(4, 4, 0, 2.0, 40, 400, 2.0, 200.0, 220.0, d, d, d, d, 250.0, 4, 0, **spec)


def test_the_summary_prints_acceptance_only_when_there_were_drafts(capsys) -> None:
    m = metrics(spec_drafts=10, spec_draft_tokens=40, spec_accepted_tokens=30)
    assert m.spec_acceptance_rate == 0.75 and m.spec_mean_acceptance_length == 4.0
    print_summary(RunResult("pdserve", 1.0, 1.0, None, m, []))
    out = capsys.readouterr().out
    assert "speculative decoding: acceptance 75.0% (30/40 draft tokens), " in out
    assert "mean acceptance length 4.00 over 10 drafts" in out
    print_summary(RunResult("pdserve", 1.0, 1.0, None, metrics(), []))
    assert "speculative" not in capsys.readouterr().out
    restored = BenchMetrics.from_dict(m.to_dict())
    assert restored.spec_accepted_tokens == 30
