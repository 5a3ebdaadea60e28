"""Counter-based randomness: every random number the engine uses is a hash of (seed, output
position, purpose, vocab id), never the state of a generator.

So a request draws the same numbers whatever it is batched with, after preemption, on whichever
worker produces a given token, and whether or not its tokens were drafted speculatively: the
plain sampler's draw for output position n uses ``purpose`` SAMPLE (the seed itself); the
rejection sampler of draft-model speculation (``spec/rejection.py``) takes its accept/reject coin
and its residual draw from other purposes, so they never reuse the sampler's numbers.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _i64(x: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch stores."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)
# float32's largest value below 1 (its spacing there is 2^-24)
_BELOW_ONE = 1.0 - 2.0**-24

# What a draw is for. SAMPLE is 0 so the plain sampler's noise is a function of the seed alone.
SAMPLE = 0
ACCEPT = 1  # rejection sampling: the uniform that accepts a drafted token with min(1, p/q)
RESIDUAL = 2  # rejection sampling: the draw from the residual max(0, p - q) after a rejection
DRAFT = 3  # a draft model drawing its draft token from q


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    # logical right shift on int64 (torch's >> is arithmetic)
    return (x >> n) & ((1 << (64 - n)) - 1)


def purpose_seeds(seeds: torch.Tensor, purpose: int) -> torch.Tensor:
    """The seeds of draws for ``purpose``: the seeds themselves for SAMPLE, else a fixed odd
    offset per purpose (the splitmix64 hash in ``uniform_noise`` decorrelates the streams)."""
    if purpose == SAMPLE:
        return seeds
    return seeds + _i64(purpose * 0xD1B54A32D192ED03)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """U(0,1) noise [B, V] from splitmix64 of (seed, step, vocab id); int64 math wraps. Every
    value is strictly inside (0, 1) in float32, so -log(u) is finite and positive."""
    device = seeds.device
    vocab = torch.arange(vocab_size, dtype=torch.int64, device=device)
    x = (seeds * _GOLDEN + steps * _MIX1)[:, None] + vocab[None, :] * _MIX2
    x = x ^ _shr(x, 30)
    x = x * _MIX1
    x = x ^ _shr(x, 27)
    x = x * _MIX2
    x = x ^ _shr(x, 31)
    top53 = _shr(x, 11).to(torch.float64)
    u = ((top53 + 0.5) / float(1 << 53)).to(torch.float32)
    # The cast rounds the draws within 2^-25 of 1 up to 1.0: one in 2^25, so one row in ~700
    # over a 50k vocabulary. Every caller races argmax(p / E) with E = -log(u), and -log(1.0) is
    # -0.0: p / E was a NaN where p = 0 (a token masked by a grammar, or cut by top-k / top-p),
    # which argmax picks, and -inf where p > 0, a token never drawn. So u stays below 1.
    return u.clamp_(max=_BELOW_ONE)
