"""Speculative decoding (n-gram prompt lookup, a draft model) on and off, in-process, on a real
model.

Two workloads (``perf/spec_workloads.py``), chat-templated as the gateway does: input-grounded
("rewrite this paragraph / code with one change": the answer copies the prompt) and open-ended
questions, the latter greedy and sampled (temperature 0.7, seeded). Each runs at batch 1 (the
prompts one after another) and batch 8 (all at once) on one engine per mode - speculation off,
n-gram with adaptive K (the default), and n-gram with a fixed K (``--spec-token-cost 0``) - the
modes alternating within each repetition so drift on a shared machine hits them alike. Reports
output tokens/s of each mode's fastest repetition (the least disturbed on a shared machine) and
the speed-up over off (also of the medians), the draft acceptance rate
(accepted / draft tokens), the mean acceptance length (tokens a verified draft emits: 1 +
accepted / drafts), and whether every output is token-identical to speculation off. The
speed-up counts whole requests, prompts' prefill included (which speculation does not change:
at batch 1 on SmolLM2 about a fifth of the first repetition with n-gram on); ``decode`` is the
speed-up of the decode steps alone (steps with no prompt chunk), what speculation acts on.

With ``--draft-model DIR`` the draft-model modes run too (adaptive and fixed K); for SmolLM2 a
draft is its own first layers, ``python -m perf.make_draft DIR --layers 10``.

    python -m perf.spec_bench [--model smollm2-135m-instruct] [--reps 3] [--draft-model DIR]
                              [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pdserve.services.engine.engine import LLMEngine
from pdserve.services.engine.spec.speculator import SpecCounters
from pdserve.shared.config import EngineConfig
from pdserve.shared.sampling import SamplingParams
from perf import spec_workloads

MODES = {  # name -> engine options (the draft modes take --draft-model too)
    "off": {},
    "ngram": {"speculative": "ngram"},
    "ngram-fixed-k": {"speculative": "ngram", "spec_token_cost": 0.0},
    "draft": {"speculative": "draft"},
    "draft-fixed-k": {"speculative": "draft", "spec_token_cost": 0.0},
}


@dataclass
class Case:
    workload: str
    batch: int
    prompts: list[list[int]]
    sampling: SamplingParams


@dataclass
class ModeResult:
    tokens_per_s: float  # of the fastest repetition (the least disturbed on a shared machine)
    median_tokens_per_s: float = 0.0
    seconds: list[float] = field(default_factory=list)
    decode_seconds: list[float] = field(default_factory=list)  # of steps with no prompt chunk
    output_tokens: int = 0
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    draft_tokens: int = 0
    identical_to_off: bool | None = None
    speedup: float | None = None
    median_speedup: float | None = None
    decode_speedup: float | None = None  # of the decode steps alone, fastest repetitions


@dataclass
class CaseResult:
    workload: str
    batch: int
    modes: dict[str, ModeResult]


def chat_prompts(model_dir: Path, messages: list[str]) -> list[list[int]]:
    """Token ids of each message as a one-turn chat, rendered as the gateway renders it."""
    from pdserve.gateway.api_models import ChatMessage
    from pdserve.gateway.tokenizer import ChatTemplate, ModelTokenizer

    tok = ModelTokenizer.from_dir(model_dir)
    assert tok.chat_template is not None, "the model has no chat template"
    chat = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)
    return [
        tok.encode(chat.render([ChatMessage("user", m)]), add_special_tokens=False)
        for m in messages
    ]


WORKLOADS = ("input-grounded", "open-ended", "open-ended T=0.7")


def cases(model_dir: Path, batch1_prompts: int, max_tokens: int) -> list[Case]:
    grounded = chat_prompts(model_dir, spec_workloads.input_grounded())[:8]
    open_ended = chat_prompts(model_dir, spec_workloads.open_ended())[:8]
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    sampled = SamplingParams(temperature=0.7, seed=1234, max_tokens=max_tokens)
    out = []
    for name, prompts, sp in (
        ("input-grounded", grounded, greedy),
        ("open-ended", open_ended, greedy),
        ("open-ended T=0.7", open_ended, sampled),
    ):
        # batch 1 takes prompts from both kinds of text (paragraphs and code alternate)
        out.append(Case(name, 1, prompts[:batch1_prompts], sp))
        out.append(Case(name, 8, prompts[:8], sp))
    return out


@dataclass
class CaseRun:
    seconds: float  # to serve the case's prompts
    decode_seconds: float  # of it, in steps with no prompt chunk
    outputs: list[list[int]]
    spec: SpecCounters  # the speculation it did


def run_case(engine: LLMEngine, case: Case) -> CaseRun:
    """The case's prompts served, ``case.batch`` at a time (``LLMEngine.generate``'s loop, with
    each step timed)."""
    before = _counters(engine)
    outputs: list[list[int]] = []
    decode = 0.0
    start = time.perf_counter()
    for i in range(0, len(case.prompts), case.batch):
        ids = [f"{case.workload}-{i + j}" for j in range(len(case.prompts[i : i + case.batch]))]
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        for rid, prompt in zip(ids, case.prompts[i : i + case.batch], strict=True):
            engine.add_request(rid, prompt, case.sampling)
        while engine.has_unfinished():
            step_start = time.perf_counter()
            result = engine.step()
            if result is not None and result.stats.phase == "decode":
                decode += time.perf_counter() - step_start
            for out in result.outputs if result else ():
                tokens[out.bus_id].extend(out.new_token_ids)
        outputs += [tokens[rid] for rid in ids]
    seconds = time.perf_counter() - start
    return CaseRun(
        seconds=seconds,
        decode_seconds=decode,
        outputs=outputs,
        spec=_counters(engine).since(before),
    )


def _counters(engine: LLMEngine) -> SpecCounters:
    spec = engine.stats().spec
    return spec if spec is not None else SpecCounters(accepted_per_pos=[])


def measure(engines: dict[str, LLMEngine], case: Case, reps: int) -> CaseResult:
    seconds: dict[str, list[float]] = {m: [] for m in engines}
    decode: dict[str, list[float]] = {m: [] for m in engines}
    outputs: dict[str, list[list[int]]] = {}
    spec: dict[str, SpecCounters] = {}
    names = list(engines)
    for rep in range(reps):
        # alternate the order so a slow spell on a shared machine does not favour one mode
        for mode in names if rep % 2 == 0 else names[::-1]:
            run = run_case(engines[mode], case)
            seconds[mode].append(run.seconds)
            decode[mode].append(run.decode_seconds)
            outputs[mode] = run.outputs
            spec[mode] = run.spec
    off_tokens = sum(map(len, outputs["off"]))
    results: dict[str, ModeResult] = {}
    for mode in names:
        tokens = sum(map(len, outputs[mode]))
        best = min(seconds[mode])
        c = spec[mode]
        results[mode] = ModeResult(
            tokens_per_s=round(tokens / best, 2),
            median_tokens_per_s=round(tokens / statistics.median(seconds[mode]), 2),
            seconds=[round(x, 3) for x in seconds[mode]],
            decode_seconds=[round(x, 3) for x in decode[mode]],
            output_tokens=tokens,
            acceptance_rate=round(c.accepted_tokens / c.draft_tokens, 3)
            if c.draft_tokens
            else None,
            mean_acceptance_length=round(1 + c.accepted_tokens / c.drafts, 2) if c.drafts else None,
            draft_tokens=c.draft_tokens,
            identical_to_off=outputs[mode] == outputs["off"],
        )
    for mode in names:
        off = results["off"]
        results[mode].speedup = round(results[mode].tokens_per_s / off.tokens_per_s, 3)
        results[mode].median_speedup = round(
            results[mode].median_tokens_per_s / off.median_tokens_per_s, 3
        )
        # decode tokens per decode second (a request's first token came from its prefill)
        per_s = {
            m: (results[m].output_tokens - len(case.prompts)) / max(min(decode[m]), 1e-9)
            for m in ("off", mode)
        }
        results[mode].decode_speedup = round(per_s[mode] / per_s["off"], 3)
    del off_tokens
    return CaseResult(case.workload, case.batch, results)


def print_row(result: CaseResult) -> None:
    for mode, r in result.modes.items():
        acc = f"{100 * r.acceptance_rate:5.1f}%" if r.acceptance_rate is not None else "    - "
        length = f"{r.mean_acceptance_length:4.2f}" if r.mean_acceptance_length else "   -"
        same = {True: "yes", False: "NO", None: "-"}[r.identical_to_off]
        print(
            f"{result.workload:17s} {result.batch:5d}  {mode:14s} {r.tokens_per_s:8.2f} "
            f"{r.speedup:7.2f}x {r.median_speedup:7.2f}x {r.decode_speedup:7.2f}x  {acc}  "
            f"{length}  {same}",
            flush=True,
        )


def print_draft_cache(mode: str, engine: LLMEngine, off: LLMEngine, prompt: list[int]) -> None:
    """What filling the draft's cache here cost, against the target's own prefill of a prompt
    and the bytes pulling the draft's KV would add: the draft-KV decision of issue 17."""
    proposer = engine.speculator.proposer
    fill_ms = 1000 * proposer.fill_seconds / max(1, proposer.fill_tokens)
    start = time.perf_counter()  # reversed: the prompt itself is in the prefix cache by now
    off.generate([prompt[::-1]], SamplingParams(temperature=0.0, max_tokens=1))
    prefill_ms = 1000 * (time.perf_counter() - start) / len(prompt)
    draft_bytes = proposer.bytes_per_block // proposer.block_size
    target_bytes = engine.bytes_per_block // engine.block_size
    print(
        f"{mode}: prompts computed into the draft's cache here at {fill_ms:.3f} ms per token "
        f"({proposer.fill_tokens} tokens); the target's prefill takes {prefill_ms:.3f} ms per "
        f"token ({len(prompt)}-token prompt); pulling the draft's KV instead would add "
        f"{draft_bytes} bytes per token to the target's {target_bytes}"
    )


