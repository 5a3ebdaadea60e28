"""One role's profiling run, in a process of its own, set up as ``pdserve up`` sets up a worker of
that role: the launcher's CPU share as this process's affinity (given before it starts, so every
thread torch makes inherits it), the torch threads a worker takes (``set_torch_threads``), the
engine built from the same ``EngineConfig``, a prefill engine prefill-only.

- **prefill**: one prompt of each length on the idle engine, timed from ``add_request`` to its
  first token (what a prefill worker spends on it, chunking included). Prompts are random token
  ids, a fresh one per repetition, so the prefix cache never turns a repetition into a hit. The
  median of a few repetitions, fewer where one takes long, taken in rounds over the lengths.
- **decode**: ``batch`` sequences of ``context`` tokens enter as a decode worker's requests do
  (``remote_kv``: blocks allocated, the KV "pulled"), then whole engine steps are timed after one
  warm-up step, in a few passes over the grid; a cell's ITL is the median of its steps. The KV
  bytes are never written: a step's cost does not depend on their values, and computing 8 x 4k
  prompts first would take minutes on a CPU. The pool is
  sized to hold the largest cell, so the grid is complete; the capacity a served decode worker
  has (``kv_capacity_tokens``) is computed from the engine's own options as the worker sizes it.

    python -m pdserve.services.control.planner.measure SPEC.json OUT.json

Why the median, not the fastest, and why in rounds: the profile stands for what a worker
typically takes, and the planner sizes the fleet from it. On an idle 2-vCPU VM, twenty 128-token
prefills in a row took 438-715 ms (median 546), in slow and fast phases seconds long, with no
steal time and nothing else running: the host's neighbours, whom the served stack meets too. The
fastest of four was 20% below the median, and the simulator's TTFT sat that far below the real
stack's (perf/planner_calibrate.py). Measured in one go, a cell's repetitions fall in one phase,
so rounds over the lengths and passes over the decode grid spread them across the run. The median
still drops a burst of another process's work on a shared machine; the live planner's correction
factor (observed / profiled latency) takes up what a worker meets beyond.

SPEC holds the role, the engine options and the lengths; OUT receives the points, or
``{"error": ...}`` (exit 2 for a problem of the input, 1 for anything else).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import platform
import random
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from pdserve.shared.config import EngineConfig
from pdserve.shared.errors import StartupError

BAD_INPUT = 2
PROMPT_HEADROOM = 1  # a prefill samples one token past its prompt


class ProfileInputError(ValueError):
    """The spec cannot be measured (no length fits the model, a grid too large for memory)."""


def progress(text: str) -> None:
    print(f"pdserve plan: {text}", file=sys.stderr, flush=True)


def _prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def measure_prefill(engine: Any, lens: list[int], reps: int, rep_seconds: float) -> list[list]:
    """[prompt_len, tokens/s, repetitions] per length that fits the engine's context."""
    from pdserve.shared.sampling import SamplingParams

    rng, vocab = random.Random(0), engine.model_config.vocab_size
    sampling = SamplingParams(temperature=0.0, max_tokens=1)
    counter = 0

    def one(n: int) -> float:
        nonlocal counter
        counter += 1
        rid = f"plan-prefill-{counter}"
        engine.add_request(rid, _prompt(rng, vocab, n), sampling)
        start = time.perf_counter()
        while True:
            result = engine.step()
            if result is not None and any(o.bus_id == rid for o in result.outputs):
                break
            if not engine.has_unfinished():
                raise RuntimeError(f"a {n}-token prompt finished without a first token")
        elapsed = time.perf_counter() - start
        engine.release(rid)  # a prefill-only engine parks the blocks for a pull: free them
        while engine.has_unfinished():
            engine.step()
        return elapsed

    one(lens[0])  # warm-up: first-call allocations and kernel choices
    times: dict[int, list[float]] = {n: [] for n in lens}

    def wanted(n: int) -> bool:
        done = times[n]
        return len(done) < reps and (not done or sum(done) < rep_seconds)

    # in rounds, a repetition of each length that wants one: a length's repetitions are spread
    # over the run, so a slow phase of the host lands on several lengths, not on one whole
    while any(wanted(n) for n in lens):
        for n in filter(wanted, lens):
            times[n].append(one(n))
    points = []
    for n in lens:
        seconds = statistics.median(times[n])
        points.append([n, n / seconds, len(times[n])])
        progress(f"prefill {n:>6} tokens: {n / seconds:9.1f} tok/s ({1000 * seconds:.0f} ms)")
    return points


