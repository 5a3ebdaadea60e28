"""Where the engine's forward passes sit against this machine's two roofs (issue 34).

    python -m perf.roofline_bench                       # SmolLM2-135M-Instruct on this CPU
    python -m perf.roofline_bench --device cuda --random-shape llama-1b --reps 1 \\
        --json OUT/roofline_gpu.json --plot OUT/roofline_gpu.png    # a lent GPU (gpu_check.sh)

Workload: in-process ``LLMEngine``s (one rank, greedy, ``ignore_eos``, no prefix cache) on the
default model, SmolLM2-135M-Instruct in float32 on a CPU (``--random-shape NAME``: a random-weight
Llama of a realistic shape instead, bfloat16 on a GPU, written to a temp dir by the demo model's
writer):

- decode at batch B in ``--batches`` (1 4 16 64): B distinct random prompts of ``--prompt-len``
  (128) tokens are prefilled, then ``--warm-steps`` (4) decode steps go unmeasured and
  ``--steps`` (24) are measured, each of exactly B rows;
- the same with INT8 weights (``quantization int8``; CPU: fbgemm's dynamic INT8 GEMM, GPU:
  weight-only) at ``--int8-batches`` (1 4 16 64);
- a prefill of one prompt of 512, 1024 and 2048 tokens (``--prefill-lens``), one pass each.

A case's roofline is the sum of its measured passes' FLOPs and bytes (``StepStats``: counted
analytically from the model's shape, ``services/engine/step_cost.py``) over the sum of their wall
times, against the peaks. The cases run ``--reps`` (3) rounds, in turn within each round; the
achieved rates are the medians over rounds.

Peaks: ``shared/telemetry/peaks.py`` in full mode (``pdserve doctor``'s) at the engine's dtype and
torch thread count, measured in this run before and after the workload: both are reported, and
the roof of each kind is the higher of the two (a noisy neighbour can only lower a measurement).

Writes perf/results/roofline_bench.json and the roofline plot perf/results/roofline_cpu.png
(``perf/roofline_plot.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pdserve.services.engine.engine import LLMEngine
from pdserve.shared.config import EngineConfig
from pdserve.shared.sampling import SamplingParams
from pdserve.shared.telemetry import peaks as peaks_mod
from pdserve.shared.telemetry.roofline import Cost, Peaks, advice, roofline
from perf.llamacpp_bench import parse_overrides

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK = 16
WARM_PREFILL = 512  # the warm-up's prompt: first-call allocations, kernel choices

# Random-weight Llamas of a given shape (--random-shape): the demo model's tokenizer and defaults
# with these keys over them.
RANDOM_SHAPES: dict[str, dict] = {
    # Llama-3.2-1B: GQA 32/8 heads of 64, a 128k vocabulary on tied embeddings
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
    # Llama-3.2-3B
    "llama-3b": dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
    # small enough for a smoke test
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=1024,
    ),
}


@dataclass
class Case:
    name: str  # "decode b16 int8", "prefill 2048"
    phase: str  # "decode" or "prefill"
    weights: str  # "none" or "int8"
    batch: int  # rows per pass
    tokens: int  # tokens per pass (decode: the batch; prefill: the prompt)
    rounds: list[dict] = field(default_factory=list)  # per round: flops, bytes, seconds, steps
    result: dict = field(default_factory=dict)  # the medians against the roof


def write_random_model(out: Path, shape: str, dtype: str) -> Path:
    from pdserve.shared.models.demo import DEMO_CONFIG, write_demo_model

    config = {**DEMO_CONFIG, **RANDOM_SHAPES[shape], "torch_dtype": dtype}
    write_demo_model(out, config=config)
    return out


def make_engine(model: Path, args: argparse.Namespace, dtype: str, quant: str) -> LLMEngine:
    most = max([*args.batches, *args.int8_batches, 1])
    per_seq = -(-(args.prompt_len + args.warm_steps + args.steps + 2) // BLOCK)
    blocks = max(most * per_seq, -(-max([*args.prefill_lens, WARM_PREFILL]) // BLOCK)) + 8
    config = EngineConfig(
        model=str(model),
        device=args.device,
        dtype=dtype,
        quantization=quant,
        block_size=BLOCK,
        num_kv_blocks=blocks,
        max_num_seqs=most,
        max_num_batched_tokens=max([*args.prefill_lens, 2048]),
        prefix_cache=False,
        enforce_eager=args.enforce_eager,
    )
    return LLMEngine(dataclasses.replace(config, **parse_overrides(args.pdserve_arg)))


def prompts(rng: random.Random, vocab: int, count: int, length: int) -> list[list[int]]:
    # ids above the tokenizer's special tokens and below the vocabulary's end
    lo = 300 if vocab > 600 else 3
    return [[rng.randrange(lo, vocab) for _ in range(length)] for _ in range(count)]


def run_case(
    eng: LLMEngine, case: Case, args: argparse.Namespace, rng: random.Random, tag: str
) -> dict:
    """One round of ``case``: its measured passes' sums."""
    vocab = eng.model_config.vocab_size
    if case.phase == "decode":
        sp = SamplingParams(
            temperature=0.0, max_tokens=args.warm_steps + args.steps + 1, ignore_eos=True
        )
        batch = prompts(rng, vocab, case.batch, args.prompt_len)
    else:
        sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        batch = prompts(rng, vocab, 1, case.tokens)
    for i, prompt in enumerate(batch):
        eng.add_request(f"{tag}-{i}", prompt, sp)
    steps: list[tuple[float, float, float]] = []
    decodes = 0
    while eng.has_unfinished():
        r = eng.step()
        if r is None or not r.stats.num_seqs:
            continue
        s = r.stats
        if case.phase == "prefill" and s.phase == "prefill":
            steps.append((s.flops, s.bytes, s.seconds))
        elif case.phase == "decode" and s.phase == "decode" and s.num_seqs == case.batch:
            decodes += 1
            if decodes > args.warm_steps:
                steps.append((s.flops, s.bytes, s.seconds))
    flops, moved, seconds = (sum(x[k] for x in steps) for k in range(3))
    return {"flops": flops, "bytes": moved, "seconds": seconds, "steps": len(steps)}


