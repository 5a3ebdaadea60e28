"""Which one-row linear reads 1- and 2-byte weights at the bus's speed on one core (issue 42).

    taskset -c 0 .venv/bin/python -m perf.gemv_bench [--batches 1 2 4] [--rounds 5]
        [--json perf/results/gemv_bench.json]

SmolLM2-135M's linear shapes as the engine runs them (qkv and gate/up fused), at 1, 2 and 4
rows, one thread. Each candidate computes y = x @ W.T for float32 x [B, K]:

- ``fp32 F.linear (col-major)``: the float32 path (``model_setup.lay_out_for_gemv``);
- ``int8 fbgemm dynamic``: ``CpuInt8Linear``'s op (W8A8; the served INT8 path before);
- ``int8 _weight_int8pack_mm``: ATen's weight-only INT8 CPU kernel;
- ``int8 inductor``: ``(x[:, None, :] * w.float()).sum(-1) * scale`` compiled by Inductor, one
  fused loop that reads the int8 weight once (K contiguous);
- ``bf16 F.linear``: oneDNN's bf16 matmul (x cast to bf16);
- ``bf16 inductor``: the same reduction over a bf16 weight;
- ``int8 avx2 kernel`` / ``bf16 avx2 kernel``: ``kernels/cpu_gemv.cpp`` (weight-only, the
  weights widened to float32 in registers, up to 4 rows per pass over the weight);
- ``fp32 avx2 kernel (col-major)``: the same file's loop over the column-major float32 layout
  (blocks of 8 weight rows, 16 columns at a time; what the engine runs at 2-4 rows);
- ``fp32 oneDNN packed``: oneDNN's linear on the weight reordered once into its blocked layout
  (``cpu_gemv.pack_gemm``'s copy; what the engine runs from 5 rows).

Weights are cold: each candidate cycles through enough copies of its weight to pass 3x the L3,
as a decode step that streams 30 layers does. GB/s counts the weight bytes (int8: 1, bf16: 2,
fp32: 4 per weight). ``read roof`` is ``torch.sum`` over the same bytes (viewed as float32),
the same cold copies. Variants alternate inside each round; figures are medians of rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_gemv
from pdserve.services.engine.quant.int8_linear import cpu_has_vnni
from pdserve.services.engine.quant.int8_weights import quantize_per_channel

# (name, N, K): hidden 576, 9 q / 3 kv heads of 64, MLP 1536, vocabulary 49,152
SHAPES = [
    ("qkv_proj", 960, 576),
    ("o_proj", 576, 576),
    ("gate_up_proj", 3072, 576),
    ("down_proj", 576, 1536),
    ("lm_head", 49152, 576),
]
LAYERS = 30
COLD_BYTES = 96 << 20  # 3x this CPU's 32 MiB L3
IMPLS: list[str] = []  # --impls: run only the variants whose label contains one of these


def _gemv_int8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x[:, None, :] * w.to(torch.float32)).sum(-1) * scale


def _gemv_float(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x[:, None, :] * w.to(torch.float32)).sum(-1)


def _compiled(fn: Callable, batch: int) -> Callable:
    # batch 1 is its own static graph in the engine; larger buckets share a dynamic-batch one
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    if batch == 1:
        return compiled

    def call(x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        torch._dynamo.mark_dynamic(x, 0)
        return compiled(x, *rest)

    return call


def variants(w: torch.Tensor, batch: int) -> dict[str, tuple[int, Callable[[object], Callable]]]:
    """label -> (bytes per weight, make(copy) -> fn(x)) ; make() builds one cold copy's call."""
    q = quantize_per_channel(w)
    reduce_range = not cpu_has_vnni()
    int8_ind = _compiled(_gemv_int8, batch)
    float_ind = _compiled(_gemv_float, batch)
    zeros = torch.zeros(w.shape[0], dtype=torch.long)

    def fp32(_: object) -> Callable:
        wc = w.t().contiguous().t()
        return lambda x: F.linear(x, wc)

    def fbgemm(_: object) -> Callable:
        qt = torch._make_per_channel_quantized_tensor(q.qweight.clone(), q.scale.double(), zeros, 0)
        packed = torch.ops.quantized.linear_prepack(qt, None)
        return lambda x: torch.ops.quantized.linear_dynamic(x, packed, reduce_range)

    def int8pack(_: object) -> Callable:
        qw = q.qweight.clone()
        return lambda x: torch.ops.aten._weight_int8pack_mm(x, qw, q.scale)

    def int8_inductor(_: object) -> Callable:
        qw = q.qweight.clone()
        return lambda x: int8_ind(x, qw, q.scale)

    def bf16_linear(_: object) -> Callable:
        wb = w.to(torch.bfloat16)
        return lambda x: F.linear(x.to(torch.bfloat16), wb).float()

    def bf16_inductor(_: object) -> Callable:
        wb = w.to(torch.bfloat16)
        return lambda x: float_ind(x, wb)

    def int8_kernel(_: object) -> Callable:
        qw = q.qweight.clone()
        return lambda x: cpu_gemv.int8_gemv(x, qw, q.scale)

    def bf16_kernel(_: object) -> Callable:
        wb = w.to(torch.bfloat16)
        return lambda x: cpu_gemv.bf16_gemv(x, wb)

    def fp32_kernel(_: object) -> Callable:
        wc = w.t().contiguous().t()
        return lambda x: cpu_gemv.f32_linear_now(x, wc, None)

    def fp32_packed(_: object) -> Callable:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, cpu_gemv.PACK_HINT_ROWS)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    kernels = {
        "int8 avx2 kernel": (1, int8_kernel),
        "bf16 avx2 kernel": (2, bf16_kernel),
        "fp32 avx2 kernel (col-major)": (4, fp32_kernel),
    }
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        kernels["fp32 oneDNN packed"] = (4, fp32_packed)
    return {
        **(kernels if cpu_gemv.available() else {}),
        "fp32 F.linear (col-major)": (4, fp32),
        "int8 fbgemm dynamic": (1, fbgemm),
        "int8 _weight_int8pack_mm": (1, int8pack),
        "int8 inductor": (1, int8_inductor),
        "bf16 F.linear": (2, bf16_linear),
        "bf16 inductor": (2, bf16_inductor),
    }


