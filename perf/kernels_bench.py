"""Kernel benchmark: paged decode attention in GB/s and prefill attention in TFLOP/s, bf16.

Both are set against the device's peak (HBM bandwidth, dense bf16 tensor throughput) and against
torch's scaled_dot_product_attention on the same shapes. SDPA cannot read a paged cache, so it
gets the same K/V laid out densely: the bound a paged kernel is chasing. Every timed Triton
result is also checked against SDPA's output, so a fast wrong kernel cannot pass.

    python -m perf.kernels_bench [--json results.json] [--sweep] [--quick]

`--sweep` times a handful of tile/split configurations per case, to pick the defaults in
kernels/triton_decode.py and kernels/triton_prefill.py on new hardware. On a machine without
CUDA it times the CPU twin of decode attention instead (kernels/reference.py, fp32, the served
SmolLM2's head layout): per layer call with the step's plan made once, as the engine runs it,
one query per sequence and 1 + k for speculative verification.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

# Spec-sheet peaks: (HBM GB/s, dense bf16 TFLOP/s without sparsity). Matched by substring of
# torch.cuda.get_device_name(), first hit wins, so the more specific names come first.
DEVICE_PEAKS: list[tuple[str, float, float]] = [
    ("GH200", 4000.0, 989.0),
    ("H200", 4800.0, 989.0),
    ("H100 PCIe", 2000.0, 756.0),
    ("H100", 3350.0, 989.0),
    ("H800", 3350.0, 989.0),
    ("B200", 8000.0, 2250.0),
    ("A100-SXM4-80GB", 2039.0, 312.0),
    ("A100", 1555.0, 312.0),
    ("L40S", 864.0, 362.0),
    ("L4", 300.0, 121.0),
    ("A10", 600.0, 125.0),
    ("RTX 4090", 1008.0, 165.0),
]

TARGET_DECODE_BW_FRACTION = 0.80  # of HBM peak, batch 64 x 2k context
TARGET_PREFILL_FLOP_FRACTION = 0.50  # of dense bf16 peak, 4k-token prompts
# Largest |triton - sdpa| accepted in bf16: outputs are O(1) mixes of bf16 values, both sides
# round probabilities and outputs to bf16 (a few ulps of 2**-8); anything larger is a bug.
MAX_ABS_ERR_BF16 = 5e-2


@dataclass
class Result:
    op: str
    case: str
    impl: str
    ms: float
    gbps: float | None = None
    tflops: float | None = None
    fraction_of_peak: float | None = None
    max_abs_err_vs_sdpa: float | None = None
    config: dict = field(default_factory=dict)


def time_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median per-call GPU time. Calls run back to back inside each timed batch, so Python launch
    overhead hides behind the GPU work; working sets exceed L2, so no cache flush is needed."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    per_batch = 5
    samples = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(per_batch):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / per_batch)
    return statistics.median(samples)


def device_peaks(name: str) -> tuple[float | None, float | None]:
    for key, gbps, tflops in DEVICE_PEAKS:
        if key in name:
            return gbps, tflops
    return None, None


def measured_copy_gbps(device: torch.device) -> float:
    """What a plain device-to-device copy reaches: the practical ceiling for a streaming kernel."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), repeats=10)
    return 2 * src.numel() / (ms * 1e-3) / 1e9


@dataclass(frozen=True)
class DecodeCase:
    batch: int
    context: int
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    q_len: int = 1  # queries per sequence: 1 plain decode, 1 + k verifying k proposals

    @property
    def name(self) -> str:
        q = f" q{self.q_len}" if self.q_len > 1 else ""
        return (
            f"B{self.batch} ctx{self.context}{q} Hq{self.num_q_heads} Hkv{self.num_kv_heads} "
            f"D{self.head_dim} bs{self.block_size}"
        )


@dataclass(frozen=True)
class PrefillCase:
    batch: int
    seqlen: int
    cached_prefix: int = 0
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16

    @property
    def name(self) -> str:
        prefix = f" prefix{self.cached_prefix}" if self.cached_prefix else ""
        return (
            f"B{self.batch} L{self.seqlen}{prefix} Hq{self.num_q_heads} "
            f"Hkv{self.num_kv_heads} D{self.head_dim}"
        )


