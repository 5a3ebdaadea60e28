"""Issue 18 on a GPU: what INT8 weights and a quantized KV cache buy at the kernel level.

- INT8 weight-only linear (``ops.int8_linear``, Triton W8A16, per-channel scales and Q8_0's
  group-32 scales) against the bf16 matmul (cuBLAS) on the served model's vocabulary head and on
  7B-class shapes, at decode row counts. A decode matmul reads its weight once, so the figure is
  weight GB/s: INT8 reads half the bytes of bf16.
- Paged decode attention over an int8 and an fp8_e4m3 cache (values plus one fp32 scale per
  token-head vector) against the bf16 cache, on the decode kernels' target case. Decode attention
  streams the cache, so bytes read per step is what the quantized cache cuts.

Every quantized result is checked against its float twin, so a fast wrong kernel cannot pass.

    python -m perf.quant_kernels_bench [--json results.json] [--quick]

Timed on CUDA only (perf/gpu_check.sh runs it): on CPU the INT8 weights run through fbgemm
instead (perf/quant_bench.py) and the Triton kernels only in the interpreter, where timing means
nothing. ``--smoke`` runs the same code on CPU on tiny shapes through the torch twins, untimed, so
a broken script is caught before a GPU run is spent on it (tests/unit/test_quant_kernels_bench.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass

import torch

from pdserve.kernels import ops
from pdserve.services.engine.quant.int8_weights import quantize_per_channel
from pdserve.services.engine.quant.kv_cache import kv_cache_spec
from perf.kernels_bench import DecodeCase, decode_inputs
from perf.kernels_bench import time_ms as cuda_time_ms

# (name, N, K): the served SmolLM2's vocabulary head, a 7B model's attention and MLP matmuls
LINEAR_SHAPES = [
    ("smollm2 lm_head", 49152, 576),
    ("7B qkv", 12288, 4096),
    ("7B down", 4096, 11008),
]
ROWS = (1, 16, 64)
Q8_0_GROUP = 32
# |int8 - bf16-of-the-same-weights| relative to the output's scale: both accumulate in fp32 over
# the same dequantized weights; only the bf16 rounding of W and of the result differ
MAX_REL_ERR_LINEAR = 2e-2
# decode attention over a quantized cache vs the bf16 cache: int8 keeps ~1/254 of a vector's
# range, fp8 e4m3 ~1/16; outputs are O(1) softmax mixes
MAX_ABS_ERR_KV = {"int8": 5e-2, "fp8_e4m3": 2.5e-1}


def time_ms(fn, repeats: int) -> float:
    if torch.cuda.is_available():
        return cuda_time_ms(fn, repeats)
    start = time.perf_counter()  # --smoke on CPU: one untimed-quality pass, a sanity figure
    fn()
    return (time.perf_counter() - start) * 1e3


@dataclass
class Row:
    op: str
    case: str
    impl: str
    ms: float
    gbps: float
    speedup_vs_bf16: float | None = None
    max_err: float | None = None


def group_quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0-style: one scale per ``group`` values along K, [N, K // group]."""
    n, k = w.shape
    blocks = w.float().view(n, k // group, group)
    scale = blocks.abs().amax(dim=2).clamp(min=1e-12) / 127
    q = torch.round(blocks / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q.view(n, k), scale


def bench_linear(name: str, n: int, k: int, m: int, repeats: int, dev: torch.device) -> list[Row]:
    w = torch.randn(n, k, device=dev) / math.sqrt(k)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    per_channel = quantize_per_channel(w)
    grouped = group_quantize(w, Q8_0_GROUP)
    case = f"{name} N{n} K{k} M{m}"
    rows: list[Row] = []
    w_bf16 = w.to(torch.bfloat16)
    bf16_ms = time_ms(lambda: x @ w_bf16.T, repeats)
    rows.append(Row("linear", case, "bf16 cuBLAS", bf16_ms, n * k * 2 / (bf16_ms * 1e6)))
    variants = {
        "int8 per-channel": (per_channel.qweight, per_channel.scale, per_channel.dequantize()),
        "int8 group-32 (Q8_0)": (
            grouped[0],
            grouped[1],
            (grouped[0].float().view(n, -1, Q8_0_GROUP) * grouped[1][..., None]).view(n, k),
        ),
    }
    for impl, (qweight, scale, dequantized) in variants.items():
        expected = x.float() @ dequantized.T
        got = ops.int8_linear(x, qweight, scale).float()
        err = ((got - expected).abs().max() / expected.abs().max()).item()
        if err > MAX_REL_ERR_LINEAR:
            raise AssertionError(f"{case} {impl}: relative error {err:.3g}")
        ms = time_ms(lambda q=qweight, s=scale: ops.int8_linear(x, q, s), repeats)
        moved = n * k + scale.numel() * 4
        rows.append(Row("linear", case, impl, ms, moved / (ms * 1e6), bf16_ms / ms, err))
    return rows


def quantized_cache(inputs, kv_dtype: str, case: DecodeCase):
    """The bf16 case's K/V stored through ``ops.store_kvcache`` into a quantized engine cache
    laid out by the same block table: (k values, v values, k scales, v scales)."""
    spec = kv_cache_spec(
        kv_dtype, torch.bfloat16, 1, case.block_size, case.num_kv_heads, case.head_dim
    )
    num_blocks = inputs.k_cache.shape[0]
    values, scales = spec.split(spec.allocate(num_blocks, inputs.q.device))
    k, v, ks, vs = values[:, 0, 0], values[:, 0, 1], scales[:, 0, 0], scales[:, 0, 1]
    slots = torch.arange(num_blocks * case.block_size, device=inputs.q.device)
    flat_k = inputs.k_cache.reshape(-1, case.num_kv_heads, case.head_dim)
    flat_v = inputs.v_cache.reshape(-1, case.num_kv_heads, case.head_dim)
    ops.store_kvcache(flat_k, flat_v, k, v, slots, ks, vs)
    return k, v, ks, vs, spec.bytes_per_block


def bench_kv(case: DecodeCase, repeats: int, dev: torch.device) -> list[Row]:
    inputs = decode_inputs(case, dev, torch.bfloat16)
    tokens = case.batch * case.context
    rows: list[Row] = []

    def run_float() -> torch.Tensor:
        return ops.decode_attention(*inputs.args())

    expected = run_float().float()
    bf16_ms = time_ms(run_float, repeats)
    bf16_bytes = 2 * tokens * case.num_kv_heads * case.head_dim * 2
    rows.append(
        Row("decode_attention", case.name, "bf16 cache", bf16_ms, bf16_bytes / (bf16_ms * 1e6))
    )
    for kv_dtype in ("int8", "fp8_e4m3"):
        k, v, ks, vs, _ = quantized_cache(inputs, kv_dtype, case)

        def run(k=k, v=v, ks=ks, vs=vs) -> torch.Tensor:
            return ops.decode_attention(
                inputs.q,
                k,
                v,
                inputs.table,
                inputs.context_lens,
                inputs.scale,
                k_scale=ks,
                v_scale=vs,
            )

        err = (run().float() - expected).abs().max().item()
        if err > MAX_ABS_ERR_KV[kv_dtype]:
            raise AssertionError(f"{case.name} {kv_dtype}: max abs error {err:.3g}")
        ms = time_ms(run, repeats)
        moved = 2 * tokens * case.num_kv_heads * (case.head_dim + 4)
        rows.append(
            Row(
                "decode_attention",
                case.name,
                f"{kv_dtype} cache",
                ms,
                moved / (ms * 1e6),
                bf16_ms / ms,
                err,
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--quick", action="store_true", help="fewer repeats and cases")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, torch twins")
    args = ap.parse_args(argv)
    if args.smoke:
        dev, repeats = torch.device("cpu"), 1
        shapes, row_counts = [("tiny", 96, 64)], (1, 3)
        cases = [DecodeCase(batch=2, context=40, num_q_heads=4, num_kv_heads=2, head_dim=16)]
    elif not torch.cuda.is_available():
        print("quant_kernels_bench: needs CUDA (on CPU see perf/quant_bench.py)", file=sys.stderr)
        return 2
    else:
        ops.set_backend("triton")
        dev, repeats = torch.device("cuda"), 5 if args.quick else 20
        shapes, row_counts = (LINEAR_SHAPES[:2] if args.quick else LINEAR_SHAPES), ROWS
        cases = [DecodeCase(batch=64, context=2048)]
        if not args.quick:
            cases.append(DecodeCase(batch=8, context=8192))
    rows: list[Row] = []
    for name, n, k in shapes:
        for m in row_counts:
            rows += bench_linear(name, n, k, m, repeats, dev)
    for case in cases:
        rows += bench_kv(case, repeats, dev)
    for r in rows:
        speed = f"  {r.speedup_vs_bf16:.2f}x vs bf16" if r.speedup_vs_bf16 else ""
        err = f"  err {r.max_err:.2g}" if r.max_err is not None else ""
        print(f"{r.op:17s} {r.case:36s} {r.impl:22s} {r.ms:8.4f} ms {r.gbps:7.0f} GB/s{speed}{err}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
