"""SmoothQuant-style smoothing and mixed precision of --quantization int8 (issue 18) in a real
engine: the calibration pass computes what the engine computes, every layer but the float ones is
smoothed, and the layers kept float stay nn.Linear. Smoothing on plain tensors (the same product,
less error on outlier channels) is tests/unit/test_int8_quant.py."""

from __future__ import annotations

import torch

from pdserve.services.engine.quant.int8_linear import CpuInt8Linear, quantize_linears
from pdserve.services.engine.quant.smooth import _plain_forward, activation_maxima
from pdserve.shared.sampling import SamplingParams
from tests.engine_support import make_engine


def test_calibration_pass_computes_what_the_engine_computes(checkpoints) -> None:
    engine = make_engine(checkpoints["llama-gqa"], dtype="float32")
    prompt = [5, 17, 99, 3, 250, 11, 42, 7, 8, 300]
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=1)
    engine.add_request("r", prompt, sp)
    chosen = None
    while engine.has_unfinished():
        result = engine.step()
        for out in result.outputs if result else ():
            if out.logprobs is not None:
                chosen = out.logprobs.token_logprobs[0]
    model = engine.runner.model
    with torch.no_grad():
        logits = model.compute_logits(_plain_forward(model, prompt)[-1:])
    assert chosen is not None
    assert abs(float(logits.log_softmax(-1).max()) - chosen) < 1e-3


def test_calibrated_quantize_smooths_every_layer_but_the_float_ones(checkpoints) -> None:
    engine = make_engine(checkpoints["llama-gqa"], dtype="float32")
    model = engine.runner.model
    names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    maxima = activation_maxima(model, list(range(3, 40)), names)
    assert set(maxima) == names and all(m.shape == (m.numel(),) for m in maxima.values())
    keep = ("lm_head", "*.down_proj")
    swapped = quantize_linears(
        model, torch.device("cpu"), torch.float32, keep_float=keep, calibration_ids=[3, 4, 5, 6]
    )
    layers = model.cfg.num_layers
    assert swapped == 3 * layers  # qkv, o and gate_up of every layer
    assert type(model.lm_head).__name__ == "Linear"
    assert all(type(layer.mlp.down_proj).__name__ == "Linear" for layer in model.layers)
    smoothed = [m for m in model.modules() if isinstance(m, CpuInt8Linear)]
    assert len(smoothed) == swapped and all(m.inv_smooth is not None for m in smoothed)


def test_the_engine_smooths_with_its_model_s_tokenizer(checkpoints) -> None:
    engine = make_engine(checkpoints["llama-gqa"], dtype="float32", quantization="int8")
    layers = [m for m in engine.runner.model.modules() if isinstance(m, CpuInt8Linear)]
    assert layers and all(m.inv_smooth is not None for m in layers)


def test_no_calibration_ids_means_no_smoothing(checkpoints) -> None:
    model = make_engine(checkpoints["llama-gqa"], dtype="float32").runner.model
    quantize_linears(model, torch.device("cpu"), torch.float32, calibration_ids=None)
    layers = [m for m in model.modules() if isinstance(m, CpuInt8Linear)]
    assert layers and all(m.inv_smooth is None for m in layers)