def paged_cache(
    batch: int,
    context: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Engine-shaped cache [blocks, layers=2, 2, bs, Hkv, D] (we use layer 1, a strided view),
    each sequence on shuffled blocks, and the [B, blocks_per_seq] int32 block table."""
    per_seq = math.ceil(context / block_size)
    num_blocks = batch * per_seq
    kv = torch.randn(
        num_blocks, 2, 2, block_size, num_kv_heads, head_dim, device=device, dtype=dtype
    )
    table = torch.randperm(num_blocks, device=device).view(batch, per_seq).to(torch.int32)
    return kv, table


def dense_from_paged(cache: torch.Tensor, table: torch.Tensor, context: int) -> torch.Tensor:
    """[B, Hkv, context, D] contiguous copy of what the block table points at."""
    gathered = cache[table.long()]  # [B, blocks, bs, Hkv, D]
    batch = table.shape[0]
    dense = gathered.reshape(batch, -1, *cache.shape[2:])[:, :context]
    return dense.transpose(1, 2).contiguous()


@dataclass
class DecodeInputs:
    """One decode case laid out as the engine has it, and SDPA on a dense copy as the oracle."""

    q: torch.Tensor  # [B*q_len, Hq, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    table: torch.Tensor
    context_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor | None  # None: one query per sequence
    scale: float
    moved_bytes: int  # K/V once, q in, out back, the block table
    sdpa: Callable[[], torch.Tensor]

    def args(self) -> tuple:
        """decode_attention's leading arguments, in its order."""
        return (self.q, self.k_cache, self.v_cache, self.table, self.context_lens, self.scale)


def decode_inputs(case: DecodeCase, device: torch.device, dtype: torch.dtype) -> DecodeInputs:
    kv, table = paged_cache(
        case.batch, case.context, case.num_kv_heads, case.head_dim, case.block_size, device, dtype
    )
    k_cache, v_cache = kv[:, 1, 0], kv[:, 1, 1]
    b, n, hq, d = case.batch, case.q_len, case.num_q_heads, case.head_dim
    q = torch.randn(b * n, hq, d, device=device, dtype=dtype)
    context_lens = torch.full((b,), case.context, dtype=torch.int32, device=device)
    cu = None if n == 1 else torch.arange(0, b + 1, dtype=torch.int32, device=device) * n
    scale = 1 / math.sqrt(d)
    elt = q.element_size()
    kv_bytes = 2 * b * case.context * case.num_kv_heads * d * elt
    moved = kv_bytes + 2 * q.numel() * elt + table.numel() * 4

    k_dense = dense_from_paged(k_cache, table, case.context)
    v_dense = dense_from_paged(v_cache, table, case.context)
    q4 = q.view(b, n, hq, d).transpose(1, 2)  # [B, Hq, q_len, D]
    # query j at context - q_len + j (bottom-right causal); one query sees everything: no mask,
    # which keeps SDPA on its fastest kernel
    q_pos = case.context - n + torch.arange(n, device=device)
    mask = None if n == 1 else torch.arange(case.context, device=device) <= q_pos[:, None]

    def sdpa() -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q4, k_dense, v_dense, attn_mask=mask, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2).reshape(b * n, hq, d)

    return DecodeInputs(q, k_cache, v_cache, table, context_lens, cu, scale, moved, sdpa)


