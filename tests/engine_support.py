"""Building and driving an in-process engine in tests (no thread: ``step()`` in the caller's)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from pdserve.services.engine import model_runner
from pdserve.services.engine.engine import LLMEngine
from pdserve.services.engine.outputs import StepOutput
from pdserve.shared.config import EngineConfig
from pdserve.shared.sampling import SamplingParams


def make_engine(model_dir: Path, **overrides) -> LLMEngine:
    cfg = dict(
        model=str(model_dir),
        dtype="float64",
        num_kv_blocks=64,
        block_size=16,
        max_num_batched_tokens=64,
        # the eager path unless a test asks for the compiled one (test_decode_graph.py):
        # compiling at every engine's start would cost the suite minutes
        enforce_eager=True,
    )
    kv_failure_policy = overrides.pop("kv_failure_policy", "fail")
    prefill_only = overrides.pop("prefill_only", False)
    cfg.update(overrides)
    return LLMEngine(EngineConfig(**cfg), prefill_only, kv_failure_policy)


def random_prompts(n: int, seed: int, vocab: int = 380, max_len: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


def step_outputs(engine: LLMEngine) -> list[StepOutput]:
    """One step; its outputs (none when nothing happened)."""
    result = engine.step()
    return result.outputs if result is not None else []


def prefill_then_decode(
    prefill: LLMEngine, decode: LLMEngine, bus_id: str, prompt: list[int], sp: SamplingParams
) -> tuple[list[int], list[int]]:
    """One request split as P/D splits it: ``prefill`` (a prefill-only engine) samples the first
    token(s) and lets the request go; ``decode`` continues from them to the end. Returns
    (first, rest)."""
    prefill.add_request(bus_id, prompt, sp)
    (out,) = [o for o in step_outputs(prefill) if o.bus_id == bus_id]
    prefill.release(out.bus_id)
    step_outputs(prefill)
    first = out.new_token_ids
    decode.add_request(bus_id, prompt, sp, output_token_ids=first)
    rest: list[int] = []
    while decode.has_unfinished():
        rest += [t for o in step_outputs(decode) for t in o.new_token_ids]
    return first, rest


def run_staggered(
    engine: LLMEngine, prompts: list[list[int]], sampling: SamplingParams
) -> list[list[int]]:
    """Request i joins at step i, so sequences enter and leave a batch that is already running."""
    outputs: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        if pending:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, sampling)
            outputs[f"r{i}"] = []
        for out in step_outputs(engine):
            outputs[out.bus_id].extend(out.new_token_ids)
    return [outputs[f"r{i}"] for i in range(len(prompts))]


def first_step_logits(engine, prompts: list[list[int]], monkeypatch) -> torch.Tensor:
    """The engine's logits for each prompt's next token (caught on their way to the sampler)."""
    seen: list[torch.Tensor] = []
    real = model_runner.sample

    def spy(logits, st):
        seen.append(logits.detach().clone())
        return real(logits, st)

    monkeypatch.setattr(model_runner, "sample", spy)
    engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))
    monkeypatch.setattr(model_runner, "sample", real)
    return torch.cat(seen)[: len(prompts)]
