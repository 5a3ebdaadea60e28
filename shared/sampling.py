"""Per-request sampling parameters and their bounds: one definition that the gateway's request
validation, the wire protocol's checker and the engine's sampler all use."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_TEMPERATURE = 2.0
MAX_TOP_K = 2**31 - 1  # any token id: the wire protocol's bound
MAX_SEED = 2**63 - 1
MAX_MAX_TOKENS = 1 << 20  # the wire protocol's token-list bound
MAX_STOP_TOKEN_IDS = 1024


@dataclass(frozen=True)
class Bound:
    lo: float
    hi: float
    lo_open: bool = False  # lo itself is not allowed

    def admits(self, value: float) -> bool:
        above = value > self.lo if self.lo_open else value >= self.lo
        return above and value <= self.hi


BOUNDS: dict[str, Bound] = {
    "temperature": Bound(0.0, MAX_TEMPERATURE),
    "top_p": Bound(0.0, 1.0, lo_open=True),
    "top_k": Bound(-1, MAX_TOP_K),  # -1 is off; 0 is refused here (the API maps 0 to -1)
    "seed": Bound(-MAX_SEED, MAX_SEED),
    "max_tokens": Bound(1, MAX_MAX_TOKENS),
}


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 disables top-k
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        for name, bound in BOUNDS.items():
            value = getattr(self, name)
            if value is not None and not bound.admits(value):
                raise ValueError(f"{name} must be in {_describe(bound)}, got {value}")
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (off) or >= 1, got 0")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _describe(bound: Bound) -> str:
    return f"{'(' if bound.lo_open else '['}{bound.lo:g}, {bound.hi:g}]"