def bench_decode(
    case: DecodeCase,
    peak_gbps: float | None,
    repeats: int,
    sweep: bool,
    device: torch.device = torch.device("cuda"),
    dtype: torch.dtype = torch.bfloat16,
) -> list[Result]:
    from pdserve.kernels.triton_decode import (
        DecodeConfig,
        choose_decode_config,
        decode_attention_with,
        query_layout,
    )

    inputs = decode_inputs(case, device, dtype)
    expected = inputs.sdpa().float()
    results = []

    def record(impl: str, fn: Callable[[], torch.Tensor], config: dict) -> None:
        err = (fn().float() - expected).abs().max().item()
        ms = time_ms(fn, repeats)
        gbps = inputs.moved_bytes / (ms * 1e-3) / 1e9
        results.append(
            Result(
                "decode_attention",
                case.name,
                impl,
                ms,
                gbps=gbps,
                fraction_of_peak=gbps / peak_gbps if peak_gbps else None,
                max_abs_err_vs_sdpa=err if impl != "sdpa_dense" else 0.0,
                config=config,
            )
        )

    group = case.num_q_heads // case.num_kv_heads
    layout = query_layout(group, inputs.cu_seqlens_q, case.q_len)
    chosen = choose_decode_config(
        case.batch,
        case.num_kv_heads,
        inputs.table.shape[1] * case.block_size,
        case.head_dim,
        device,
        layout,
    )
    configs = [("triton", chosen)]
    if sweep:
        s = chosen.num_splits
        candidates = [
            DecodeConfig(block_n=64, num_splits=s, num_warps=4, num_stages=3),
            DecodeConfig(block_n=128, num_splits=s, num_warps=4, num_stages=2),
            DecodeConfig(block_n=32, num_splits=s, num_warps=4, num_stages=3),
            DecodeConfig(block_n=64, num_splits=s, num_warps=8, num_stages=2),
        ] + [
            DecodeConfig(block_n=64, num_splits=n, num_warps=4, num_stages=2)
            for n in sorted({1, 2, 4, max(1, s // 2), 2 * s} - {s})
        ]
        configs += [("triton_sweep", c) for c in candidates if c != chosen]
    for impl, config in configs:

        def run(config: DecodeConfig = config) -> torch.Tensor:
            return decode_attention_with(*inputs.args(), config, inputs.cu_seqlens_q, case.q_len)

        try:
            record(impl, run, asdict(config))
        except Exception as exc:  # a sweep tile too big for this GPU's shared memory
            print(f"  {case.name} {config}: {type(exc).__name__}: {exc}", file=sys.stderr)
            if impl == "triton":
                raise
    record("sdpa_dense", inputs.sdpa, {})
    return results


def bench_prefill(
    case: PrefillCase,
    peak_tflops: float | None,
    repeats: int,
    sweep: bool,
    device: torch.device = torch.device("cuda"),
    dtype: torch.dtype = torch.bfloat16,
) -> list[Result]:
    from pdserve.kernels.triton_cache import store_kvcache
    from pdserve.kernels.triton_prefill import (
        PrefillConfig,
        choose_prefill_config,
        prefill_attention_with,
    )

    dt = dtype
    b, new, prefix = case.batch, case.seqlen - case.cached_prefix, case.cached_prefix
    hq, hk, d = case.num_q_heads, case.num_kv_heads, case.head_dim
    q = torch.randn(b * new, hq, d, device=device, dtype=dt)
    k = torch.randn(b * new, hk, d, device=device, dtype=dt)
    v = torch.randn(b * new, hk, d, device=device, dtype=dt)
    cu_q = torch.arange(0, b + 1, device=device, dtype=torch.int32) * new
    cu_k = torch.arange(0, b + 1, device=device, dtype=torch.int32) * case.seqlen
    scale = 1 / math.sqrt(d)
    # Causal pairs: query j (absolute position prefix + j) sees prefix + j + 1 keys.
    pairs = b * (new * prefix + new * (new + 1) // 2)
    flops = 4 * pairs * hq * d

    paged = case.cached_prefix > 0
    cache_args: tuple = (None, None, None)
    if paged:
        kv, table = paged_cache(b, case.seqlen, hk, d, case.block_size, device, dt)
        k_cache, v_cache = kv[:, 1, 0], kv[:, 1, 1]
        pos = torch.arange(prefix, case.seqlen, device=device)
        slots = (
            table.long()[:, pos // case.block_size] * case.block_size + pos % case.block_size
        ).reshape(-1)
        store_kvcache(k, v, k_cache, v_cache, slots)
        cache_args = (k_cache, v_cache, table)
        k_full = dense_from_paged(k_cache, table, case.seqlen)
        v_full = dense_from_paged(v_cache, table, case.seqlen)
    else:
        k_full = k.view(b, new, hk, d).transpose(1, 2).contiguous()
        v_full = v.view(b, new, hk, d).transpose(1, 2).contiguous()
    q4 = q.view(b, new, hq, d).transpose(1, 2).contiguous()
    # Heads expanded to plain multi-head attention: that keeps SDPA on its flash kernel whatever
    # its GQA support; prefill is compute-bound, so the extra K/V bytes barely matter.
    k_full = k_full.repeat_interleave(hq // hk, dim=1)
    v_full = v_full.repeat_interleave(hq // hk, dim=1)

    if paged:
        # SDPA's is_causal aligns top-left; a cached prefix needs bottom-right, i.e. a mask,
        # which drops SDPA off its fast path. Still the right oracle, not a fair speed baseline.
        q_pos = prefix + torch.arange(new, device=device)
        mask = torch.arange(case.seqlen, device=device)[None, :] <= q_pos[:, None]

        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(q4, k_full, v_full, attn_mask=mask, scale=scale)
    else:

        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(q4, k_full, v_full, is_causal=True, scale=scale)

    expected = sdpa().transpose(1, 2).reshape(b * new, hq, d).float()
    results = []

    def record(impl: str, fn: Callable[[], torch.Tensor], config: dict, packed: bool) -> None:
        got = fn()
        if not packed:
            got = got.transpose(1, 2).reshape(b * new, hq, d)
        err = (got.float() - expected).abs().max().item()
        ms = time_ms(fn, repeats)
        tflops = flops / (ms * 1e-3) / 1e12
        results.append(
            Result(
                "prefill_attention",
                case.name,
                impl,
                ms,
                tflops=tflops,
                fraction_of_peak=tflops / peak_tflops if peak_tflops else None,
                max_abs_err_vs_sdpa=err if not impl.startswith("sdpa") else 0.0,
                config=config,
            )
        )

    chosen = choose_prefill_config(d, device)
    configs = [("triton", chosen)]
    if sweep:
        candidates = [
            PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
            PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=3),
            PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=3),
            PrefillConfig(block_m=128, block_n=32, num_warps=4, num_stages=4),
            PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=3),
            PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=4),
        ]
        configs += [("triton_sweep", c) for c in candidates if c != chosen]
    for impl, config in configs:

        def run(config: PrefillConfig = config) -> torch.Tensor:
            return prefill_attention_with(
                q, k, v, cu_q, cu_k, new, case.seqlen, scale, *cache_args, config
            )

        try:
            record(impl, run, asdict(config), packed=True)
        except Exception as exc:  # e.g. a sweep tile that needs more shared memory than exists
            print(f"  {case.name} {config}: {type(exc).__name__}: {exc}", file=sys.stderr)
            if impl == "triton":
                raise
    record("sdpa_masked" if paged else "sdpa_dense", sdpa, {}, packed=False)
    return results


def format_result(r: Result) -> str:
    if r.gbps is not None:
        rate = f"{r.gbps:8.1f} GB/s"
    else:
        rate = f"{r.tflops:8.1f} TFLOP/s" if r.tflops is not None else " " * 13
    peak = f"{100 * r.fraction_of_peak:5.1f}% of peak" if r.fraction_of_peak else "peak n/a"
    err = f"err {r.max_abs_err_vs_sdpa:.2e}" if r.max_abs_err_vs_sdpa is not None else ""
    cfg = " ".join(f"{k}={v}" for k, v in r.config.items())
    return f"{r.op:18s} {r.case:40s} {r.impl:12s} {r.ms:8.3f} ms {rate}  {peak}  {err}  {cfg}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write all results here")
    parser.add_argument("--sweep", action="store_true", help="also time alternative configs")
    parser.add_argument("--quick", action="store_true", help="only the two target cases")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--peak-gbps", type=float, help="override the HBM peak")
    parser.add_argument("--peak-tflops", type=float, help="override the dense bf16 peak")
    parser.add_argument("--threads", type=int, help="torch CPU threads (the CPU twin's timing)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    if not torch.cuda.is_available():
        print("kernels_bench: no CUDA device here; timing the CPU twin of decode attention.")
        from perf.kernels_bench_cpu import twin_main

        return twin_main(args)

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    peak_gbps, peak_tflops = device_peaks(name)
    peak_gbps = args.peak_gbps or peak_gbps
    peak_tflops = args.peak_tflops or peak_tflops
    copy_gbps = measured_copy_gbps(device)
    print(
        f"device {name}: peak HBM {peak_gbps} GB/s, dense bf16 {peak_tflops} TFLOP/s, "
        f"measured d2d copy {copy_gbps:.0f} GB/s"
    )

    decode_cases = [DecodeCase(batch=64, context=2048)]
    prefill_cases = [PrefillCase(batch=1, seqlen=4096)]
    if not args.quick:
        decode_cases += [
            DecodeCase(batch=1, context=32768),  # split-K territory
            DecodeCase(batch=256, context=1024),
            DecodeCase(batch=64, context=2048, num_q_heads=32, num_kv_heads=32, head_dim=64),
            DecodeCase(batch=64, context=2048, q_len=5),  # speculative verification, k = 4
        ]
        prefill_cases += [
            PrefillCase(batch=4, seqlen=4096),
            PrefillCase(batch=1, seqlen=16384),
            PrefillCase(batch=1, seqlen=4096, cached_prefix=3072),  # paged prefix path
            PrefillCase(batch=8, seqlen=1024, num_q_heads=32, num_kv_heads=32, head_dim=64),
        ]

    results: list[Result] = []

    def save(**summary: object) -> None:
        # Rewritten after every case, so a run cut short by a timeout still leaves its data.
        if not args.json:
            return
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": name,
                    "torch": torch.__version__,
                    "triton": __import__("triton").__version__,
                    "peak_gbps": peak_gbps,
                    "peak_tflops": peak_tflops,
                    "measured_copy_gbps": copy_gbps,
                    **summary,
                    "results": [asdict(r) for r in results],
                },
                f,
                indent=2,
            )

    for case in decode_cases:
        for r in bench_decode(case, peak_gbps, args.repeats, args.sweep):
            print(format_result(r), flush=True)
            results.append(r)
        save(complete=False)
    for case in prefill_cases:
        for r in bench_prefill(case, peak_tflops, args.repeats, args.sweep):
            print(format_result(r), flush=True)
            results.append(r)
        save(complete=False)

    def target(op: str, case: str, fraction: float) -> dict:
        best = max(
            (r for r in results if r.op == op and r.case == case and r.impl.startswith("triton")),
            key=lambda r: r.fraction_of_peak or 0.0,
        )
        default = next(r for r in results if r.op == op and r.case == case and r.impl == "triton")
        return {
            "case": case,
            "target_fraction": fraction,
            "default_fraction": default.fraction_of_peak,
            "best_fraction": best.fraction_of_peak,
            "best_config": best.config,
            "met_by_default": (default.fraction_of_peak or 0.0) >= fraction,
        }

    targets = {
        "decode": target("decode_attention", decode_cases[0].name, TARGET_DECODE_BW_FRACTION),
        "prefill": target("prefill_attention", prefill_cases[0].name, TARGET_PREFILL_FLOP_FRACTION),
    }

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.1%}"

    for key, t in targets.items():
        verdict = "MET" if t["met_by_default"] else "MISSED"
        print(
            f"target {key}: {verdict} default {pct(t['default_fraction'])} of peak,"
            f" best {pct(t['best_fraction'])} (want >= {pct(t['target_fraction'])})"
            f" best config {t['best_config']}"
        )
    wrong = [
        r
        for r in results
        if r.impl.startswith("triton") and not r.max_abs_err_vs_sdpa <= MAX_ABS_ERR_BF16
    ]
    for r in wrong:
        print(f"WRONG RESULT (err > {MAX_ABS_ERR_BF16}): {format_result(r)}")
    save(complete=True, targets=targets, all_results_correct=not wrong)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
