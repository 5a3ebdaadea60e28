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

from services.engine.engine import LLMEngine
from shared.config import EngineConfig
from shared.sampling import SamplingParams


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


def weight_shapes(layers: int, hidden: int, vocab: int) -> list[tuple[int, int, int]]:
    """(in, out, count) of every matrix a token goes through, lm_head last (MHA, SwiGLU)."""
    inter = hidden * 11 // 4
    per_layer = [(hidden, 3 * hidden), (hidden, hidden), (hidden, 2 * inter), (inter, hidden)]
    return [(i, o, layers) for i, o in per_layer] + [(hidden, vocab, 1)]


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


def gemm_bound(wl: Workload, layers: int, hidden: int, vocab: int, chunk: int) -> GemmBound:
    """Prefill: every prompt token through every layer, lm_head once per prompt (the first
    token); decode: every further output token through everything. Attention is left out."""
    shapes = weight_shapes(layers, hidden, vocab)
    body, head = shapes[:-1], shapes[-1:]
    per_token = sum(2 * i * o * c for i, o, c in body) / 1e9
    head_gflop = 2 * hidden * vocab / 1e9
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
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, max_position_embeddings=1024,
        bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
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
                input_ids=ids, attention_mask=mask, max_new_tokens=max(wl.output_lens[i : i + batch_size]),
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
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
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args(argv)
    wl = make_workload(args.requests, args.vocab)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "llama", args.layers, args.hidden, args.vocab)
        engine_s, util = run_engine(model_dir, wl)
        hf_s = run_hf(model_dir, wl)
    bound = gemm_bound(wl, args.layers, args.hidden, args.vocab, chunk=2048)
    tokens = wl.output_tokens
    res = Result(
        requests=args.requests, output_tokens=tokens, hf_seconds=round(hf_s, 2), engine_seconds=round(engine_s, 2),
        hf_tokens_per_s=round(tokens / hf_s, 1), engine_tokens_per_s=round(tokens / engine_s, 1),
        speedup=round(hf_s / engine_s, 2), peak_kv_utilisation=round(util, 4), threads=torch.get_num_threads(),
        gemm_bound_seconds=round(bound.seconds, 2), ceiling_speedup=round(hf_s / bound.seconds, 2),
    )  # fmt: skip
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
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(asdict(res), indent=2))
    return res


if __name__ == "__main__":
    main()
