"""What ``--quantization`` and ``--kv-cache-dtype`` accept, and the one-line start-up refusals of
combinations this build cannot serve (never a silent fallback to another format)."""

from __future__ import annotations

import torch

QUANTIZATION_METHODS = ("none", "int8")
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")


def quantization_problem(
    quantization: str, kv_cache_dtype: str, device: torch.device, dtype: torch.dtype
) -> str | None:
    """Why this build cannot serve these options on ``device`` in ``dtype``, in one line, or None."""
    if quantization not in QUANTIZATION_METHODS:
        return (
            f"--quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {quantization!r}"
        )
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        choices = ", ".join(KV_CACHE_DTYPES)
        return f"--kv-cache-dtype must be one of {choices}, got {kv_cache_dtype!r}"
    if quantization == "int8" and device.type == "cpu":
        engines = torch.backends.quantized.supported_engines
        if not {"fbgemm", "x86", "onednn"} & set(engines):
            return (
                "--quantization int8 on CPU needs torch's fbgemm or oneDNN quantized engine; "
                f"this torch build has only {engines}"
            )
    if kv_cache_dtype == "fp8_e4m3":
        if not _float8_round_trips(device):
            return f"--kv-cache-dtype fp8_e4m3: this torch build has no float8_e4m3fn on {device}"
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
            return (
                f"--kv-cache-dtype fp8_e4m3 needs a GPU of compute capability 8.9 or newer "
                f"(this one is {cap}); use --kv-cache-dtype int8"
            )
    return None


def _float8_round_trips(device: torch.device) -> bool:
    if not hasattr(torch, "float8_e4m3fn"):
        return False
    try:
        x = torch.tensor([0.5, -2.0], device=device)
        return bool(torch.equal(x.to(torch.float8_e4m3fn).to(torch.float32), x))
    except (RuntimeError, TypeError):
        return False