class _DecodeCells:
    """Times decode cells on one engine: ``batch`` fresh sequences of ``context`` tokens each."""

    def __init__(self, engine: Any, steps: int) -> None:
        from pdserve.shared.sampling import SamplingParams

        self.engine, self.steps, self.count = engine, steps, 0
        self.rng, self.vocab = random.Random(1), engine.model_config.vocab_size
        self.sampling = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)

    def seconds(self, batch: int, context: int) -> list[float]:
        """``steps`` whole engine steps, timed after one warm-up step."""
        engine, ids = self.engine, []
        for _ in range(batch):
            self.count += 1
            ids.append(f"plan-decode-{self.count}")
            prompt, first = _prompt(self.rng, self.vocab, context), self.rng.randrange(self.vocab)
            engine.add_request(ids[-1], prompt, self.sampling, (first,), True)
        result = engine.step()  # admits them: their blocks allocated, one pull each
        pulls = result.pulls if result is not None else []
        if len(pulls) != batch:
            raise RuntimeError(f"batch {batch} x {context}: {len(pulls)} admitted")
        for pull in pulls:
            engine.kv_ready(pull.bus_id)
        times = []
        for _ in range(self.steps + 1):
            start = time.perf_counter()
            result = engine.step()
            times.append(time.perf_counter() - start)
            ran = result.stats.num_seqs if result is not None else 0
            if ran != batch:  # a smaller batch would be timed under this one's name
                raise RuntimeError(f"batch {batch} x {context}: a step ran {ran} sequences")
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        return times[1:]


def measure_decode(
    engine: Any, batches: list[int], contexts: list[int], steps: int, passes: int = 1
) -> list[list]:
    """[batch, context, ITL ms] for every cell of the grid: the median of its steps, ``steps`` in
    each of ``passes`` passes over the grid. Passes spread a cell's steps over the run: a slow
    phase of a shared host lasts seconds, as long as a few cells, and measured in one go those
    cells would carry it whole (batch 2 read 59-78 ms in three profiles of one quiet hour). A
    throwaway cell first: the first cell on a fresh engine read 15-25% slow (allocator and caches
    settling) on a CPU and a GPU alike, beyond what one warm-up step absorbs."""
    cells = _DecodeCells(engine, steps)
    cells.seconds(batches[0], contexts[0])
    times: dict[tuple[int, int], list[float]] = {(b, c): [] for c in contexts for b in batches}
    for _ in range(passes):
        for batch, context in times:
            times[batch, context] += cells.seconds(batch, context)
    points = []
    for (batch, context), cell in times.items():
        itl = 1000.0 * statistics.median(cell)
        points.append([batch, context, itl])
        progress(f"decode batch {batch:>3} at context {context:>6}: ITL {itl:8.1f} ms")
    return points


def cap_lengths(values: list[int], limit: int, what: str) -> list[int]:
    """``values`` capped at ``limit``: a longer one is measured at the limit itself, so the
    profile reaches the longest the model takes (no clamped guesses up to there)."""
    if limit < 1:
        raise ProfileInputError(f"no {what} fits the model's context")
    kept = sorted({min(v, limit) for v in values})
    if max(values) > limit:
        progress(f"{what} capped at {limit} tokens (the model's context)")
    return kept