def summarise(case: Case, roof: Peaks) -> dict:
    """The medians over rounds, against ``roof``."""
    ok = [r for r in case.rounds if r["seconds"] > 0]
    if not ok:
        return {}
    flops_s = statistics.median(r["flops"] / r["seconds"] for r in ok)
    bytes_s = statistics.median(r["bytes"] / r["seconds"] for r in ok)
    step_s = statistics.median(r["seconds"] / r["steps"] for r in ok)
    r0 = ok[0]  # every round computes and moves the same (its contexts are the same lengths)
    rl = roofline(Cost(r0["flops"], r0["bytes"]), r0["flops"] / flops_s, roof)
    return {
        "intensity": rl.intensity,
        "flops_per_s": flops_s,
        "bytes_per_s": bytes_s,
        "compute_fraction": flops_s / roof.flops_per_s,
        "bandwidth_fraction": bytes_s / roof.bytes_per_s,
        "bound": rl.bound,
        "ms_per_pass": 1e3 * step_s,
        "tokens_per_s": case.tokens / step_s,
        "passes_per_round": r0["steps"],
        "advice": advice(case.phase, rl),
    }


def measure_peaks(device: str, dtype: str, threads: int, quick: bool) -> dict:
    plan = peaks_mod.plan_for(device, quick)
    found, detail = peaks_mod.measure_with(device, dtype, threads, plan)
    return {
        **asdict(found),
        **detail,
        "ridge": found.ridge,
        "quick": quick,
        "loadavg": os.getloadavg()[0],
    }


def the_roof(before: dict, after: dict) -> Peaks:
    """Each roof the higher of its two measurements."""
    return Peaks(
        max(before["flops_per_s"], after["flops_per_s"]),
        max(before["bytes_per_s"], after["bytes_per_s"]),
        before["device"],
        before["dtype"],
        before["threads"],
        after["measured_at"],
    )


