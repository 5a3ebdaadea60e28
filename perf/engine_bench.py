"""In-process engine (continuous batching) vs HF transformers generate (static batches of 8, left
padding) on the same weights and workload. Prints output tokens/s of both, their ratio, and the
engine's peak KV slot utilisation (live tokens / allocated slots).

It also prints the machine's ceiling for that ratio, measured in the same run: the time the
workload's matrix multiplies alone need at the GEMM throughput this CPU reaches on the model's
weight shapes (prefill-sized and decode-sized), ignoring attention, memory traffic and every
other cost. No engine can beat HF by more than HF's time over that bound.

    python -m perf.engine_bench [--requests 48] [--json perf/results/engine_bench.json]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pdserve.services.engine.engine import LLMEngine
from pdserve.shared.config import EngineConfig
from pdserve.shared.sampling import SamplingParams


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class Result:
    requests: int
    output_tokens: int
    hf_seconds: float
    engine_seconds: float
    hf_tokens_per_s: float
    engine_tokens_per_s: float
    speedup: float
    peak_kv_utilisation: float
    threads: int
    gemm_bound_seconds: float = 0.0
    ceiling_speedup: float = 0.0
    model: str = ""
    batch1: BatchOne | None = None


BATCH1_PROMPT = 16
BATCH1_OUTPUT = 128


@dataclass
class BatchOne:
    """One request alone: decode speed where nothing can be batched (memory-bound)."""

    hf_tokens_per_s: float
    engine_tokens_per_s: float
    speedup: float


def batch_one(model_dir: Path, vocab: int) -> BatchOne:
    wl = make_workload(1, vocab, seed=1)
    wl = Workload([wl.prompts[0][:BATCH1_PROMPT]], [BATCH1_OUTPUT])
    run_engine(model_dir, wl)  # warm-up: first-call allocations and kernel choices
    engine_s, _ = run_engine(model_dir, wl)
    hf_s = run_hf(model_dir, wl, batch_size=1)
    return BatchOne(
        round(BATCH1_OUTPUT / hf_s, 1),
        round(BATCH1_OUTPUT / engine_s, 1),
        round(hf_s / engine_s, 2),
    )


@dataclass
class GemmBound:
    """The least time the workload's GEMMs take here; see ``gemm_bound``."""

    prefill_gflop: float
    decode_gflop: float
    prefill_gflops_per_s: float
    decode_gflops_per_s: float
    decode_batch: int

    @property
    def seconds(self) -> float:
        return (
            self.prefill_gflop / self.prefill_gflops_per_s
            + self.decode_gflop / self.decode_gflops_per_s
        )


@dataclass
class Shape:
    """The matrix sizes of a Llama (SwiGLU MLP, GQA attention)."""

    layers: int
    hidden: int
    vocab: int
    inter: int
    kv_dim: int  # kv heads * head dim

    @classmethod
    def of(cls, model_dir: Path) -> Shape:
        cfg = json.loads((model_dir / "config.json").read_text())
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        return cls(
            cfg["num_hidden_layers"],
            cfg["hidden_size"],
            cfg["vocab_size"],
            cfg["intermediate_size"],
            cfg.get("num_key_value_heads", heads) * head_dim,
        )


def weight_shapes(shape: Shape) -> list[tuple[int, int, int]]:
    """(in, out, count) of every matrix a token goes through, lm_head last."""
    h, inter = shape.hidden, shape.inter
    per_layer = [(h, h + 2 * shape.kv_dim), (h, h), (h, 2 * inter), (inter, h)]
    return [(i, o, shape.layers) for i, o in per_layer] + [(h, shape.vocab, 1)]


def gemm_rate(shapes: list[tuple[int, int, int]], rows: int, reps: int = 5) -> float:
    """GFLOP/s of ``rows x in @ in x out`` over ``shapes`` (weighted by FLOPs), best of reps."""
    flops, seconds = 0.0, 0.0
    for k, n, _ in shapes:
        a, b = torch.randn(rows, k), torch.randn(k, n)
        a @ b  # warm-up
        best = min(_timed_mm(a, b) for _ in range(reps))
        flops += 2 * rows * k * n
        seconds += best
    return flops / seconds / 1e9


def _timed_mm(a: torch.Tensor, b: torch.Tensor) -> float:
    start = time.perf_counter()
    a @ b
    return time.perf_counter() - start


