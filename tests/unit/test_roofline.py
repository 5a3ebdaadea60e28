"""The roofline's arithmetic (shared/telemetry/roofline.py), model-free: a forward pass's FLOPs
and bytes against hand-computed values for a tiny model (a prefill chunk, a decode batch, a
speculative verification; INT8 weights and an int8 KV cache), the two sides of the ridge and
their advice, and the worker series and the gateway's re-export (roofline_metrics.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pdserve.shared.bus.discovery_messages import WorkerLoad
from pdserve.shared.bus.protocol import decode, encode
from pdserve.shared.telemetry.metrics import WorkerLoadCollector, render_metrics
from pdserve.shared.telemetry.roofline import (
    Cost,
    ModelCost,
    ModelShape,
    Peaks,
    Storage,
    advice,
    roofline,
    step_shape,
)
from pdserve.shared.telemetry.roofline_metrics import RooflineMetrics

# 2 layers, hidden 8, 2 query heads and 1 KV head of 4, 16 MLP channels, 32 vocabulary rows
SHAPE = ModelShape(
    num_layers=2,
    hidden_size=8,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    intermediate_size=16,
    lm_head_rows=32,
)
# per layer: q 8x8, k 4x8, v 4x8, o 8x8, gate 16x8, up 16x8, down 8x16 = 64+32+32+64+384 = 576
LINEAR_PARAMS = 2 * 576
FP32 = Storage(
    layer_weight_bytes=LINEAR_PARAMS * 4,  # 4608
    lm_head_bytes=32 * 8 * 4,  # 1024
    embedding_row_bytes=8 * 4,  # 32
    kv_token_bytes=2 * 2 * 1 * 4 * 4,  # layers x (K, V) x KV heads x head_dim x 4 bytes = 64
)
# INT8 weights: 1 byte each plus a float32 scale per output channel; per layer the outputs are
# qkv 16 + o 8 + gate/up 32 + down 8 = 64 channels
INT8 = Storage(
    layer_weight_bytes=LINEAR_PARAMS * 1 + 2 * 64 * 4,  # 1152 + 512 = 1664
    lm_head_bytes=32 * 8 * 1 + 32 * 4,  # 256 + 128 = 384
    embedding_row_bytes=8 * 4,  # the embedding stays float
    kv_token_bytes=FP32.kv_token_bytes,
)
# an int8 KV cache: a byte per value plus a float32 scale per token and head: 32 bytes a token
KV_INT8 = Storage(
    FP32.layer_weight_bytes,
    FP32.lm_head_bytes,
    FP32.embedding_row_bytes,
    kv_token_bytes=2 * 2 * 1 * (4 * 1 + 4),
)


def test_the_model_counts_every_projection_of_every_layer() -> None:
    assert SHAPE.linear_params == LINEAR_PARAMS == 1152


def test_a_prefill_chunk_that_ends_its_prompt() -> None:
    # one prompt of 5 tokens, nothing cached: positions 0..4 attend to 1+2+3+4+5 = 15 keys;
    # over its fresh K/V (no page read); its last position's logits are computed
    shape = step_shape([5], [0], num_paged=0, prefill_paged=False, logit_rows=1, lm_head_calls=1)
    assert (shape.tokens, shape.attended, shape.kv_read_tokens) == (5, 15, 0)
    assert shape.phase == "prefill"
    flops = (
        2 * 1152 * 5  # linear layers: 11520
        + 4 * 2 * 2 * 4 * 15  # attention: 4 x layers x heads x head_dim x pairs = 960
        + 2 * 8 * 32 * 1  # LM head over one row: 512
    )
    moved = 4608 + 1024 + 5 * 32 + 5 * 64  # weights, head, 5 embedding rows, 5 tokens' K/V written
    assert ModelCost(SHAPE, FP32).cost(shape) == Cost(flops, moved) == Cost(12992, 6112)


def test_a_middle_chunk_reads_its_cached_prefix_and_computes_no_logits() -> None:
    # tokens 5..7 of a prompt whose first 5 are cached: 3x5 + (1+2+3) = 21 pairs; the chunk's
    # group attends through the pages, reading the 5 cached and its 3 new tokens' K/V there
    shape = step_shape([3], [5], num_paged=0, prefill_paged=True, logit_rows=0, lm_head_calls=0)
    assert (shape.attended, shape.kv_read_tokens) == (21, 8)
    flops = 2 * 1152 * 3 + 4 * 2 * 2 * 4 * 21  # no LM head
    moved = 4608 + 3 * 32 + (8 + 3) * 64  # no LM head weight read either
    assert ModelCost(SHAPE, FP32).cost(shape) == Cost(flops, moved)


def test_a_decode_batch() -> None:
    # three sequences with 4, 7 and 10 cached tokens, one new token each: 5 + 8 + 11 = 24 pairs,
    # and decode attention reads each one's whole context, the new token's K/V included
    shape = step_shape(
        [1, 1, 1], [4, 7, 10], num_paged=3, prefill_paged=False, logit_rows=3, lm_head_calls=1
    )
    assert (shape.tokens, shape.attended, shape.kv_read_tokens) == (3, 24, 24)
    assert shape.phase == "decode"
    flops = 2 * 1152 * 3 + 4 * 2 * 2 * 4 * 24 + 2 * 8 * 32 * 3  # 6912 + 1536 + 1536
    moved = 4608 + 1024 + 3 * 32 + (24 + 3) * 64  # KV: 24 read, 3 written
    assert ModelCost(SHAPE, FP32).cost(shape) == Cost(flops, moved) == Cost(9984, 7456)


def test_a_speculative_verification() -> None:
    # 7 tokens cached, its last token and 2 drafts computed at positions 7, 8, 9: 8 + 9 + 10 =
    # 27 pairs; every one of the 3 positions samples, so 3 rows of logits
    shape = step_shape([3], [7], num_paged=1, prefill_paged=False, logit_rows=3, lm_head_calls=1)
    assert (shape.tokens, shape.attended, shape.kv_read_tokens) == (3, 27, 10)
    assert shape.phase == "decode"
    flops = 2 * 1152 * 3 + 4 * 2 * 2 * 4 * 27 + 2 * 8 * 32 * 3  # 6912 + 1728 + 1536
    moved = 4608 + 1024 + 3 * 32 + (10 + 3) * 64
    assert ModelCost(SHAPE, FP32).cost(shape) == Cost(flops, moved) == Cost(10176, 6560)


def test_a_mixed_step_is_prefill_and_adds_up_its_rows() -> None:
    # a decode (3 cached), a verification (5 cached, 1 draft), a fresh 4-token prompt chunk
    shape = step_shape(
        [1, 2, 4],
        [3, 5, 0],
        num_paged=2,
        prefill_paged=False,
        logit_rows=1 + 2 + 1,
        lm_head_calls=1,
    )
    assert shape.phase == "prefill"
    assert shape.attended == 4 + (6 + 7) + (1 + 2 + 3 + 4)
    assert shape.kv_read_tokens == (3 + 1) + (5 + 2)  # the fresh chunk reads no page
    assert shape.tokens == 7


def test_int8_weights_and_an_int8_kv_cache_change_only_their_bytes() -> None:
    decode = step_shape([1, 1, 1], [4, 7, 10], 3, False, 3, 1)
    fp32, int8, kv8 = (ModelCost(SHAPE, s).cost(decode) for s in (FP32, INT8, KV_INT8))
    assert int8.flops == kv8.flops == fp32.flops  # the arithmetic is the same
    assert int8.bytes == 1664 + 384 + 3 * 32 + 27 * 64 == 3872  # weights 4x smaller + scales
    assert kv8.bytes == 4608 + 1024 + 3 * 32 + 27 * 32 == 6592  # 27 tokens' K/V at half size
    assert int8.intensity > fp32.intensity and kv8.intensity > fp32.intensity


# ridge: 10 FLOP/byte
PEAKS = Peaks(
    flops_per_s=100e9, bytes_per_s=10e9, device="test", dtype="float32", threads=1, measured_at=0.0
)


def test_roofline_classifies_both_sides_of_the_ridge() -> None:
    assert PEAKS.ridge == 10
    # 1 GFLOP over 1 GB in 0.2 s: intensity 1, 5 GB/s = half the bandwidth, 5% of the compute
    low = roofline(Cost(1e9, 1e9), 0.2, PEAKS)
    assert low.bound == "memory" and low.intensity == 1
    assert (low.bandwidth_fraction, low.compute_fraction) == pytest.approx((0.5, 0.05))
    assert (low.flops_per_s, low.bytes_per_s) == pytest.approx((5e9, 5e9))
    # 100 GFLOP over 1 GB in 2 s: intensity 100, half the compute, 5% of the bandwidth
    high = roofline(Cost(100e9, 1e9), 2.0, PEAKS)
    assert high.bound == "compute" and high.intensity == 100
    assert (high.compute_fraction, high.bandwidth_fraction) == pytest.approx((0.5, 0.05))
    assert roofline(Cost(10e9, 1e9), 1.0, PEAKS).bound == "compute"  # on the ridge
    assert roofline(Cost(9.9e9, 1e9), 1.0, PEAKS).bound == "memory"
    assert Cost(1.0, 0.0).intensity == math.inf
    with pytest.raises(ValueError):
        roofline(Cost(1.0, 1.0), 0.0, PEAKS)


def test_advice_names_the_roof_the_phase_sits_at() -> None:
    decode = advice("decode", roofline(Cost(1e9, 1e9), 0.125, PEAKS))  # 80% of bandwidth
    assert decode.startswith("decode at 80% of memory bandwidth")
    assert "INT8" in decode and "more decode workers" in decode
    slow = advice("decode", roofline(Cost(1e9, 1e9), 1.0, PEAKS))  # 10% of bandwidth
    assert slow.startswith("decode at 10% of memory bandwidth (memory-bound, far below the roof)")
    assert "overhead" in slow
    prefill = advice("prefill", roofline(Cost(100e9, 1e9), 1.25, PEAKS))  # 80% of compute
    assert prefill.startswith("prefill at 80% of peak compute")
    assert (
        "more prefill workers" in prefill and "INT8 weights or a bigger batch will not" in prefill
    )
    slow = advice("prefill", roofline(Cost(100e9, 1e9), 10.0, PEAKS))  # 10% of compute
    assert slow.startswith("prefill at 10% of peak compute (compute-bound, far below the roof)")
    assert all("\n" not in line for line in (decode, prefill))


@dataclass
class Step:  # the StepStats fields RooflineMetrics reads
    phase: str
    flops: float
    bytes: float
    seconds: float


def samples(registry: CollectorRegistry) -> dict[tuple, float]:
    text = render_metrics(registry)[0].decode()
    return {
        (s.name, *sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_worker_series_span_totals_and_the_gateway_re_export() -> None:
    registry = CollectorRegistry()
    m = RooflineMetrics(registry, "decode")
    assert m.step(Step("prefill", 1e9, 1e8, 0.5)) is None  # no peaks yet: counters only
    m.set_peaks(PEAKS)
    r = m.step(Step("decode", 1e9, 1e9, 0.2))
    assert r is not None and r.bound == "memory" and r.bandwidth_fraction == pytest.approx(0.5)
    mark = m.decode_mark()  # a request whose first output came from that decode step
    assert mark == (0.0, 0.0, 0.0)
    assert m.step(Step("decode", 0.0, 0.0, 0.0)) is None  # a step without a forward pass
    m.step(Step("decode", 3e9, 1e9, 0.3))
    span = m.since(mark)  # both decode steps: 4 GFLOP, 2 GB in 0.5 s
    assert span.intensity == 2 and span.bandwidth_fraction == pytest.approx(0.4)
    assert m.since(m.decode_mark()) is not None and m.since(None) is None

    got = samples(registry)
    role = ("role", "decode")
    assert got[("pdserve_worker_step_flops_total", ("phase", "decode"), role)] == 4e9
    assert got[("pdserve_worker_step_bytes_total", ("phase", "prefill"), role)] == 1e8
    assert got[("pdserve_worker_step_busy_seconds_total", ("phase", "decode"), role)] == 0.5
    assert got[("pdserve_worker_step_bandwidth_fraction_count", ("phase", "decode"), role)] == 2
    assert got[("pdserve_worker_step_compute_fraction_count", ("phase", "prefill"), role)] == 0
    assert got[("pdserve_worker_step_arithmetic_intensity_count", ("phase", "prefill"), role)] == 1
    assert got[("pdserve_worker_peak_bytes_per_second", role)] == 10e9

    # the heartbeat carries the totals over the wire; the gateway re-exports them per worker
    load = WorkerLoad("d0", "decode", "m", 1, 2, 0, 0, **m.load_fields())
    load = decode(encode(load))
    gateway = CollectorRegistry()
    gateway.register(WorkerLoadCollector(lambda: [load]))
    got = samples(gateway)
    key = (("phase", "decode"), role, ("worker", "d0"))
    assert got[("pdserve_step_flops_total", *key)] == 4e9
    assert got[("pdserve_step_bytes_total", *key)] == 2e9
    assert got[("pdserve_step_busy_seconds_total", *key)] == 0.5
    assert got[("pdserve_step_flops_total", ("phase", "prefill"), role, ("worker", "d0"))] == 1e9
    assert got[("pdserve_peak_flops_per_second", role, ("worker", "d0"))] == 100e9