def print_table(cases: list[Case], roof: Peaks) -> None:
    print(
        f"\nroof: {roof.flops_per_s / 1e9:,.1f} GFLOP/s ({roof.dtype}), "
        f"{roof.bytes_per_s / 1e9:,.1f} GB/s read, ridge {roof.ridge:.1f} FLOP/B"
    )
    print(
        f"{'case':18s} {'FLOP/B':>8s} {'GFLOP/s':>9s} {'of peak':>8s} {'GB/s':>7s} "
        f"{'of peak':>8s} {'bound':>7s} {'ms/pass':>8s} {'tok/s':>8s}"
    )
    for c in cases:
        r = c.result
        if "intensity" not in r:
            print(f"{c.name:18s} {r.get('error', '(no measured pass)')}")
            continue
        print(
            f"{c.name:18s} {r['intensity']:8.1f} {r['flops_per_s'] / 1e9:9.1f} "
            f"{r['compute_fraction']:8.1%} {r['bytes_per_s'] / 1e9:7.2f} "
            f"{r['bandwidth_fraction']:8.1%} {r['bound']:>7s} {r['ms_per_pass']:8.2f} "
            f"{r['tokens_per_s']:8.1f}"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument(
        "--random-shape",
        choices=sorted(RANDOM_SHAPES),
        default=None,
        help="a random-weight Llama of this shape instead of --model",
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's own)")
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--int8-batches", nargs="*", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--prefill-lens", nargs="*", type=int, default=[512, 1024, 2048])
    ap.add_argument("--prompt-len", type=int, default=128, help="decode cases' prompts")
    ap.add_argument("--warm-steps", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24, help="measured decode steps per round")
    ap.add_argument("--reps", type=int, default=3, help="rounds over all cases")
    ap.add_argument(
        "--enforce-eager",
        action="store_true",
        help="eager decode steps (the default compiles them on a CPU)",
    )
    ap.add_argument(
        "--pdserve-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an EngineConfig field for every engine, e.g. cpu_packed_gemm=false",
    )
    ap.add_argument("--quick-peaks", action="store_true", help="quick peaks (tests only)")
    ap.add_argument("--json", type=Path, default=RESULTS / "roofline_bench.json")
    ap.add_argument("--plot", type=Path, default=RESULTS / "roofline_cpu.png")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    started = time.time()
    cuda = args.device.startswith("cuda")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    threads = 0 if cuda else torch.get_num_threads()
    dtype = "bfloat16" if cuda else "float32"
    tmp = tempfile.TemporaryDirectory(prefix="roofline-")
    if args.random_shape:
        model = write_random_model(Path(tmp.name), args.random_shape, dtype)
        name = f"random-weight {args.random_shape} shape"
        print(f"{name} written ({time.time() - started:.0f} s)", flush=True)
    else:
        from pdserve.shared.models.resolve import resolve

        model, name = resolve(args.model).path, args.model
    print(
        f"{name} on {args.device}"
        + (f", {threads} threads" if threads else "")
        + f"; measuring the peaks ({'quick' if args.quick_peaks else 'full'})...",
        flush=True,
    )
    report: dict = {
        "model": name,
        "machine": {
            "threads": threads,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "workload": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
    }
    before = measure_peaks(args.device, dtype, threads, args.quick_peaks)
    report["machine"]["device"] = before["device"]
    report["peaks"] = {
        "before": before,
        "after": None,
        "roof": None,
        "rule": "each roof is the higher of its measurements before and after",
    }
    cases = [Case(f"decode b{b}", "decode", "none", b, b) for b in args.batches]
    cases += [Case(f"decode b{b} int8", "decode", "int8", b, b) for b in args.int8_batches]
    cases += [Case(f"prefill {n}", "prefill", "none", 1, n) for n in args.prefill_lens]
    failed = run_all(model, args, dtype, cases, report, started)
    tmp.cleanup()
    after = measure_peaks(args.device, dtype, threads, args.quick_peaks)
    roof = the_roof(before, after)
    for case in cases:
        if case.name not in failed:
            case.result = summarise(case, roof)
    print_table(cases, roof)
    report["peaks"] |= {"after": after, "roof": {**asdict(roof), "ridge": roof.ridge}}
    write_report(report, cases, args.json, started)
    print(f"json: {args.json}")
    try:  # a bare GPU machine may lack matplotlib: the JSON is what counts there
        from perf.roofline_plot import plot
    except ImportError as exc:
        print(f"plot skipped ({exc}): python -m perf.roofline_plot {args.json} PNG renders it")
    else:
        plot(report, args.plot)
        print(f"plot: {args.plot}")
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")
    return report


def run_all(
    model: Path,
    args: argparse.Namespace,
    dtype: str,
    cases: list[Case],
    report: dict,
    started: float,
) -> list[str]:
    """Every case, ``--reps`` rounds; the JSON rewritten after each case (a run cut short by a
    timeout, as on a lent GPU, keeps its rounds' raw sums). The names of the cases that failed."""
    weights = list(dict.fromkeys(c.weights for c in cases))
    engines = {q: make_engine(model, args, dtype, q) for q in weights}
    report["weight_bytes_read_per_pass"] = {
        q: e.step_cost.model.storage.layer_weight_bytes + e.step_cost.model.storage.lm_head_bytes
        for q, e in engines.items()
    }
    failed: list[str] = []
    rng = random.Random(0)
    try:
        for q, eng in engines.items():  # warm-up: first-call allocations, kernel choices
            run_case(eng, Case("warm", "decode", q, 2, 2), args, rng, f"warm-{q}")
            run_case(eng, Case("warm", "prefill", q, 1, WARM_PREFILL), args, rng, f"warm-p-{q}")
        print(f"engines ready ({time.time() - started:.0f} s)", flush=True)
        for rep in range(args.reps):
            for case in (c for c in cases if c.name not in failed):
                tag = f"{case.name}-{rep}".replace(" ", "-")
                t0 = time.perf_counter()
                try:
                    case.rounds.append(run_case(engines[case.weights], case, args, rng, tag))
                except Exception as exc:  # one broken case must not cost the others' figures
                    print(f"  {case.name}: FAILED: {exc!r}", flush=True)
                    case.result = {"error": repr(exc)}
                    failed.append(case.name)
                if rep == 0:  # how long each case takes here, to size --reps and --steps
                    print(f"  {case.name}: {time.perf_counter() - t0:.1f} s", flush=True)
                write_report(report, cases, args.json, started)
            print(f"round {rep + 1}/{args.reps} done ({time.time() - started:.0f} s)", flush=True)
    finally:
        for eng in engines.values():
            eng.close()
    return failed


def write_report(report: dict, cases: list[Case], path: Path, started: float) -> None:
    report |= {"cases": [asdict(c) for c in cases], "seconds": round(time.time() - started, 1)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
