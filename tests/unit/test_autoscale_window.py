"""The planner's window from two scrapes of the gateway's /metrics (model-free): percentiles
from histogram bucket deltas, rate and mean lengths from counter deltas, each worker's load from
the re-exported gauges; the workers the launcher runs count, draining ones do not.

The /metrics text is the gateway's own (GatewayMetrics and WorkerLoadCollector on a registry,
rendered as the gateway renders it), so a renamed series breaks these tests, not production."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from pdserve.services.control.autoscale_window import (
    Worker,
    bucket_quantile,
    build_window,
    parse_snapshot,
)
from pdserve.shared.bus.discovery_messages import WorkerLoad
from pdserve.shared.telemetry.metrics import GatewayMetrics, WorkerLoadCollector, render_metrics


class Gateway:
    """A gateway's metrics without a gateway: what it observes, and its /metrics text."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.metrics = GatewayMetrics(self.registry)
        self.loads: list[WorkerLoad] = []
        self.registry.register(WorkerLoadCollector(lambda: self.loads))

    def serve(self, n: int, prompt: int, output: int, ttft_s: float, itl_s: float) -> None:
        for _ in range(n):
            self.metrics.ttft.observe(ttft_s)
            for _ in range(output - 1):
                self.metrics.itl.observe(itl_s)
            self.metrics.request_finished("length", prompt, output, ttft_s + itl_s * output)

    def text(self) -> str:
        return render_metrics(self.registry)[0].decode()


def load(worker: str, role: str, used: int, running: int = 0, waiting: int = 0, **kw) -> WorkerLoad:
    return WorkerLoad(
        worker_id=worker,
        role=role,
        model="m",
        free_blocks=100 - used,
        total_blocks=100,
        running=running,
        waiting=waiting,
        **kw,
    )


def test_a_window_is_the_difference_of_two_scrapes() -> None:
    gw = Gateway()
    gw.serve(50, prompt=1000, output=10, ttft_s=30.0, itl_s=2.0)  # an earlier, slow era
    before = parse_snapshot(gw.text())
    gw.serve(8, prompt=100, output=20, ttft_s=0.07, itl_s=0.012)
    gw.serve(2, prompt=300, output=40, ttft_s=0.3, itl_s=0.012)
    gw.metrics.request_finished("error", 50, 0, 0.01)  # a failed request was demand too
    gw.loads = [
        load("prefill-0", "prefill", used=10, waiting=3),
        load("decode-0", "decode", used=60, running=5, waiting=1),
        load("decode-1", "decode", used=90, running=7, draining=True),  # the gateway says so
        load("decode-9", "decode", used=50, running=2),  # not the launcher's: not counted
    ]
    after = parse_snapshot(gw.text())
    workers = {
        "prefill-0": Worker("prefill", 100.0),
        "decode-0": Worker("decode", 90.0),
        "decode-1": Worker("decode", 80.0),
        "decode-2": Worker("decode", 3.0),  # started, still loading: capacity that is coming
    }
    window = build_window(before, after, 5.0, 0.5, workers)

    assert window.duration_s == 5.0 and window.requests == 11
    assert window.request_rate == pytest.approx(2.2)
    assert window.mean_isl == pytest.approx((8 * 100 + 2 * 300 + 50) / 11)
    assert window.mean_osl == pytest.approx((8 * 20 + 2 * 40) / 11)
    # p50 of this window's 10 TTFTs (8 in (0.06, 0.08], 2 in (0.25, 0.5]; the failed request
    # had none) lies at rank 5 of the first bucket, not in the old 30 s era
    assert window.ttft_ms == pytest.approx((0.06 + 0.02 * 5 / 8) * 1e3)
    assert 10.0 < window.itl_ms <= 15.0  # every ITL of the window was 12 ms
    by_id = {w.worker_id: w for w in window.workers}
    assert set(by_id) == {"prefill-0", "decode-0", "decode-2"}
    assert by_id["prefill-0"].queue == 3 and by_id["prefill-0"].kv_usage == pytest.approx(0.1)
    decode = by_id["decode-0"]
    assert (decode.role, decode.age_s, decode.running, decode.queue) == ("decode", 90.0, 5, 1)
    assert decode.kv_usage == pytest.approx(0.6)
    assert by_id["decode-2"].age_s == 3.0 and by_id["decode-2"].kv_usage == 0.0


def test_a_quiet_window_has_no_latencies_and_no_demand() -> None:
    gw = Gateway()
    gw.serve(5, prompt=10, output=5, ttft_s=0.1, itl_s=0.01)
    gw.loads = [load("decode-0", "decode", used=0)]
    snap = parse_snapshot(gw.text())
    window = build_window(
        snap, parse_snapshot(gw.text()), 2.0, 0.99, {"decode-0": Worker("decode", 9.0)}
    )
    assert (window.requests, window.mean_isl, window.mean_osl) == (0, 0.0, 0.0)
    assert window.ttft_ms is None and window.itl_ms is None
    assert [w.worker_id for w in window.workers] == ["decode-0"]