def main(argv: list[str] | None = None) -> list[CaseResult]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch1-prompts", type=int, default=8, help="prompts run one by one")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        help="default: off and the n-gram modes, and the draft modes with --draft-model",
    )
    ap.add_argument("--draft-model", help="the draft model of the draft modes (perf/make_draft.py)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--batches", nargs="+", type=int, choices=(1, 8), default=[1, 8])
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from pdserve.shared.models.resolve import resolve

    model_dir = resolve(args.model).path
    wanted = args.modes or [m for m in MODES if args.draft_model or not m.startswith("draft")]
    if any(m.startswith("draft") for m in wanted) and not args.draft_model:
        ap.error("the draft modes need --draft-model (python -m perf.make_draft DIR)")
    modes = ["off", *(m for m in wanted if m != "off")]
    draft = {"draft_model": args.draft_model}
    engines = {
        m: LLMEngine(
            EngineConfig(
                model=args.model,
                dtype="float32",
                num_kv_blocks=512,
                max_num_seqs=8,
                num_speculative_tokens=args.num_speculative_tokens,
                **MODES[m],
                **(draft if m.startswith("draft") else {}),
            )
        )
        for m in modes
    }
    all_cases = [
        c
        for c in cases(model_dir, args.batch1_prompts, args.max_tokens)
        if c.workload in args.workloads and c.batch in args.batches
    ]
    for engine in engines.values():  # warm-up: first-call allocations
        engine.generate(all_cases[0].prompts[:1], SamplingParams(temperature=0.0, max_tokens=8))
    print(
        f"{args.model}, {torch.get_num_threads()} torch threads, {args.reps} reps, "
        f"K = {args.num_speculative_tokens}, up to {args.max_tokens} tokens per answer"
    )
    print(
        "workload          batch  mode           tok/s   speed-up (median)  decode  accept  "
        "len   same"
    )
    results = []
    for case in all_cases:
        result = measure(engines, case, args.reps)
        print_row(result)
        results.append(result)
    for mode, engine in engines.items():
        if mode.startswith("draft"):
            longest = max((p for c in all_cases for p in c.prompts), key=len)
            print_draft_cache(mode, engine, engines["off"], longest)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return results


if __name__ == "__main__":
    main()
