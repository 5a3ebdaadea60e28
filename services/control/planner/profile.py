"""What one worker of each role does on this hardware, as measured points.

A ``Profile`` holds three measurements of one model on one machine (``pdserve plan`` writes one
after short real runs of a prefill worker and a decode worker):

- **prefill**: tokens/s of one prefill worker by prompt length (short prompts pay a fixed cost per
  forward pass, long ones the quadratic attention, so the curve rises then falls);
- **decode**: the inter-token latency (ms per step) of one decode worker by (batch size, context
  length): a grid, every batch measured at every context;
- **KV capacity**: how many tokens of KV one decode worker holds, which caps its batch.

Between measured points the curves are interpolated **linearly, and clamped at the ends** (the
decode grid bilinearly). Linear because the measured curves are smooth and monotone between
neighbouring points, so a straight line errs far less than the run-to-run noise; clamped because
a value beyond the last point would be a guess about a regime nobody measured (past the largest
batch the engine may not even run). Clamping under-states ITL for contexts longer than the longest
measured one, so a profile should span the workload's contexts; ``covers`` says whether it does.
The batch is never extrapolated: ``max_batch`` is the largest batch measured (or the engine's cap).
"""

from __future__ import annotations

import dataclasses
import json
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1


def interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x) through sorted xs, clamped to the end values outside them."""
    if x <= xs[0]:
        return float(ys[0])
    if x >= xs[-1]:
        return float(ys[-1])
    i = bisect_right(xs, x) - 1
    frac = (x - xs[i]) / (xs[i + 1] - xs[i])
    return float(ys[i] + frac * (ys[i + 1] - ys[i]))


def _check_axis(name: str, values: Sequence[float]) -> None:
    if not values or any(b <= a for a, b in zip(values, values[1:], strict=False)):
        raise ValueError(f"{name} must be non-empty and strictly increasing, got {list(values)}")
    if values[0] <= 0:
        raise ValueError(f"{name} must be positive, got {list(values)}")


@dataclass(frozen=True)
class DecodeCapacity:
    """The best one decode worker can do under an ITL target at one context length."""

    batch: int
    itl_ms: float
    tokens_per_s: float  # batch sequences, one token each per step
    limited_by: str  # "itl" (a larger batch misses the target), "kv", "max_batch", "unreachable"


@dataclass(frozen=True)
class Profile:
    prefill_lens: tuple[int, ...]  # prompt lengths measured, increasing
    prefill_tokens_per_s: tuple[float, ...]  # one prefill worker's throughput at each
    decode_batches: tuple[int, ...]  # batch sizes measured, increasing
    decode_contexts: tuple[int, ...]  # context lengths measured, increasing
    decode_itl_ms: tuple[tuple[float, ...], ...]  # [batch index][context index]
    kv_capacity_tokens: int  # one decode worker's KV pool, in tokens
    max_batch: int = 0  # the engine's cap on running sequences; 0 = the largest batch measured
    # the prefill engine's token budget per step: the prompts one step takes together (0: one)
    prefill_batch_tokens: int = 0
    model: str = ""
    hardware: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        _check_axis("prefill_lens", self.prefill_lens)
        _check_axis("decode_batches", self.decode_batches)
        _check_axis("decode_contexts", self.decode_contexts)
        if len(self.prefill_tokens_per_s) != len(self.prefill_lens):
            raise ValueError("one prefill throughput per prompt length")
        if min(self.prefill_tokens_per_s) <= 0:
            raise ValueError("prefill throughputs must be positive")
        shape = (len(self.decode_batches), len(self.decode_contexts))
        if len(self.decode_itl_ms) != shape[0] or any(
            len(row) != shape[1] for row in self.decode_itl_ms
        ):
            raise ValueError(f"decode_itl_ms must be a {shape[0]}x{shape[1]} grid")
        if min(min(row) for row in self.decode_itl_ms) <= 0:
            raise ValueError("decode ITLs must be positive")
        if self.kv_capacity_tokens <= 0:
            raise ValueError("kv_capacity_tokens must be positive")
        if self.prefill_batch_tokens < 0:
            raise ValueError("prefill_batch_tokens must be >= 0")
        if self.max_batch == 0:
            object.__setattr__(self, "max_batch", self.decode_batches[-1])
        if not 1 <= self.max_batch <= self.decode_batches[-1]:
            raise ValueError("max_batch must lie within the measured batches (no extrapolation)")

    # ---- the curves ---------------------------------------------------------------------------

    def prefill_throughput(self, prompt_len: float) -> float:
        """Tokens/s of one prefill worker on prompts of this length."""
        return interp(self.prefill_lens, self.prefill_tokens_per_s, prompt_len)

    def prefill_seconds(self, prompt_len: float) -> float:
        """How long one prompt of this length takes on an idle prefill worker."""
        return prompt_len / self.prefill_throughput(prompt_len)

    def decode_itl(self, batch: float, context: float) -> float:
        """ms per decode step of one worker running ``batch`` sequences of ``context`` tokens."""
        rows = [interp(self.decode_contexts, row, context) for row in self.decode_itl_ms]
        return interp(self.decode_batches, rows, batch)

    def scaled(self, prefill: float = 1.0, decode: float = 1.0) -> Profile:
        """This profile on an engine ``prefill`` times as slow at prefill and ``decode`` times at
        decode (the planner's corrections, observed over profiled, applied to the curves)."""
        if prefill <= 0 or decode <= 0:
            raise ValueError("scale factors must be positive")
        return dataclasses.replace(
            self,
            prefill_tokens_per_s=tuple(t / prefill for t in self.prefill_tokens_per_s),
            decode_itl_ms=tuple(tuple(v * decode for v in row) for row in self.decode_itl_ms),
        )

    def batch_limit(self, context: float, kv_fraction: float = 1.0) -> int:
        """The largest batch whose KV fits in ``kv_fraction`` of the pool at this context."""
        return max(0, min(self.max_batch, int(kv_fraction * self.kv_capacity_tokens // context)))

    def best_decode(
        self, itl_target_ms: float, context: float, kv_fraction: float = 1.0
    ) -> DecodeCapacity:
        """The largest batch whose profiled ITL meets the target (and whose KV fits), with its
        tokens/s. Every integer batch is checked, not only the first miss: measured curves are
        noisy. If even one sequence misses the target, batch 1 is returned as "unreachable"."""
        cap = max(1, self.batch_limit(context, kv_fraction))
        best = 0
        for batch in range(1, cap + 1):
            if self.decode_itl(batch, context) <= itl_target_ms:
                best = batch
        if best == 0:
            limit, best = "unreachable", 1
        elif best < cap:
            limit = "itl"
        else:
            limit = "max_batch" if cap == self.max_batch else "kv"
        itl = self.decode_itl(best, context)
        return DecodeCapacity(
            batch=best, itl_ms=itl, tokens_per_s=best * 1000.0 / itl, limited_by=limit
        )

    def covers(self, prompt_len: float, context: float) -> bool:
        """Whether these lengths lie inside the measured ranges (no clamping needed)."""
        return (
            self.prefill_lens[0] <= prompt_len <= self.prefill_lens[-1]
            and self.decode_contexts[0] <= context <= self.decode_contexts[-1]
        )

    # ---- JSON -----------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": FORMAT_VERSION,
            "model": self.model,
            "hardware": self.hardware,
            "note": self.note,
            "prefill": {
                "prompt_len": list(self.prefill_lens),
                "tokens_per_s": list(self.prefill_tokens_per_s),
                "batch_tokens": self.prefill_batch_tokens,
            },
            "decode": {
                "batch": list(self.decode_batches),
                "context": list(self.decode_contexts),
                "itl_ms": [list(row) for row in self.decode_itl_ms],
                "max_batch": self.max_batch,
                "kv_capacity_tokens": self.kv_capacity_tokens,
            },
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Profile:
        if doc.get("version") != FORMAT_VERSION:
            raise ValueError(f"profile format version {doc.get('version')!r} is not supported")
        pre, dec = doc["prefill"], doc["decode"]
        return cls(
            prefill_lens=tuple(int(x) for x in pre["prompt_len"]),
            prefill_tokens_per_s=tuple(float(x) for x in pre["tokens_per_s"]),
            decode_batches=tuple(int(x) for x in dec["batch"]),
            decode_contexts=tuple(int(x) for x in dec["context"]),
            decode_itl_ms=tuple(tuple(float(x) for x in row) for row in dec["itl_ms"]),
            kv_capacity_tokens=int(dec["kv_capacity_tokens"]),
            max_batch=int(dec.get("max_batch", 0)),
            prefill_batch_tokens=int(pre.get("batch_tokens", 0)),
            model=str(doc.get("model", "")),
            hardware=str(doc.get("hardware", "")),
            note=str(doc.get("note", "")),
        )

    def save(self, path: Path | str) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path | str) -> Profile:
        return cls.from_dict(json.loads(Path(path).read_text()))

    @classmethod
    def from_points(
        cls,
        prefill: Iterable[tuple[int, float]],
        decode: Iterable[tuple[int, int, float]],
        kv_capacity_tokens: int,
        **meta: Any,
    ) -> Profile:
        """From measured points as a profiling run yields them: (prompt_len, tokens/s) and
        (batch, context, itl_ms). The decode points must fill the grid of their batches x
        contexts; a missing cell is an error, never a guess."""
        pre = sorted(prefill)
        cells = {(b, c): itl for b, c, itl in decode}
        batches = sorted({b for b, _ in cells})
        contexts = sorted({c for _, c in cells})
        missing = [(b, c) for b in batches for c in contexts if (b, c) not in cells]
        if missing:
            raise ValueError(f"decode grid lacks (batch, context) cells {missing}")
        return cls(
            prefill_lens=tuple(n for n, _ in pre),
            prefill_tokens_per_s=tuple(t for _, t in pre),
            decode_batches=tuple(batches),
            decode_contexts=tuple(contexts),
            decode_itl_ms=tuple(tuple(cells[b, c] for c in contexts) for b in batches),
            kv_capacity_tokens=kv_capacity_tokens,
            **meta,
        )

    @classmethod
    def synthetic(
        cls,
        *,
        params_b: float = 8.0,
        kv_bytes_per_token: int = 128 * 1024,
        hbm_tb_s: float = 4.8,
        dense_tflops: float = 989.0,
        memory_gb: float = 141.0,
        max_batch: int = 512,
    ) -> Profile:
        """An H200-like profile of an 8B Llama-class model in bf16, for tests and the simulator
        at a GPU host's scale. The numbers are **illustrative**, not measured: a roofline with
        assumed efficiencies (70% of HBM bandwidth, 50% of dense bf16 FLOPs, ~1.5 ms of launch
        overhead per decode step, ~12 ms per prefill forward). Use a measured profile for advice.
        """
        weight_bytes = params_b * 2e9
        bandwidth = hbm_tb_s * 1e12 * 0.7
        flops = dense_tflops * 1e12 * 0.5
        layers, hidden = 32, 4096  # Llama-3-8B's attention shape, for the quadratic term

        def prefill_tps(n: int) -> float:
            per_token = 2 * params_b * 1e9 + 2 * layers * hidden * n  # dense + causal attention
            return n / (0.012 + n * per_token / flops)

        def itl_ms(batch: int, context: int) -> float:
            read = (weight_bytes + batch * context * kv_bytes_per_token) / bandwidth
            compute = batch * 2 * params_b * 1e9 / flops
            return 1000.0 * (0.0015 + max(read, compute) + 0.25 * min(read, compute))

        lens = [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
        batches = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
        contexts = [128, 512, 1024, 2048, 4096, 8192, 16384, 32768]
        free_bytes = (memory_gb * 0.9 - 4.0) * 1e9 - weight_bytes  # 4 GB of activations
        return cls.from_points(
            [(n, prefill_tps(n)) for n in lens],
            [(b, c, itl_ms(b, c)) for b in batches for c in contexts],
            kv_capacity_tokens=int(free_bytes // kv_bytes_per_token),
            max_batch=min(max_batch, batches[-1]),
            model=f"synthetic {params_b:g}B bf16",
            hardware=f"H200-like ({hbm_tb_s:g} TB/s, {dense_tflops:g} TFLOP/s, {memory_gb:g} GB)",
            note="illustrative roofline numbers, not a measurement",
        )
