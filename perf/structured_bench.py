"""Structured-output libraries side by side: xgrammar, llguidance, outlines-core.

For each tokenizer (the default model's, SmolLM2-135M-Instruct with 49,152 tokens, and the tests'
tiny 384-token BPE) and each library it measures:

- setup: turning the tokenizer into the library's form, plus its first grammar's first mask
  (what it builds lazily for the vocabulary): once per model;
- compile: a grammar from a spec (two JSON schemas, any JSON object, a regex, a choice), with the
  library's own cache off, plus the first mask (llguidance builds its lexer lazily, so compile
  alone would flatter it);
- per step: filling the next-token bitmask [B, ceil(V/32)] and advancing every state by one
  token, for B = 1 and 16 sequences, each replaying a valid document's tokens; B = 16 both
  through the library's batched call (a thread pool) and row by row ("loop");
- coverage: whether the library enforces what the tests need (integer bounds, maxLength, any
  JSON object at any depth, bad specs refused at compile time).

    python -m perf.structured_bench [--json perf/results/structured_bench.json] [--repeat N]
                                    [--engine smollm2-135m-instruct]

Every time is the best of N runs: on a shared machine, other load only adds to it.

llguidance is pdserve's dependency; xgrammar and outlines-core are installed by hand for the
comparison (a library that is not installed is skipped, with the command that installs it).

Grammar work runs on the CPU whatever the model's device is, so no GPU is needed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer

from perf.structured_libs import BACKENDS, Backend, TokenizerCase, tokenizer_cases

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    "gift": {"type": "boolean"},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "note": {"type": "string", "maxLength": 20},
    },
    "required": ["id", "items"],
    "additionalProperties": False,
}
EMAIL_REGEX = r"[a-z]{1,12}@[a-z]{1,12}\.(com|org|net)"
CHOICES = ["positive", "negative", "neutral"]

# (name, kind, spec, a valid document whose tokens each sequence replays)
WORKLOADS: list[tuple[str, str, str, str]] = [
    (
        "schema:person",
        "json_schema",
        json.dumps(PERSON_SCHEMA),
        '{"name":"Ada Lovelace","age":36,"role":"admin","tags":["a","c"]}',
    ),
    (
        "schema:order",
        "json_schema",
        json.dumps(ORDER_SCHEMA),
        '{"id":4711,"items":[{"sku":"ABC-123","qty":2},{"sku":"XYZ-999","qty":1,"gift":true}],'
        '"note":"leave at door"}',
    ),
    (
        "json_object",
        "json_object",
        "",
        '{"a":[1,2.5,{"b":null,"c":[true,false]}],"d":"some text","e":{"f":{"g":-3e2}}}',
    ),
    ("regex:email", "regex", EMAIL_REGEX, "ada@lovelace.org"),
    ("choice", "choice", json.dumps(CHOICES), "neutral"),
]
BATCH_SIZES = (1, 16)
# (batch, through the library's batched call): B=16 both ways, since a thread pool's hand-off can
# cost more than it saves on a small, shared machine
STEP_CASES = [(1, True), (16, True), (16, False)]


# ---- measurements ------------------------------------------------------------------------------


@dataclass
class WorkloadResult:
    workload: str
    compile_ms: float  # spec -> compiled grammar (median of repeats)
    first_mask_ms: float  # compile + first state + first mask
    doc_tokens: int
    step_us: dict[str, float] = field(default_factory=dict)  # "fill/B=1" etc: per step
    error: str = ""


@dataclass
class LibraryResult:
    library: str
    tokenizer: str
    setup_ms: float
    workloads: list[WorkloadResult] = field(default_factory=list)
    coverage: dict[str, str] = field(default_factory=dict)


def _ms(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times), out  # best of N: on a shared machine other load only adds


def _replay(
    backend: Backend, grammar, tokens: list[int], batch: int, bitmask: torch.Tensor, batched=True
):
    """(fill µs, advance µs) per step, the mean over one replay of ``tokens`` by ``batch``
    fresh states."""
    states = [backend.new_state(grammar) for _ in range(batch)]
    fill_s = advance_s = 0.0
    for token in tokens:
        t0 = time.perf_counter()
        backend.fill(states, bitmask[:batch], batched)
        t1 = time.perf_counter()
        word, bit = divmod(token, 32)
        if not (int(bitmask[0, word]) >> bit) & 1:
            raise AssertionError(f"the mask refused token {token} of a valid document")
        backend.advance(states, [token] * batch)
        fill_s += t1 - t0
        advance_s += time.perf_counter() - t1
    return fill_s / len(tokens) * 1e6, advance_s / len(tokens) * 1e6


def _setup_and_first_use(backend: Backend, tok: TokenizerCase) -> None:
    """The per-model cost: the library's tokenizer form plus whatever its first grammar builds
    lazily for the vocabulary (llguidance's token trie: seconds on 49k tokens)."""
    backend.setup(tok)
    bitmask = torch.zeros(1, (tok.vocab_size + 31) // 32, dtype=torch.int32)
    backend.fill([backend.new_state(backend.compile("regex", "[a-z]+"))], bitmask)


def measure(backend: Backend, tok: TokenizerCase, repeat: int) -> LibraryResult:
    setup_ms, _ = _ms(lambda: _setup_and_first_use(backend, tok), 1)
    result = LibraryResult(backend.name, tok.name, setup_ms)
    bitmask = torch.zeros(max(BATCH_SIZES), (tok.vocab_size + 31) // 32, dtype=torch.int32)
    for name, kind, spec, doc in WORKLOADS:
        tokens = tok.encode(doc)
        try:
            compile_ms, grammar = _ms(lambda k=kind, s=spec: backend.compile(k, s), repeat)

            def first_mask(k=kind, s=spec):
                backend.fill([backend.new_state(backend.compile(k, s))], bitmask[:1])

            first_ms, _ = _ms(first_mask, repeat)
            w = WorkloadResult(name, compile_ms, first_ms, len(tokens))
            for b, batched in STEP_CASES:
                _replay(backend, grammar, tokens, b, bitmask)  # warm-up: lazily built caches
                runs = [
                    _replay(backend, grammar, tokens, b, bitmask, batched) for _ in range(repeat)
                ]
                label = f"B={b}" + ("" if batched or b == 1 else " loop")
                w.step_us[f"fill/{label}"] = min(f for f, _ in runs)
                if batched:
                    w.step_us[f"advance/{label}"] = min(a for _, a in runs)
        except Exception as exc:  # a library that cannot do a workload says why in the table
            w = WorkloadResult(name, float("nan"), float("nan"), len(tokens), error=str(exc)[:120])
        result.workloads.append(w)
    result.coverage = coverage(backend, tok)
    return result


def _accepts(backend: Backend, grammar, tok: TokenizerCase, text: str) -> bool:
    """Whether ``text`` then EOS gets through the masks of a fresh state."""
    state = backend.new_state(grammar)
    bitmask = torch.zeros(1, (tok.vocab_size + 31) // 32, dtype=torch.int32)
    for token in [*tok.encode(text), tok.eos]:
        backend.fill([state], bitmask)
        word, bit = divmod(token, 32)
        if not (int(bitmask[0, word]) >> bit) & 1:
            return False
        if token != tok.eos:
            backend.advance([state], [token])
    return True


def coverage(backend: Backend, tok: TokenizerCase) -> dict[str, str]:
    """What the engine's tests rely on, as ok / MISSING (and why)."""
    person = backend.compile("json_schema", json.dumps(PERSON_SCHEMA))
    any_object = backend.compile("json_object", "")
    deep = '{"a":' * 8 + "1" + "}" * 8
    checks = {
        "integer maximum enforced": not _accepts(
            backend, person, tok, '{"name":"x","age":999,"role":"user"}'
        ),
        "maxLength enforced": not _accepts(
            backend, person, tok, '{"name":"abcdefghijklmnop","age":1,"role":"user"}'
        ),
        "json_object nests 8 deep": _accepts(backend, any_object, tok, deep),
    }
    out = {k: "ok" if v else "MISSING" for k, v in checks.items()}
    for label, kind, spec in [
        ("bad regex refused", "regex", "a(b"),
        ("unsupported keyword refused", "json_schema", '{"type":"object","if":{}}'),
    ]:
        try:
            backend.compile(kind, spec)
            out[label] = "MISSING (compiled)"
        except Exception:
            out[label] = "ok"
    return out


def _print(results: list[LibraryResult]) -> None:
    for r in results:
        print(f"\n== {r.library} on {r.tokenizer}: setup {r.setup_ms:.0f} ms")
        print(
            f"{'workload':16s} {'compile ms':>10s} {'1st mask ms':>11s} {'tok':>4s} "
            + " ".join(f"{k:>14s}" for k in r.workloads[0].step_us)
        )
        for w in r.workloads:
            if w.error:
                print(f"{w.workload:16s} ERROR {w.error}")
                continue
            steps = " ".join(f"{v:14.1f}" for v in w.step_us.values())
            print(
                f"{w.workload:16s} {w.compile_ms:10.2f} {w.first_mask_ms:11.2f} "
                f"{w.doc_tokens:4d} {steps}"
            )
        print("coverage:", ", ".join(f"{k}: {v}" for k, v in r.coverage.items()))


@dataclass
class EngineOverhead:
    model: str
    batch: int
    steps: int
    step_ms_unguided: float  # mean forward pass + sampling of a decode step
    step_ms_guided: float
    mask_ms: float  # mean time in GuidedDecoder.bitmask per guided step


def engine_overhead(model: str, batch: int = 16, max_tokens: int = 24) -> EngineOverhead:
    """The same decode steps of ``model`` with every row guided (PERSON_SCHEMA; ``max_tokens``
    stops them before the object closes, so every step has ``batch`` rows) and unguided."""
    from pdserve.services.engine.engine import LLMEngine
    from pdserve.shared.config import EngineConfig
    from pdserve.shared.sampling import GuidedDecoding, SamplingParams

    engine = LLMEngine(EngineConfig(model=model, num_kv_blocks=512, max_num_seqs=batch))
    tokenizer = Tokenizer.from_file(str(engine.model_dir / "tokenizer.json"))
    prompt = tokenizer.encode("A person, as a JSON object with name, age, role and tags:").ids
    guide = GuidedDecoding("json_schema", json.dumps(PERSON_SCHEMA))
    mask_s: list[float] = []
    fill = engine.guided.bitmask

    def timed_fill(*args, **kwargs):
        t0 = time.perf_counter()
        out = fill(*args, **kwargs)
        mask_s.append(time.perf_counter() - t0)
        return out

    engine.guided.bitmask = timed_fill  # type: ignore[method-assign]
    step_ms = {}
    for guided in (None, guide):
        params = [
            SamplingParams(
                temperature=0.8, seed=i, max_tokens=max_tokens, ignore_eos=True, guided=guided
            )
            for i in range(batch)
        ]
        for i, sp in enumerate(params):
            engine.add_request(f"{guided is not None}-{i}", prompt, sp)
        decode_s, mask_s[:] = [], []
        while engine.has_unfinished():
            result = engine.step()
            if result and result.stats.num_decodes == batch:
                decode_s.append(result.stats.seconds)
        step_ms[guided is not None] = statistics.mean(decode_s) * 1e3
    return EngineOverhead(
        model, batch, len(decode_s), step_ms[False], step_ms[True], statistics.mean(mask_s) * 1e3
    )


def _installed(cls: type[Backend]) -> bool:
    """llguidance is pdserve's dependency; the others are installed for this comparison only."""
    try:
        importlib.import_module(cls.module)
    except ImportError:
        print(f"skipping {cls.name}: not installed ({cls.install})", file=sys.stderr)
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--repeat", type=int, default=5, help="timings: best of N")
    parser.add_argument("--libraries", nargs="*", default=[b.name for b in BACKENDS])
    parser.add_argument(
        "--engine",
        metavar="MODEL",
        help="also time guided decode steps of "
        "MODEL (e.g. smollm2-135m-instruct) against unguided ones",
    )
    args = parser.parse_args(argv)
    overhead = engine_overhead(args.engine) if args.engine else None  # (all threads for it)
    torch.set_num_threads(1)
    results = []
    chosen = [cls for cls in BACKENDS if cls.name in args.libraries and _installed(cls)]
    for tok in tokenizer_cases():
        for cls in chosen:
            results.append(measure(cls(), tok, args.repeat))
    _print(results)
    if overhead:
        print(f"\n{overhead}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out = {"libraries": [asdict(r) for r in results]}
        out["engine"] = asdict(overhead) if overhead else None
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
