"""Which INT8 linear to run on this CPU (issue 18: "pick the kernels by measuring"): every
candidate on the served SmolLM2's linear shapes, side by side in one run, against fp32 and bf16.

    OMP_NUM_THREADS=2 .venv/bin/python -m perf.int8_linear_bench [--rows 1 16 64] [--rounds 7]

Candidates (each computes y = x @ W.T for fp32 x):
- ``fp32`` / ``bf16``: F.linear in that dtype (oneDNN / MKL);
- ``fbgemm dynamic (served)``: ``CpuInt8Linear`` as the engine runs it - per-token activation
  scales, prepacked per-channel INT8 weights, ``quantized::linear_dynamic``;
- ``fbgemm dynamic, per-tensor``: the raw op, one activation scale for all rows (what
  ``torch.ao.quantization.quantize_dynamic`` gives);
- ``weight-only int8pack``: ``aten._weight_int8pack_mm`` (W8A16, weights converted on the fly);
- ``int_mm + rescale``: activations rounded per token in torch, ``torch._int_mm``, rescaled;
- ``torchao ...``: where torchao is importable (it is not a dependency: ``pip install
  torchao==0.18.0``, the release for torch 2.13), its ``Int8DynamicActivationInt8WeightConfig``
  and ``Int8WeightOnlyConfig`` through ``quantize_``, eager (``--torchao-compile``: under
  ``torch.compile``, the first call's compile time not counted).

The variants alternate within each round, and each figure is the median over rounds, so drift on a
shared machine hits them alike. Ratios are against fp32 of the same round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve.services.engine.quant.int8_linear import CpuInt8Linear, cpu_has_vnni
from pdserve.services.engine.quant.int8_weights import quantize_per_channel, quantize_per_token

# (name, out_features N, in_features K) of SmolLM2-135M: hidden 576, 9 q / 3 kv heads of 64,
# MLP 1536, vocabulary 49,152
SHAPES = [
    ("qkv_proj", 960, 576),
    ("o_proj", 576, 576),
    ("gate_up_proj", 3072, 576),
    ("down_proj", 576, 1536),
    ("lm_head", 49152, 576),
]


def candidates(w: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    weight = quantize_per_channel(w)
    served = CpuInt8Linear(weight, None, torch.float32)
    w_bf16 = w.to(torch.bfloat16)
    qw = torch._make_per_channel_quantized_tensor(
        weight.qweight, weight.scale.double(), torch.zeros(w.shape[0], dtype=torch.long), 0
    )
    packed = torch.ops.quantized.linear_prepack(qw, None)
    reduce_range = not cpu_has_vnni()
    qweight_t = weight.qweight.t().contiguous().t()  # [N, K] int8, K contiguous

    def int_mm(x: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_per_token(x)
        if xq.shape[0] <= 16:  # _int_mm takes 17+ rows on CPU: pad, as a caller would have to
            xq = F.pad(xq, (0, 0, 0, 17 - xq.shape[0]))
        acc = torch._int_mm(xq, qweight_t.t())[: x.shape[0]]
        return acc.float() * xs[:, None] * weight.scale[None, :]

    return {
        **torchao_candidates(w),
        "fp32": lambda x: F.linear(x, w),
        "bf16": lambda x: F.linear(x.to(torch.bfloat16), w_bf16).float(),
        "fbgemm dynamic (served)": served,
        "fbgemm dynamic, per-tensor": lambda x: torch.ops.quantized.linear_dynamic(
            x, packed, reduce_range
        ),
        "weight-only int8pack": lambda x: torch.ops.aten._weight_int8pack_mm(
            x, weight.qweight, weight.scale
        ),
        "int_mm + rescale": int_mm,
    }


TORCHAO_COMPILE = False


def torchao_candidates(w: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    try:
        import torchao.quantization as tq  # pyright: ignore[reportMissingImports]
    except ImportError:
        return {}
    out = {}
    for config in (tq.Int8DynamicActivationInt8WeightConfig, tq.Int8WeightOnlyConfig):
        layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        layer.weight.data = w.clone()
        model = torch.nn.Sequential(layer).requires_grad_(False)
        tq.quantize_(model, config())
        label = f"torchao {config.__name__.removesuffix('Config')}"
        out[label] = torch.compile(model) if TORCHAO_COMPILE else model
    return out


def time_call(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def bench(name: str, n: int, k: int, rows: int, rounds: int) -> list[dict]:
    torch.manual_seed(0)
    w = torch.randn(n, k) / k**0.5
    x = torch.randn(rows, k)
    impls = candidates(w)
    exact = F.linear(x.double(), w.double())
    errors, samples = {}, {label: [] for label in impls}
    calls = max(3, int(2e8 / (n * k * rows)))  # ~0.2 G multiply-adds per sample
    for label, fn in impls.items():
        try:
            y = fn(x)
        except RuntimeError as exc:  # an op this torch build lacks on this CPU
            print(f"  {name} M{rows} {label}: {exc}".splitlines()[0])
            continue
        errors[label] = ((y.double() - exact).norm() / exact.norm()).item()
    for _ in range(rounds):
        for label in errors:
            samples[label].append(time_call(lambda f=impls[label]: f(x), calls))
    fp32 = statistics.median(samples["fp32"])
    out = []
    for label in errors:
        ms = statistics.median(samples[label])
        out.append(
            {
                "layer": name,
                "N": n,
                "K": k,
                "rows": rows,
                "impl": label,
                "ms": round(ms, 4),
                "vs_fp32": round(fp32 / ms, 2),
                "rel_err": float(f"{errors[label]:.3g}"),
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--torchao-compile", action="store_true", help="torchao under torch.compile")
    args = ap.parse_args()
    global TORCHAO_COMPILE
    TORCHAO_COMPILE = args.torchao_compile
    torch.set_num_threads(args.threads)
    rows = []
    for name, n, k in SHAPES:
        for m in args.rows:
            got = bench(name, n, k, m, args.rounds)
            for r in got:
                print(
                    f"{name:13s} M{m:<3d} {r['impl']:28s} {r['ms']:9.4f} ms "
                    f"{r['vs_fp32']:6.2f}x  err {r['rel_err']:.2g}",
                    flush=True,
                )
            rows += got
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
