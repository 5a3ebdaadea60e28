"""Compile every Triton kernel for sm_90 (H100/H200) ahead of time, on a machine without a GPU.

The interpreter runs the kernels' logic but never the compiler, so a construct the compiler
rejects, a tile that overflows shared memory or a register spill would otherwise first show up on
a GPU. Triton ships ptxas, so the whole pipeline down to a cubin runs on CPU. Run as a script
(TRITON_INTERPRET must be unset): `python -m tests.kernels.compile_sm90`; prints one JSON line
per kernel variant. tests/kernels/test_compile_sm90.py runs it in a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import torch

SM90_SHARED_MEMORY = 227 * 1024  # opt-in maximum per block

# Pointer arguments by name; everything else not listed is bf16 activations/cache.
_POINTER_TYPES = {
    "block_tables_ptr": "*i32",
    "context_lens_ptr": "*i32",
    "cu_seqlens_q_ptr": "*i32",
    "cu_seqlens_k_ptr": "*i32",
    "slot_mapping_ptr": "*i64",
    "positions_ptr": "*i64",
    "cache_ptr": "*fp32",
    "part_acc_ptr": "*fp32",
    "part_max_ptr": "*fp32",
    "part_sum_ptr": "*fp32",
    "k_scale_ptr": "*fp32",
    "v_scale_ptr": "*fp32",
}
_FLOAT_ARGS = {"eps", "scale_log2", "qmax"}
# A quantized KV cache's values (--kv-cache-dtype int8 / fp8_e4m3), by the kernels' cache pointers
_QUANT_CACHE = {"int8": "*i8", "fp8_e4m3": "*fp8e4nv"}
_CACHE_POINTERS = ("k_cache_ptr", "v_cache_ptr", "k_ptr", "v_ptr")
# Integer arguments that can be anything (no divisibility-by-16 hint).
_ODD_INTS = {"group", "num_splits", "num_heads", "num_q_heads", "num_k_heads", "row_blocks"}


def _signature(kernel, constexprs: dict, pointers: dict) -> tuple[dict, dict]:
    signature, attrs = {}, {}
    for i, param in enumerate(kernel.params):
        name = param.name
        if param.is_constexpr:
            assert name in constexprs, f"{kernel.__name__}: give a value for {name}"
            signature[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            signature[name] = pointers.get(name) or _POINTER_TYPES.get(name, "*bf16")
        elif name in _FLOAT_ARGS:
            signature[name] = "fp32"
            continue
        else:
            signature[name] = "i32"
            if name in _ODD_INTS:
                continue
        # What the launcher infers for aligned pointers and strides that are multiples of 16.
        attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs


def _ptxas_usage(ptx: str) -> dict:
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        run = subprocess.run(
            [get_ptxas(90).path, "-v", "--gpu-name=sm_90a", path, "-o", path + ".o"],
            capture_output=True,
            text=True,
            check=True,
        )
    registers = re.search(r"Used (\d+) registers", run.stderr)
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", run.stderr)
    return {
        "registers": int(registers.group(1)) if registers else None,
        "spill_bytes": sum(int(s) for s in spills),
    }


def compile_variant(
    kernel, constexprs: dict, num_warps: int, num_stages: int, pointers: dict | None = None
) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    signature, attrs = _signature(kernel, constexprs, pointers or {})
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", 90, 32)
    options = make_backend(target).parse_options({"num_warps": num_warps, "num_stages": num_stages})
    compiled = triton.compile(source, target=target, options=options.__dict__)
    return {"shared_bytes": compiled.metadata.shared, **_ptxas_usage(compiled.asm["ptx"])}


def variants() -> list[tuple[str, object, dict, int, int, dict]]:
    """(label, kernel, constexprs, num_warps, num_stages, pointer types that differ from the
    defaults): what production launches on an H200 for a Llama-3-8B-shaped model (head dim 128,
    GQA 4, page 16), bf16, with a float cache and with each quantized one."""
    from pdserve.kernels.triton_cache import _store_kvcache_kernel
    from pdserve.kernels.triton_decode import _decode_merge_kernel, _decode_split_kernel
    from pdserve.kernels.triton_decode_launch import MULTI_QUERY_LAUNCH, DecodeConfig
    from pdserve.kernels.triton_norm import _rms_norm_kernel
    from pdserve.kernels.triton_prefill import _prefill_kernel, choose_prefill_config
    from pdserve.kernels.triton_rotary import _rotary_kernel

    decode = DecodeConfig(block_n=64, num_splits=1)
    prefill = choose_prefill_config(128, torch.device("cuda"))
    out = [
        ("rms_norm", _rms_norm_kernel, {"HAS_RESIDUAL": True, "BLOCK": 4096}, 16, 1, {}),
        ("rotary", _rotary_kernel, {"BLOCK_H": 32, "BLOCK_D": 64}, 4, 1, {}),
        (
            "decode_merge",
            _decode_merge_kernel,
            {"HEAD_DIM": 128, "BLOCK_S": 32, "BLOCK_D": 128},
            4,
            1,
            {},
        ),
    ]
    store = {"BLOCK_H": 8, "BLOCK_D": 128}
    out.append(("store_kvcache", _store_kvcache_kernel, {**store, "KV_QUANT": False}, 4, 1, {}))
    for kv, cache in _QUANT_CACHE.items():
        pointers = dict.fromkeys(_CACHE_POINTERS, cache)
        label = f"store_kvcache kv={kv}"
        out.append((label, _store_kvcache_kernel, {**store, "KV_QUANT": True}, 4, 1, pointers))
    # Plain decode (16 rows: the GQA group padded) and speculative verification, whose rows are
    # q_len x group (GQA 4: 32 rows for q_len 5, 64 - the most one program holds - for q_len 9),
    # each with the warps it launches with.
    launches = [(False, 16, decode.num_warps)]
    launches += [(True, rows, warps) for rows, (warps, _) in MULTI_QUERY_LAUNCH.items()]
    # A quantized cache: plain decode both ways and the largest verification block.
    caches = [(None, launch) for launch in launches]
    caches += [(kv, launch) for kv in _QUANT_CACHE for launch in (launches[0], launches[-1])]
    for kv, (multi, block_m, num_warps) in caches:
        pointers = dict.fromkeys(_CACHE_POINTERS, _QUANT_CACHE[kv]) if kv else {}
        for single in (True, False):
            label = f"decode single_split={single}"
            if multi:
                label += f" multi_query rows={block_m}"
            if kv:
                label += f" kv={kv}"
            out.append(
                (
                    label,
                    _decode_split_kernel,
                    {
                        "block_size": 16,
                        "HEAD_DIM": 128,
                        "MULTI_QUERY": multi,
                        "SINGLE_SPLIT": single,
                        "KV_QUANT": kv is not None,
                        "BLOCK_M": block_m,
                        "BLOCK_N": decode.block_n,
                        "BLOCK_D": 128,
                        "PRECISION": "tf32",
                    },
                    num_warps,
                    decode.num_stages,
                    pointers,
                )
            )
    for paged, kv in ((False, None), (True, None), *((True, kv) for kv in _QUANT_CACHE)):
        pointers = dict.fromkeys(_CACHE_POINTERS, _QUANT_CACHE[kv]) if kv else {}
        out.append(
            (
                f"prefill paged={paged}" + (f" kv={kv}" if kv else ""),
                _prefill_kernel,
                {
                    "block_size": 16 if paged else 1,
                    "HEAD_DIM": 128,
                    "PAGED": paged,
                    "KV_QUANT": kv is not None,
                    "BLOCK_M": prefill.block_m,
                    "BLOCK_N": prefill.block_n,
                    "BLOCK_D": 128,
                    "PRECISION": "tf32",
                },
                prefill.num_warps,
                prefill.num_stages,
                pointers,
            )
        )
    return out


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    for label, kernel, constexprs, num_warps, num_stages, pointers in variants():
        usage = compile_variant(kernel, constexprs, num_warps, num_stages, pointers)
        print(json.dumps({"kernel": label, **usage}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
