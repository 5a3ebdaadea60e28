"""Multi-LoRA throughput in the engine: a batch mixing 4 adapters against the base model alone.

Three variants of one workload, ``--batch`` requests decoding ``--tokens`` tokens each (greedy,
EOS ignored), the same prompt, in rounds that alternate them (each round starting with the next
one), so machine noise hits each alike; the figure is each variant's median output tokens per
second over the rounds:

- ``base``: an engine without ``--lora-modules``, base-model requests (the reference);
- ``base_on_lora_engine``: the LoRA engine (4 adapters resident), base-model requests only;
- ``mixed_4_adapters``: the LoRA engine, requests cycling through the 4 adapters (2 each at
  batch 8) in one batch.

The adapters are random, rank ``--rank`` on every projection (q/k/v/o, gate/up/down), written
as PEFT directories here (``adapter_config.json`` + ``adapter_model.safetensors``). Both engines
run their default path (on a CPU: the compiled decode step).

    python -m perf.lora_bench [--model smollm2-135m-instruct] [--batch 8] [--tokens 64] \
        [--rounds 5] [--json perf/results/lora_bench.json]

``--base-only`` measures what ``--enable-lora`` costs traffic that uses no adapter: the same
base-model batch on an engine without LoRA and on one with ``--enable-lora`` and the 4 adapters
loaded and resident (each used once at warm-up, none in the measured batches). The two run back
to back in each round, which one first alternating; the figure is the median over the rounds
of each round's ratio (LoRA engine / plain engine), so a load swing between rounds cancels.

    python -m perf.lora_bench --base-only --threads 1 --rounds 9 \
        --json perf/results/lora_base_only.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdserve.services.engine.engine import LLMEngine
from pdserve.services.engine.model_config import ModelConfig
from pdserve.shared.config import EngineConfig
from pdserve.shared.sampling import SamplingParams


def write_adapter(cfg: ModelConfig, out: Path, rank: int, seed: int) -> Path:
    """A random PEFT LoRA directory for ``cfg``'s every projection."""
    gen = torch.Generator().manual_seed(seed)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = {
        "self_attn.q_proj": (h, q),
        "self_attn.k_proj": (h, kv),
        "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (q, h),
        "mlp.gate_proj": (h, inter),
        "mlp.up_proj": (h, inter),
        "mlp.down_proj": (inter, h),
    }
    tensors = {}
    for layer in range(cfg.num_layers):
        for name, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    targets = [n.split(".")[1] for n in shapes]
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def run(engine: LLMEngine, prompt: list[int], sp: SamplingParams, loras: list[str | None]):
    """Seconds and output tokens of one batch, every request added before the first step."""
    start = time.perf_counter()
    for i, lora in enumerate(loras):
        engine.add_request(f"b{time.perf_counter_ns()}-{i}", prompt, sp, lora=lora)
    tokens = 0
    while engine.has_unfinished():
        result = engine.step()
        if result is not None:
            tokens += sum(len(o.new_token_ids) for o in result.outputs)
    return time.perf_counter() - start, tokens


def engines(args: argparse.Namespace, enable_lora: bool = False):
    """The engine without LoRA, the one with the 4 adapters, and their names."""
    common = dict(model=args.model, dtype="float32", num_kv_blocks=512)
    base = LLMEngine(EngineConfig(**common))
    cfg = base.model_config
    tmp = Path(tempfile.mkdtemp(prefix="lora_bench-"))
    names = [f"adapter{i}" for i in range(4)]
    modules = [f"{n}={write_adapter(cfg, tmp / n, args.rank, i)}" for i, n in enumerate(names)]
    lora = LLMEngine(
        EngineConfig(
            **common,
            lora_modules=modules,
            enable_lora=enable_lora,
            max_loras=4,
            max_lora_rank=args.rank,
        )
    )
    return base, lora, names


def base_only(args: argparse.Namespace) -> dict:
    """Base-model batches on the plain engine and on the ``--enable-lora`` one, per round."""
    base, lora, names = engines(args, enable_lora=True)
    prompt = list(range(100, 132))
    warm = SamplingParams(temperature=0.0, max_tokens=4)
    run(base, prompt, warm, [None] * args.batch)
    run(lora, prompt, warm, names)  # every adapter resident: loaded, then unused
    assert lora.lora is not None and sorted(lora.lora.resident) == names
    run(lora, prompt, warm, [None] * args.batch)
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    rates: dict[str, list[float]] = {"plain": [], "enable_lora": []}
    ratios = []
    for r in range(args.rounds):
        pair = [("plain", base), ("enable_lora", lora)]
        for name, engine in pair if r % 2 == 0 else pair[::-1]:
            seconds, n = run(engine, prompt, sp, [None] * args.batch)
            rates[name].append(n / seconds)
        ratios.append(rates["enable_lora"][-1] / rates["plain"][-1])
    print(f"base-only traffic, batch {args.batch}, {args.tokens} tokens, {args.model}")
    for name, v in rates.items():
        print(f"{name:>12} {statistics.median(v):>7.1f} tok/s (median)")
    print(f"enable_lora / plain: median of per-round ratios {statistics.median(ratios):.3f}")
    return {
        "variant": "base_only",
        "tokens_per_second": {k: round(statistics.median(v), 1) for k, v in rates.items()},
        "rounds": {k: [round(x, 1) for x in v] for k, v in rates.items()},
        "ratios": [round(x, 3) for x in ratios],
        "median_ratio": round(statistics.median(ratios), 3),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--base-only", action="store_true", help="--enable-lora's cost, base traffic")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args()
    if args.threads:  # on the loaded 2-vCPU VM, 2 threads ran far slower than 1 (contention)
        torch.set_num_threads(args.threads)
    meta = {
        "model": args.model,
        "batch": args.batch,
        "tokens": args.tokens,
        "rank": args.rank,
        "rounds": args.rounds,
        "torch_threads": torch.get_num_threads(),
    }
    if args.base_only:
        payload = {**meta, "results": base_only(args)}
        if args.json:
            Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
        return

    base, lora, names = engines(args)
    prompt = list(range(100, 132))
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    todo = {
        "base": (base, [None] * args.batch),
        "base_on_lora_engine": (lora, [None] * args.batch),
        "mixed_4_adapters": (lora, [names[i % 4] for i in range(args.batch)]),
    }
    for engine, loras in todo.values():  # warm-up: loads the adapters, first calls
        run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=4), loras)
    rates: dict[str, list[float]] = {name: [] for name in todo}
    order = list(todo)
    for r in range(args.rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            engine, loras = todo[name]
            seconds, n = run(engine, prompt, sp, loras)
            rates[name].append(n / seconds)
    ref = statistics.median(rates["base"])
    results = {
        name: {
            "tokens_per_second": round(statistics.median(v), 1),
            "ratio_to_base": round(statistics.median(v) / ref, 3),
            "rounds": [round(x, 1) for x in v],
        }
        for name, v in rates.items()
    }
    threads = torch.get_num_threads()
    print(f"batch {args.batch}, {args.tokens} tokens, rank {args.rank}, {args.model}, {threads=}")
    for name, res in results.items():
        print(f"{name:>22} {res['tokens_per_second']:>9} tok/s  {res['ratio_to_base']:>6}x")
    if args.json:
        Path(args.json).write_text(json.dumps({**meta, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
