"""Tensor parallelism on CPU (issue 28): TP 2 with one torch thread per rank against TP 1 with two
threads, in-process, side by side in one run; and the KV bytes each decode rank pulls between TP
layouts.

Decode: a fixed prompt set (``--prompts`` windows of ``--prompt-tokens`` tokens cut from
``perf/spec_workloads.py``'s texts), greedy, ``ignore_eos``, ``--max-tokens`` output tokens each,
prefix cache off. Batch 1 serves ``--batch1-prompts`` prompts one after another; batch N serves
the first N prompts at once. Only decode steps are timed: the bench steps the engine itself
(``engine.step()``) and counts the tokens and seconds of the steps that prefilled nothing. Both
engines are built up front and the modes alternate within each of ``--reps`` repetitions (the
order flips every repetition); reported: the median tok/s per mode, TP2/TP1, and TP 2 with the
whole LM head on rank 0 (``--tp-lm-head replicated``) against the vocab-parallel head. At TP 2
it also reports rank 0's time in all-reduces (``Shard.reduce_seconds``) per decode step, per
call, and as a share of the step. The engines share this process, so the bench sets torch's
threads to each mode's own before running it; with ``torch_threads`` fixed, no rank is pinned.

A model whose heads TP 2 cannot split (SmolLM2-135M: 9 query, 3 KV heads) runs *re-headed*: the
same weights and config but its query and KV widths cut into heads of another size (SmolLM2:
12 and 4 heads of 48 instead of 9 and 3 of 64), so every GEMM, the attention's work and the KV
bytes per token stay the same; the text it writes is noise, which greedy ``ignore_eos`` decode
does not mind. The JSON and the table say when this happened.

KV: for ``--kv-tokens`` prompts, the bytes each decode rank pulls at prefill -> decode TP 2 -> 1,
1 -> 2, 2 -> 2 and 1 -> 1, computed (``tp_layout.pull_plan``, bytes per block per KV head) and
measured over real UCX on loopback: a ``KVServer`` per prefill rank, a ``KVClient`` per decode
rank, every rank's pieces pulled at once as ``services/decode/rank_pull.py`` does, after a
warm-up pull; all ranks share one event loop here. Reported: bytes per decode rank, the median
wall time of each rank's pull and of the whole pull.

    python -m perf.tp_bench [--model smollm2-135m-instruct] [--reps 3] [--tag TAG] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pdserve.services.engine.engine import LLMEngine
from pdserve.services.engine.model_config import ModelConfig
from pdserve.services.engine.model_setup import kv_parts
from pdserve.services.engine.quant.kv_cache import kv_cache_spec
from pdserve.shared.bus.lease_messages import KVHandle
from pdserve.shared.config import EngineConfig
from pdserve.shared.kv.tp_layout import TP_KEY, kv_head_range, pull_plan, tp_problem
from pdserve.shared.kv.transfer import KVClient, KVServer, LeaseTable
from pdserve.shared.sampling import SamplingParams
from perf import spec_workloads

# name -> (tp, torch threads, --tp-lm-head); the third is TP 2 with the whole head on rank 0
MODES = {
    "TP 1 x 2 threads": (1, 2, "vocab"),
    "TP 2 x 1 thread": (2, 1, "vocab"),
    "TP 2, head on rank 0": (2, 1, "replicated"),
}
KV_PAIRS = [(2, 1), (1, 2), (2, 2), (1, 1)]  # (prefill TP, decode TP)
BLOCK = 16  # tokens per KV block (the engine's default)
RESULTS = Path(__file__).resolve().parent / "results"


def reheaded(model_dir: Path, tp: int, out: Path) -> tuple[Path, str | None]:
    """``model_dir`` itself if TP ``tp`` can split its heads, else a copy (symlinked weights)
    whose query and KV widths are cut into heads of the size nearest its own that TP ``tp``
    can split; and a note saying which."""
    cfg = ModelConfig.from_dir(model_dir)
    if tp_problem(cfg.num_heads, cfg.num_kv_heads, tp) is None:
        return model_dir, None
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    dims = [d for d in range(2, kv + 1, 2) if q % d == 0 and kv % d == 0]
    dims = [d for d in dims if tp_problem(q // d, kv // d, tp) is None]
    if not dims:
        raise SystemExit(f"{model_dir}: no head size lets TP {tp} split its heads")
    dim = min(dims, key=lambda d: (abs(d - cfg.head_dim), -d))
    for f in model_dir.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    raw = json.loads((model_dir / "config.json").read_text())
    raw.update(num_attention_heads=q // dim, num_key_value_heads=kv // dim, head_dim=dim)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    note = (
        f"re-headed for TP {tp}: {cfg.num_heads} query / {cfg.num_kv_heads} KV heads of "
        f"{cfg.head_dim} cut into {q // dim} / {kv // dim} heads of {dim} (same weights, "
        "GEMMs and KV bytes; noise text)"
    )
    return out, note


def prompt_set(model_dir: Path, count: int, length: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens, at different offsets of one stream of text."""
    from pdserve.gateway.tokenizer import ModelTokenizer

    tok = ModelTokenizer.from_dir(model_dir)
    text = "\n\n".join([*spec_workloads.PARAGRAPHS, *spec_workloads.CODE])
    stream = tok.encode(text, add_special_tokens=False)
    while len(stream) < length + 7 * count:
        stream += stream
    return [stream[7 * i : 7 * i + length] for i in range(count)]


