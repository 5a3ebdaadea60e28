"""A benchmark's result as data: one ``RunResult`` per measured run (a sweep has one per request
rate; the scenario harness puts several labelled series side by side), its JSON document and
one JSONL line per request, and the two read back into runs. Rendering them (markdown, plots)
is ``report``."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdserve.services.control.bench.client import RequestRecord
from pdserve.services.control.bench.metrics import BenchMetrics, request_tpot


@dataclass
class RunResult:
    series: str  # which system or configuration ("pdserve", "disaggregated 1P1D", ...)
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    metrics: BenchMetrics
    records: list[RequestRecord] = field(default_factory=list)

    @property
    def rate_label(self) -> str:
        return "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"


def jsonable(value: Any) -> Any:
    """Standard JSON has no Infinity/NaN; write them as strings so any parser reads the file."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def result_document(
    runs: Sequence[RunResult],
    config: dict[str, Any],
    summary: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything but the per-request records (those go to a JSONL file beside it)."""
    doc_runs = [
        {
            "series": run.series,
            "request_rate": run.request_rate,
            "burstiness": run.burstiness,
            "max_concurrency": run.max_concurrency,
            "metrics": run.metrics.to_dict(),
            "vllm": run.metrics.vllm_flat(),
        }
        for run in runs
    ]
    return jsonable({"config": config, "summary": summary or {}, "runs": doc_runs})


def record_lines(runs: Sequence[RunResult]) -> Iterator[str]:
    """One compact JSON object per request, tagged with its run; times rounded to 1 us."""
    for i, run in enumerate(runs):
        for r in run.records:
            row = asdict(r)
            for key in ("start_time", "ttft", "latency"):
                row[key] = round(row[key], 6)
            row["itl"] = [round(gap, 6) for gap in r.itl]
            row |= {"run": i, "series": run.series, "request_rate": run.request_rate}
            row |= {"output_tokens": r.output_tokens, "tpot": request_tpot(r)}
            yield json.dumps(jsonable(row), separators=(",", ":"), allow_nan=False)


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.write_text(json.dumps(document, indent=1, allow_nan=False) + "\n")


def load_runs(json_path: Path) -> tuple[list[RunResult], dict[str, Any]]:
    """Runs back from <name>.json and its <name>.records.jsonl (if written), so a saved result
    can be re-plotted, or merged with another, without a rerun."""
    doc = json.loads(json_path.read_text())
    records: dict[int, list[RequestRecord]] = {}
    jsonl = json_path.with_suffix(".records.jsonl")
    if jsonl.exists():
        fields = set(RequestRecord.__dataclass_fields__)
        for line in jsonl.read_text().splitlines():
            row = json.loads(line)
            records.setdefault(row["run"], []).append(
                RequestRecord(**{k: v for k, v in row.items() if k in fields})
            )
    runs = []
    for i, entry in enumerate(doc["runs"]):
        metrics = BenchMetrics.from_dict(entry["metrics"])
        recs = records.get(i, [])
        rate, conc = float(entry["request_rate"]), entry["max_concurrency"]
        runs.append(
            RunResult(
                series=entry["series"],
                request_rate=rate,
                burstiness=entry["burstiness"],
                max_concurrency=conc,
                metrics=metrics,
                records=recs,
            )
        )
    return runs, doc