def test_a_counter_that_went_back_counts_no_negative_demand() -> None:
    gw = Gateway()
    gw.serve(5, prompt=10, output=5, ttft_s=0.1, itl_s=0.01)
    newer = parse_snapshot(Gateway().text())  # a restarted gateway starts from zero
    window = build_window(parse_snapshot(gw.text()), newer, 2.0, 0.5, {})
    assert window.requests == 0 and window.ttft_ms is None


# the counter's TYPE line spelled both ways prometheus_client's parser meets
CANNED_BEFORE = """\
# TYPE pdserve_time_to_first_token_seconds histogram
pdserve_time_to_first_token_seconds_bucket{le="0.1"} 4.0
pdserve_time_to_first_token_seconds_bucket{le="0.5"} 4.0
pdserve_time_to_first_token_seconds_bucket{le="1.0"} 4.0
pdserve_time_to_first_token_seconds_bucket{le="+Inf"} 4.0
pdserve_time_to_first_token_seconds_count 4.0
pdserve_time_to_first_token_seconds_sum 0.2
# TYPE pdserve_requests counter
pdserve_requests_total{finish_reason="stop"} 4.0
# TYPE pdserve_prompt_tokens counter
pdserve_prompt_tokens_total 400.0
# TYPE pdserve_generation_tokens counter
pdserve_generation_tokens_total 40.0
"""
CANNED_AFTER = """\
# TYPE pdserve_time_to_first_token_seconds histogram
pdserve_time_to_first_token_seconds_bucket{le="0.1"} 4.0
pdserve_time_to_first_token_seconds_bucket{le="0.5"} 14.0
pdserve_time_to_first_token_seconds_bucket{le="1.0"} 22.0
pdserve_time_to_first_token_seconds_bucket{le="+Inf"} 24.0
pdserve_time_to_first_token_seconds_count 24.0
pdserve_time_to_first_token_seconds_sum 20.0
# TYPE pdserve_requests_total counter
pdserve_requests_total{finish_reason="stop"} 14.0
pdserve_requests_total{finish_reason="length"} 10.0
# TYPE pdserve_prompt_tokens counter
pdserve_prompt_tokens_total 2400.0
# TYPE pdserve_generation_tokens counter
pdserve_generation_tokens_total 1040.0
# TYPE pdserve_kv_cache_used_blocks gauge
pdserve_kv_cache_used_blocks{role="decode",worker="decode-0"} 30.0
# TYPE pdserve_kv_cache_total_blocks gauge
pdserve_kv_cache_total_blocks{role="decode",worker="decode-0"} 40.0
"""


@pytest.mark.parametrize(
    ("q", "expected_ms"),
    [
        (0.25, 300.0),  # rank 5 of 20: half-way through (0.1, 0.5] (10 there)
        (0.5, 500.0),  # rank 10: the top of (0.1, 0.5]
        (0.8, 875.0),  # rank 16: 6 of the 8 in (0.5, 1.0]
        (0.99, 1000.0),  # rank 19.8: in +Inf, so the largest finite bound
    ],
)
def test_percentiles_interpolate_inside_the_bucket_deltas(q: float, expected_ms: float) -> None:
    window = build_window(parse_snapshot(CANNED_BEFORE), parse_snapshot(CANNED_AFTER), 10.0, q, {})
    assert window.requests == 20 and window.request_rate == 2.0
    assert (window.mean_isl, window.mean_osl) == (100.0, 50.0)
    assert window.ttft_ms == pytest.approx(expected_ms)
    assert window.itl_ms is None  # no ITL histogram in this text at all


def test_gauges_per_worker_and_a_first_scrape_without_history() -> None:
    after = parse_snapshot(CANNED_AFTER)
    assert after.workers["decode-0"].kv_usage == 0.75
    # against an empty "before" (the first scrape of a fresh gateway) every count is new
    assert bucket_quantile((), after.ttft, 0.5) == pytest.approx(0.1 + 0.4 * (12 - 4) / 10)
    assert bucket_quantile(after.ttft, after.ttft, 0.5) is None


def test_requests_count_when_they_arrive_not_when_they_finish() -> None:
    """A backlog finishes in bursts: counted at the finish, its windows read 16, 0, 16... and the
    zero ones as no demand (1P1D <-> 2P2D flapped). Arrivals = finished + the in-flight change."""
    gw = Gateway()
    before = parse_snapshot(gw.text())
    gw.metrics.in_flight.inc(5)  # five arrive, none finishes in this window
    quiet = parse_snapshot(gw.text())
    window = build_window(before, quiet, 10.0, 0.99, {})
    assert window.requests == 5 and window.mean_isl == 0.0  # no sizes until one finishes
    gw.metrics.in_flight.dec(5)  # all five finish in the next, and nothing new arrives
    gw.serve(5, prompt=100, output=20, ttft_s=0.1, itl_s=0.01)
    burst = build_window(quiet, parse_snapshot(gw.text()), 10.0, 0.99, {})
    assert burst.requests == 0 and burst.mean_isl == 100.0 and burst.mean_osl == 20.0