def roof_calls(n: int, k: int, width: int) -> list[Callable]:
    """torch.sum over cold buffers of n*k*width bytes each."""
    nbytes = n * k * width
    bufs = [torch.randn(nbytes // 4) for _ in range(max(1, -(-COLD_BYTES // nbytes)))]
    return [lambda b=b: b.sum() for b in bufs]


def time_ring(calls: list[Callable[[], object]], passes: int) -> float:
    """Seconds per call, cycling through the ring ``passes`` times."""
    for c in calls:
        c()
    start = time.perf_counter()
    for _ in range(passes):
        for c in calls:
            c()
    return (time.perf_counter() - start) / (passes * len(calls))


def bench(name: str, n: int, k: int, batch: int, rounds: int) -> list[dict]:
    torch.manual_seed(0)
    w = torch.randn(n, k) / k**0.5
    x = torch.randn(batch, k)
    exact = F.linear(x.double(), w.double())
    rings: dict[str, tuple[int, list[Callable[[], object]]]] = {}
    errors: dict[str, float] = {}
    for label, (width, make) in variants(w, batch).items():
        if IMPLS and not any(part in label for part in IMPLS):
            continue
        copies = max(1, -(-COLD_BYTES // (n * k * width)))
        fns = [make(i) for i in range(copies)]
        y = fns[0](x)
        errors[label] = ((y.double() - exact).norm() / exact.norm()).item()
        rings[label] = (width, [lambda f=f: f(x) for f in fns])
    for width in sorted({wd for wd, _ in rings.values()}):
        rings[f"read roof ({width} B/weight)"] = (width, roof_calls(n, k, width))
    passes = {label: max(2, int(4e8 / (n * k * wd * len(c)))) for label, (wd, c) in rings.items()}
    samples: dict[str, list[float]] = {label: [] for label in rings}
    for _ in range(rounds):
        for label, (_, calls) in rings.items():
            samples[label].append(time_ring(calls, passes[label]))
    out = []
    for label, (width, _) in rings.items():
        s = statistics.median(samples[label])
        out.append(
            {
                "layer": name,
                "N": n,
                "K": k,
                "batch": batch,
                "impl": label,
                "bytes": n * k * width,
                "us": round(s * 1e6, 2),
                "gb_s": round(n * k * width / s / 1e9, 2),
                "rel_err": float(f"{errors[label]:.3g}") if label in errors else None,
            }
        )
    return out


def model_pass(rows: list[dict]) -> list[dict]:
    """Per impl and batch: one SmolLM2 pass's linears (30 layers + head), ms and GB/s."""
    out = []
    keys = sorted({(r["impl"], r["batch"]) for r in rows})
    for impl, batch in keys:
        sel = [r for r in rows if r["impl"] == impl and r["batch"] == batch]
        if len(sel) != len(SHAPES):
            continue
        us = sum(r["us"] * (1 if r["layer"] == "lm_head" else LAYERS) for r in sel)
        nbytes = sum(r["bytes"] * (1 if r["layer"] == "lm_head" else LAYERS) for r in sel)
        out.append(
            {
                "impl": impl,
                "batch": batch,
                "pass_ms": round(us / 1e3, 2),
                "gb_s": round(nbytes / (us * 1e3), 2),
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--impls", nargs="*", default=[], help="label substrings to run (all)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    IMPLS[:] = args.impls
    torch.set_num_threads(args.threads)
    rows = []
    for name, n, k in SHAPES:
        for b in args.batches:
            got = bench(name, n, k, b, args.rounds)
            for r in got:
                err = "" if r["rel_err"] is None else f"  err {r['rel_err']:.2g}"
                print(
                    f"{name:13s} B{b} {r['impl']:28s} {r['us']:10.1f} us {r['gb_s']:7.2f} GB/s{err}",
                    flush=True,
                )
            rows += got
    passes = model_pass(rows)
    for p in passes:
        print(f"pass B{p['batch']} {p['impl']:28s} {p['pass_ms']:8.2f} ms {p['gb_s']:7.2f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "model_pass": passes}, f, indent=1)


if __name__ == "__main__":
    main()
