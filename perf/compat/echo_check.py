"""pdserve_mcq scored through ``/v1/completions`` with ``echo: true, max_tokens: 0`` directly:
the scoring request of lm-eval versions and other harnesses that ask for no generated token
(lm-eval 0.4.13 asks for one and drops it). One request per question, its four choices as a
prompt array of token ids; the continuation's log-probs are the echoed prompt's last tokens."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

from perf.compat.hf_mcq import OracleResult
from perf.compat.lmeval_run import compare, matches_oracle
from perf.compat.mcq import Question, Scored, encode_pair, load_questions
from perf.compat.stack import Stack
from perf.compat.tool import ToolResult, pdserve_errors

NAME = "echo, max_tokens 0 (direct)"


def _post(url: str, body: dict) -> dict:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def score(stack: Stack, encode, q: Question) -> Scored:
    pairs = [encode_pair(encode, q.context, c) for c in q.continuations]
    body = {
        "model": stack.model,
        "prompt": [context + continuation for context, continuation in pairs],
        "max_tokens": 0,
        "echo": True,
        "logprobs": 1,
        "temperature": 0,
    }
    answer = _post(stack.base_url + "/v1/completions", body)
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    if len(choices) != len(pairs):
        raise ValueError(f"{len(choices)} choices for {len(pairs)} prompts")
    lls = []
    for (context, continuation), choice in zip(pairs, choices, strict=True):
        logprobs = choice["logprobs"]["token_logprobs"]
        if len(logprobs) != len(context) + len(continuation):
            raise ValueError(
                f"{len(logprobs)} token log-probs for a prompt of "
                f"{len(context) + len(continuation)} tokens and max_tokens 0"
            )
        lls.append(sum(logprobs[len(context) :]))
    return Scored(lls, [len(c) for c in q.choices], q.answer)


def run_echo_check(
    stack: Stack, tokenizer_dir: Path, oracle: OracleResult, exact: bool = True
) -> ToolResult:
    """exact: as in ``lmeval_run.run_lm_eval``."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    start = time.monotonic()
    try:
        ours = [score(stack, encode, q) for q in load_questions()]
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        errors = pdserve_errors(text) or [text[:300]]
        return ToolResult(NAME, "-", False, f"HTTP {exc.code}: {errors[0]}", errors, {})
    except (ValueError, KeyError, TypeError) as exc:
        return ToolResult(NAME, "-", False, f"unexpected answer: {exc!r}", [repr(exc)], {})
    details = compare(ours, oracle)
    ok = matches_oracle(details) or not exact
    summary = (
        f"acc {details['acc']:.4f} (HF {details['hf_acc']:.4f}), same choice on "
        f"{details['same_picks']}/{details['questions']}, max |ll - HF ll| "
        f"{details['max_abs_ll_diff']:.1e}"
    )
    return ToolResult(NAME, "-", ok, summary, [], details, time.monotonic() - start)
