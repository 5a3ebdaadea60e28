"""The worker's counters follow the engine's running totals (``services/worker_report.py``):
each scrape adds what a total grew by since the last one, so a counter never double-counts."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from pdserve.services.engine.outputs import EngineStats
from pdserve.services.worker_report import WorkerReport
from pdserve.shared.telemetry.metrics import WorkerMetrics
from tests.unit.test_metrics import parse


def test_each_counter_grows_by_what_its_engine_total_grew() -> None:
    registry = CollectorRegistry()
    stats = [EngineStats(total_blocks=8, free_blocks=8)]
    engine = SimpleNamespace(stats=lambda: stats[0])
    worker = SimpleNamespace(engine=engine, metrics=WorkerMetrics(registry, role="prefill"))
    report = WorkerReport(worker)  # type: ignore[arg-type]
    totals = dict(preemptions=2, late_prompts=3, prefix_queries=10, prefix_hits=6)
    for scale in (1, 1, 2):  # a scrape with nothing new adds nothing
        stats[0] = EngineStats(
            total_blocks=8, free_blocks=8, **{k: scale * v for k, v in totals.items()}
        )
        report.update_metrics()
    s = parse(generate_latest(registry).decode())
    role = (("role", "prefill"),)
    assert s[("pdserve_worker_preemptions_total", role)] == 4
    assert s[("pdserve_worker_late_prompts_total", role)] == 6
    assert s[("pdserve_worker_prefix_cache_queries_total", role)] == 20
    assert s[("pdserve_worker_prefix_cache_hits_total", role)] == 12