# ---- decode -------------------------------------------------------------------------------------


@dataclass
class Run:
    """The decode steps of one mode's pass over a case (prefill steps left out)."""

    seconds: float = 0.0
    tokens: int = 0
    steps: int = 0
    reduce_seconds: float = 0.0
    reduce_calls: int = 0


def serve(engine: LLMEngine, prompts: list[list[int]], sp: SamplingParams, run: Run) -> None:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"tp-{time.monotonic_ns()}-{i}", prompt, sp)
    shard = engine.shard
    while engine.has_unfinished():
        r0, c0 = shard.reduce_seconds, shard.reduce_calls
        t0 = time.perf_counter()
        result = engine.step()
        dt = time.perf_counter() - t0
        if result is None or not result.stats.num_seqs or result.stats.prefill_seqs:
            continue
        run.seconds += dt
        run.tokens += sum(len(o.new_token_ids) for o in result.outputs)
        run.steps += 1
        run.reduce_seconds += shard.reduce_seconds - r0
        run.reduce_calls += shard.reduce_calls - c0


@dataclass
class ModeResult:
    median_tok_s: float
    tok_s: list[float]
    tokens: int
    steps: int
    step_ms: float  # median decode step
    reduce_ms_per_step: float | None = None
    reduce_us_per_call: float | None = None
    reduce_calls_per_step: float | None = None
    reduce_share: float | None = None  # of the decode steps' time


@dataclass
class CaseResult:
    batch: int
    prompts: int
    modes: dict[str, ModeResult]
    tp2_over_tp1: float = 0.0
    replicated_over_vocab: float = 0.0  # TP 2 tok/s, whole head on rank 0 / vocab-parallel


def measure(
    engines: dict[str, LLMEngine],
    prompts: list[list[int]],
    batch: int,
    sp: SamplingParams,
    reps: int,
) -> CaseResult:
    runs: dict[str, list[Run]] = {m: [] for m in engines}
    names = list(engines)
    for rep in range(reps):
        for mode in names if rep % 2 == 0 else names[::-1]:
            torch.set_num_threads(MODES[mode][1])
            run = Run()
            for i in range(0, len(prompts), batch):
                serve(engines[mode], prompts[i : i + batch], sp, run)
            runs[mode].append(run)
    modes = {}
    for mode, rs in runs.items():
        rate = [r.tokens / r.seconds for r in rs]
        med = rs[_median_index(rate)]  # the repetition the breakdown is taken from
        res = ModeResult(
            round(statistics.median(rate), 2),
            [round(x, 2) for x in rate],
            med.tokens,
            med.steps,
            round(1000 * med.seconds / med.steps, 3),
        )
        if med.reduce_calls:
            res.reduce_ms_per_step = round(1000 * med.reduce_seconds / med.steps, 3)
            res.reduce_us_per_call = round(1e6 * med.reduce_seconds / med.reduce_calls, 1)
            res.reduce_calls_per_step = med.reduce_calls / med.steps
            res.reduce_share = round(med.reduce_seconds / med.seconds, 3)
        modes[mode] = res
    one, two, whole = (modes[m].median_tok_s for m in MODES)
    return CaseResult(batch, len(prompts), modes, round(two / one, 3), round(whole / two, 3))