def decode_pool_blocks(batch: int, context: int, steps: int, block_size: int) -> int:
    """KV blocks that admit ``batch`` sequences of ``context`` tokens and let them run
    ``steps`` + 1 steps: each one's blocks, one more each for growth, and the scheduler's
    admission headroom (1% of the pool, scheduler.py's watermark) on top."""
    need = batch * (math.ceil((context + steps + 2) / block_size) + 1)
    return need + need // 50 + 2


def _check_memory(config: EngineConfig, cfg: Any, blocks: int) -> None:
    """On a CPU, refuse a profiling pool that would not fit in free memory (an OOM kill says
    nothing); a GPU that runs out raises, and that is reported."""
    from pdserve.services.engine.loader import resolve_device_dtype
    from pdserve.services.engine.model_setup import cache_spec
    from pdserve.services.engine.parallel.shard import Shard

    device, dtype = resolve_device_dtype(config.device, config.dtype)
    if device.type != "cpu":
        return
    need = blocks * cache_spec(config, cfg, dtype, Shard()).bytes_per_block
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > 0.7 * free:
        raise ProfileInputError(
            f"the decode grid needs {need / 2**30:.1f} GiB of KV cache, more than this machine "
            f"can spare ({free / 2**30:.1f} GiB free): lower --decode-batches or --decode-contexts"
        )


def hardware(device: Any) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return name


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from pdserve.services.engine.engine import LLMEngine
    from pdserve.services.engine.model_config import ModelConfig
    from pdserve.services.engine.model_setup import num_blocks_for
    from pdserve.services.worker_process import set_torch_threads
    from pdserve.shared.models.resolve import resolve

    role, started = spec["role"], time.perf_counter()
    config = EngineConfig(**spec["engine"])
    threads = set_torch_threads(config.torch_threads)  # as a worker sizes its pool
    cfg = ModelConfig.from_dir(resolve(config.model).path)
    context = config.max_model_len or cfg.max_position_embeddings
    out: dict[str, Any] = {
        "role": role,
        "threads": threads,
        "cpus": sorted(os.sched_getaffinity(0)),
    }
    if role == "prefill":
        engine = LLMEngine(config, prefill_only=True)
    else:
        steps = spec["steps"]
        contexts = cap_lengths(spec["contexts"], context - steps - 8, "decode contexts")
        batches = spec["batches"]
        blocks = decode_pool_blocks(batches[-1], contexts[-1], steps, config.block_size)
        _check_memory(config, cfg, blocks)
        # the profiling pool holds the grid; the served pool is the options' own (below)
        engine = LLMEngine(dataclasses.replace(config, num_kv_blocks=blocks))
    try:  # close() stops a TP engine's other ranks, whatever happens here
        if role == "prefill":
            limit = engine.max_model_len - PROMPT_HEADROOM
            lens = cap_lengths(spec["lens"], limit, "prompt lengths")
            out["points"] = measure_prefill(engine, lens, spec["reps"], spec["rep_seconds"])
        else:
            passes = spec.get("passes", 1)
            out["points"] = measure_decode(engine, batches, contexts, steps, passes)
            out["kv_capacity_tokens"] = num_blocks_for(config, engine.kv_spec) * config.block_size
    finally:
        engine.close()
    out.update(
        model=engine.model_name,
        device=engine.device.type,
        dtype=str(engine.dtype).removeprefix("torch."),
        hardware=hardware(engine.device),
        seconds=round(time.perf_counter() - started, 1),
    )
    return out


def main(argv: list[str]) -> int:
    logging.basicConfig(level=os.environ.get("PDSERVE_LOG_LEVEL", "ERROR"))
    spec_path, out_path = Path(argv[0]), Path(argv[1])
    try:
        result, rc = run(json.loads(spec_path.read_text())), 0
    except (ProfileInputError, StartupError) as exc:
        result, rc = {"error": str(exc)}, BAD_INPUT
    except Exception as exc:  # reported by the parent in one line; the traceback goes here
        traceback.print_exc()
        result, rc = {"error": f"{type(exc).__name__}: {exc}"}, 1
    out_path.write_text(json.dumps(result))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
