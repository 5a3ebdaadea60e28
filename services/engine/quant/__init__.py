"""Quantized weights (``--quantization``) and a quantized paged KV cache (``--kv-cache-dtype``).

- ``int8_weights``: INT8 weights with a scale per output channel or per group of input channels
  (GGUF Q8_0's 32), and their plain-torch reference (the oracle).
- ``int8_linear``: the ``nn.Linear`` replacements, one per device, chosen by measurement
  (perf/README.md, "INT8 weights and a quantized KV cache"), and ``quantize_linears``.
- ``smooth``: SmoothQuant-style per-input-channel smoothing of the CPU W8A8 path, calibrated on
  ``calibration_text.txt`` (written here).
- ``kv_cache``: the KV cache's storage, its element type and per-token-head scales.
- ``options``: what each option means and the one-line start-up refusals.
"""