def _median_index(values: list[float]) -> int:
    """The repetition at the median (the lower middle one of an even count)."""
    order = sorted(range(len(values)), key=values.__getitem__)
    return order[(len(order) - 1) // 2]


# ---- KV pulls between TP layouts -----------------------------------------------------------------


@dataclass
class KVCase:
    tokens: int
    prefill_tp: int
    decode_tp: int
    blocks: int
    computed_bytes: list[int]  # per decode rank, from pull_plan and the cache's geometry
    pieces: list[int]  # per decode rank
    measured_bytes: list[int] = field(default_factory=list)
    rank_ms: list[float] = field(default_factory=list)  # median wall of each rank's pull
    pull_ms: float = 0.0  # median wall of the whole pull (all ranks at once)
    pull_ms_all: list[float] = field(default_factory=list)


def computed(cfg: ModelConfig, block_size: int, tokens: int, ptp: int, dtp: int) -> KVCase:
    per_head = kv_cache_spec(
        "auto", torch.float32, cfg.num_layers, block_size, 1, cfg.head_dim
    ).bytes_per_block
    blocks = -(-tokens // block_size)
    plans = [pull_plan(cfg.num_kv_heads, ptp, dtp, r) for r in range(dtp)]
    moved = [blocks * per_head * sum(p.hi - p.lo for p in plan) for plan in plans]
    return KVCase(tokens, ptp, dtp, blocks, moved, [len(plan) for plan in plans])


async def pull_between(cfg: ModelConfig, block_size: int, case: KVCase, reps: int) -> None:
    """Measure ``case`` over UCX: fills measured_bytes, rank_ms and pull_ms."""
    heads, n = cfg.num_kv_heads, case.blocks

    def spec(h: int):
        return kv_cache_spec("auto", torch.float32, cfg.num_layers, block_size, h, cfg.head_dim)

    def fp(tp: int) -> dict:
        return {
            "model": "tp_bench",
            "dtype": "float32",
            "block_size": block_size,
            "num_layers": cfg.num_layers,
            "num_kv_heads": heads,
            "head_dim": cfg.head_dim,
            TP_KEY: tp,
            **spec(heads).fingerprint(),
        }

    full = torch.randn(spec(heads).allocate(n, torch.device("cpu")).shape)
    servers, tables = [], []
    for r in range(case.prefill_tp):
        lo, hi = kv_head_range(heads, case.prefill_tp, r)
        table = LeaseTable(lambda _rid: None)
        cache = full[:, :, :, :, lo:hi].contiguous()
        servers.append(
            KVServer(
                cache, fp(case.prefill_tp), table, heads=(lo, hi), split=kv_parts(spec(hi - lo))
            )
        )
        tables.append(table)
    clients = []
    for r in range(case.decode_tp):
        lo, hi = kv_head_range(heads, case.decode_tp, r)
        cache = spec(hi - lo).allocate(n, torch.device("cpu"))
        clients.append(
            KVClient(
                cache, fp(case.decode_tp), block_size, heads=(lo, hi), split=kv_parts(spec(hi - lo))
            )
        )
    for server in servers:
        await server.start()
    try:
        blocks = list(range(n))
        first = tables[0].add("r1", blocks, case.tokens, 600.0)
        for table in tables[1:]:
            table.add("r1", blocks, case.tokens, 600.0).token = first.token
        handle = KVHandle(
            "prefill-0",
            servers[0].address,
            blocks,
            case.tokens,
            fp(case.prefill_tp),
            first.expires,
            first.token,
        )

        async def rank_pull(r: int) -> tuple[int, float]:
            t0 = time.perf_counter()
            stats = await asyncio.gather(
                *(
                    clients[r].pull(
                        "r1",
                        handle,
                        blocks,
                        address=servers[p.prefill_rank].address,
                        heads=(p.lo, p.hi),
                    )
                    for p in pull_plan(heads, case.prefill_tp, case.decode_tp, r)
                )
            )
            return sum(s.num_bytes for s in stats), time.perf_counter() - t0

        rank_s: list[list[float]] = [[] for _ in clients]
        for rep in range(reps + 1):  # the first sets up the endpoints: not counted
            t0 = time.perf_counter()
            done = await asyncio.gather(*(rank_pull(r) for r in range(len(clients))))
            wall = time.perf_counter() - t0
            if rep:
                case.pull_ms_all.append(round(1000 * wall, 3))
                for r, (_, s) in enumerate(done):
                    rank_s[r].append(s)
        case.measured_bytes = [b for b, _ in done]
        case.rank_ms = [round(1000 * statistics.median(s), 3) for s in rank_s]
        case.pull_ms = round(statistics.median(case.pull_ms_all), 3)
        for r, client in enumerate(clients):  # every rank got exactly its heads
            lo, hi = client.slicer.heads
            assert torch.equal(client.kv_cache, full[:, :, :, :, lo:hi]), (case, r)
    finally:
        for client in clients:
            await client.close()
        for server in servers:
            await server.stop()


async def pull_all(cfg: ModelConfig, cases: list[KVCase], reps: int) -> None:
    for case in cases:  # one event loop for all: UCX's progress driver stays on it
        await pull_between(cfg, BLOCK, case, reps)


# ---- report -------------------------------------------------------------------------------------


def print_decode(results: list[CaseResult]) -> None:
    one, two, whole = MODES
    print(
        f"\n| batch | {one} tok/s | {two} tok/s | TP2/TP1 | {whole} tok/s | head on rank 0 / "
        "vocab-parallel | step ms (TP1 / TP2) | all-reduce per step | per call | calls/step "
        "| share of step |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in results:
        a, b, w = c.modes[one], c.modes[two], c.modes[whole]
        print(
            f"| {c.batch} | {a.median_tok_s:.1f} | {b.median_tok_s:.1f} | "
            f"**{c.tp2_over_tp1:.2f}x** | {w.median_tok_s:.1f} | {c.replicated_over_vocab:.2f}x "
            f"| {a.step_ms:.2f} / {b.step_ms:.2f} | "
            f"{b.reduce_ms_per_step:.2f} ms | {b.reduce_us_per_call:.0f} us | "
            f"{b.reduce_calls_per_step:.0f} | {100 * b.reduce_share:.0f}% |"
        )


def print_kv(cases: list[KVCase]) -> None:
    print(
        "\n| prompt tokens | prefill TP -> decode TP | blocks | bytes per decode rank, computed "
        "| measured | pieces per rank | pull wall per rank | whole pull |"
    )
    print("|---:|---|---:|---|---|---|---|---:|")
    for c in cases:
        kib = " / ".join(f"{b / 1024:.0f} KiB" for b in c.computed_bytes)
        got = " / ".join(f"{b / 1024:.0f} KiB" for b in c.measured_bytes) or "-"
        ms = " / ".join(f"{x:.2f} ms" for x in c.rank_ms) or "-"
        print(
            f"| {c.tokens} | {c.prefill_tp} -> {c.decode_tp} | {c.blocks} | {kib} | {got} | "
            f"{' / '.join(map(str, c.pieces))} | {ms} | {c.pull_ms:.2f} ms |"
        )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--batch1-prompts", type=int, default=4, help="prompts served one by one")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kv-tokens", nargs="+", type=int, default=[64, 1024])
    ap.add_argument("--kv-reps", type=int, default=5)
    ap.add_argument("--tag", default="issue28", help="writes perf/results/tp_bench_TAG.json")
    ap.add_argument("--json", type=Path, help="write the results here instead")
    args = ap.parse_args(argv)
    from pdserve.shared.models.resolve import resolve

    tmp = tempfile.TemporaryDirectory(prefix="tp_bench-")
    model_dir, note = reheaded(resolve(args.model).path, 2, Path(tmp.name))
    cfg = ModelConfig.from_dir(model_dir)
    count = max([*args.batches, args.batch1_prompts])
    prompts = prompt_set(model_dir, count, args.prompt_tokens)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    per_seq = -(-(args.prompt_tokens + args.max_tokens) // BLOCK)
    engines = {
        mode: LLMEngine(
            EngineConfig(
                model=str(model_dir),
                dtype="float32",
                block_size=BLOCK,
                tensor_parallel_size=tp,
                torch_threads=threads,
                tp_lm_head=head,
                num_kv_blocks=per_seq * count + 16,
                max_num_seqs=max(args.batches),
                prefix_cache=False,
            )
        )
        for mode, (tp, threads, head) in MODES.items()
    }
    report: dict = {"model": args.model, "note": note, "model_config": asdict(cfg)}
    try:
        for mode, engine in engines.items():  # warm-up: first-call allocations
            torch.set_num_threads(MODES[mode][1])
            serve(engine, prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), Run())
        print(
            f"{args.model}{' (' + note + ')' if note else ''}; {args.reps} reps; prompts of "
            f"{args.prompt_tokens} tokens, {args.max_tokens} output tokens (greedy, "
            "ignore_eos); decode steps only",
            flush=True,
        )
        results = []
        for batch in args.batches:
            chosen = prompts[: args.batch1_prompts] if batch == 1 else prompts[:batch]
            results.append(measure(engines, chosen, batch, sp, args.reps))
            print(
                f"batch {batch}: "
                + ", ".join(
                    f"{m} {r.median_tok_s:.1f} tok/s" for m, r in results[-1].modes.items()
                ),
                flush=True,
            )
    finally:
        for engine in engines.values():
            engine.close()
    kv = [computed(cfg, BLOCK, t, ptp, dtp) for t in args.kv_tokens for ptp, dtp in KV_PAIRS]
    asyncio.run(pull_all(cfg, kv, args.kv_reps))
    tmp.cleanup()
    print_decode(results)
    print_kv(kv)
    report.update(
        workload={k: v for k, v in vars(args).items() if k not in ("json", "tag")},
        modes={
            m: {"tensor_parallel_size": tp, "torch_threads": t, "tp_lm_head": h}
            for m, (tp, t, h) in MODES.items()
        },
        decode=[asdict(r) for r in results],
        kv=[asdict(c) for c in kv],
    )
    out = args.json or RESULTS / f"tp_bench_{args.tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
