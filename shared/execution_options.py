"""How an engine runs its model on a CPU: its threads, compiled or eager steps, and the pages
its weights live in. A mixin of ``EngineConfig``."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.shared.options import opt


@dataclass
class ExecutionOptions:
    torch_threads: int = opt(
        0, "torch CPU threads of a worker; 0 = one per CPU the process may run on (its affinity)"
    )
    enforce_eager: bool = opt(
        False,
        "run every step eagerly: no compiled decode graphs (on a CPU, decode steps are "
        "otherwise compiled with Inductor at start, one graph per batch-size bucket)",
    )
    huge_pages: bool = opt(
        True,
        "keep CPU weights and the KV cache in transparent huge pages (madvise): a decode step "
        "streams the weights and reads each sequence's pages with fewer TLB misses (no effect "
        "where THP is off)",
    )
    cpu_fused_decode: bool = opt(
        True,
        "a CPU decode step (float32: any width with --cpu-packed-gemm, else 1-24 rows; "
        "bfloat16: 1-8; INT8: 1-4) runs every layer in one C++ call (kernels/cpu_decode.cpp) "
        "where the weights are float32, INT8 or bfloat16 and no LoRA is served; otherwise the "
        "compiled graphs serve it too",
    )
    cpu_packed_gemm: bool = opt(
        True,
        "float32 CPU linears of 5 rows and more (a prefill chunk, a decode batch, a speculative "
        "verification) run through oneDNN on a copy of each weight packed once "
        "(kernels/cpu_packed_gemm.cpp); the copy doubles the float32 weights' memory",
    )