def gemm_bound(wl: Workload, shape: Shape, chunk: int) -> GemmBound:
    """Prefill: every prompt token through every layer, lm_head once per prompt (the first
    token); decode: every further output token through everything. Attention is left out."""
    shapes = weight_shapes(shape)
    body, head = shapes[:-1], shapes[-1:]
    per_token = sum(2 * i * o * c for i, o, c in body) / 1e9
    head_gflop = 2 * shape.hidden * shape.vocab / 1e9
    prompt_tokens = sum(map(len, wl.prompts))
    decode_tokens = wl.output_tokens - len(wl.prompts)
    # continuous batching: on average this many sequences share a decode step
    steps = max(wl.output_lens) - 1
    batch = max(1, round(decode_tokens / steps))
    return GemmBound(
        prefill_gflop=prompt_tokens * per_token + len(wl.prompts) * head_gflop,
        decode_gflop=decode_tokens * (per_token + head_gflop),
        prefill_gflops_per_s=gemm_rate(body, chunk),
        decode_gflops_per_s=gemm_rate(body + head, batch),
        decode_batch=batch,
    )


def make_model(out: Path, layers: int, hidden: int, vocab: int) -> Path:
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


def make_workload(n: int, vocab: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(16, 384))] for _ in range(n)]
    return Workload(prompts, [rng.randint(16, 128) for _ in range(n)])


def run_hf(model_dir: Path, wl: Workload, batch_size: int = 8) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(wl.prompts), batch_size):
            prompts = wl.prompts[i : i + batch_size]
            width = max(map(len, prompts))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            # a static batch runs until its longest request is done; eos disabled (ignore_eos)
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(wl.output_lens[i : i + batch_size]),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
    return time.perf_counter() - start


def run_engine(model_dir: Path, wl: Workload) -> tuple[float, float]:
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            num_kv_blocks=2048,
            max_num_seqs=64,
            max_num_batched_tokens=2048,
        )
    )
    bm = engine.block_manager
    for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens, strict=True)):
        engine.add_request(
            f"b{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        )
    peak_used, peak_util = 0, 0.0
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        used = bm.num_used_blocks
        if used >= peak_used and used:
            live = sum(s.num_computed_tokens for s in engine.scheduler.running)
            peak_used, peak_util = used, live / (used * bm.block_size)
    return time.perf_counter() - start, peak_util


def main(argv: list[str] | None = None) -> Result:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument(
        "--model",
        help="a real model instead of the random bench model (any --model pdserve serves, e.g. "
        "smollm2-135m-instruct); adds a batch-1 decode comparison",
    )
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            from pdserve.shared.models.resolve import resolve

            model_dir = resolve(args.model).path
        else:
            model_dir = make_model(Path(tmp) / "llama", args.layers, args.hidden, args.vocab)
        shape = Shape.of(model_dir)
        wl = make_workload(args.requests, shape.vocab)
        engine_s, util = run_engine(model_dir, wl)
        hf_s = run_hf(model_dir, wl)
        batch1 = batch_one(model_dir, shape.vocab) if args.model else None
    bound = gemm_bound(wl, shape, chunk=2048)
    tokens = wl.output_tokens
    res = Result(
        requests=args.requests,
        output_tokens=tokens,
        hf_seconds=round(hf_s, 2),
        engine_seconds=round(engine_s, 2),
        hf_tokens_per_s=round(tokens / hf_s, 1),
        engine_tokens_per_s=round(tokens / engine_s, 1),
        speedup=round(hf_s / engine_s, 2),
        peak_kv_utilisation=round(util, 4),
        threads=torch.get_num_threads(),
        gemm_bound_seconds=round(bound.seconds, 2),
        ceiling_speedup=round(hf_s / bound.seconds, 2),
        model=args.model or "random bench model",
        batch1=batch1,
    )
    print(
        f"HF generate (static batches of 8): {res.hf_tokens_per_s:8.1f} output tok/s ({hf_s:.1f} s)"
    )
    print(
        f"pdserve engine (continuous):       {res.engine_tokens_per_s:8.1f} output tok/s ({engine_s:.1f} s)"
    )
    print(
        f"speed-up: {res.speedup:.2f}x   peak KV slot utilisation: {100 * util:.1f}% (waste {100 * (1 - util):.1f}%)"
    )
    print(
        f"GEMM-only bound on this machine: {bound.seconds:.1f} s "
        f"(prefill {bound.prefill_gflop:.0f} GFLOP at {bound.prefill_gflops_per_s:.0f} GFLOP/s, "
        f"decode {bound.decode_gflop:.0f} GFLOP at {bound.decode_gflops_per_s:.0f} GFLOP/s, "
        f"batch {bound.decode_batch}) -> no engine can exceed {res.ceiling_speedup:.1f}x HF here"
    )
    if batch1 is not None:
        print(
            f"batch 1 ({BATCH1_PROMPT} prompt + {BATCH1_OUTPUT} output tokens): "
            f"HF {batch1.hf_tokens_per_s:.1f} tok/s, pdserve engine "
            f"{batch1.engine_tokens_per_s:.1f} tok/s ({batch1.speedup:.2f}x)"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(asdict(res), indent=2))
    return res


if __name__ == "__main__":
    main()
