"""SmoothQuant-style smoothing and mixed precision of --quantization int8 (issue 18): the smoothed
CPU INT8 linear computes the same product with less error on outlier channels, the calibration
pass computes what the engine computes, and the layers kept float stay nn.Linear."""

from __future__ import annotations

import torch

from pdserve.services.engine.quant.int8_linear import CpuInt8Linear, quantize_linears
from pdserve.services.engine.quant.int8_weights import quantize_per_channel
from pdserve.services.engine.quant.smooth import _plain_forward, activation_maxima, smoothing_scales
from pdserve.shared.sampling import SamplingParams
from tests.engine_support import make_engine


def _rel_err(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float(((got - exact).norm(dim=1) / exact.norm(dim=1)).max())


def test_smoothing_keeps_the_product_and_tames_outlier_channels() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 128, generator=gen) * 0.05
    x = torch.randn(16, 128, generator=gen)
    x[:, :3] *= 80.0  # a few outlier input channels, as in SmolLM2's activations
    exact = x @ weight.T
    plain = CpuInt8Linear(quantize_per_channel(weight), None, torch.float32)(x)
    s = smoothing_scales(x.abs().amax(dim=0), weight, 0.5)
    smoothed = CpuInt8Linear(quantize_per_channel(weight * s), None, torch.float32, s)(x)
    assert _rel_err(smoothed, exact) < 0.02
    assert _rel_err(smoothed, exact) < 0.5 * _rel_err(plain, exact)


def test_smoothing_scales_follow_the_formula() -> None:
    act = torch.tensor([4.0, 1.0, 100.0])
    weight = torch.tensor([[1.0, -0.25, 0.01], [0.5, 0.5, -0.04]])
    s = smoothing_scales(act, weight, 0.5)
    expected = act.sqrt() / torch.tensor([1.0, 0.5, 0.04]).sqrt()
    torch.testing.assert_close(s, expected)


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
