"""The local multiple-choice task, ``pdserve_mcq``, as lm-eval defines it in tasks/pdserve_mcq.yaml.

One place for what both sides of the comparison must agree on: the questions
(``tasks/mcq.jsonl``), the context and continuation strings lm-eval builds from a question, how
lm-eval splits them into tokens, and how a choice is picked from the log-likelihoods.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

TASK_DIR = Path(__file__).resolve().parent / "tasks"
DATA = TASK_DIR / "mcq.jsonl"
TASK_NAME = "pdserve_mcq"
TARGET_DELIMITER = " "  # lm-eval's default between a multiple-choice context and each choice


@dataclass(frozen=True)
class Question:
    question: str
    choices: list[str]
    answer: int

    @property
    def context(self) -> str:  # doc_to_text in the task YAML
        return f"Question: {self.question}\nAnswer:"

    @property
    def continuations(self) -> list[str]:
        return [TARGET_DELIMITER + c for c in self.choices]


@dataclass(frozen=True)
class Scored:
    """One question's log-likelihood per choice and what it picks."""

    lls: list[float]
    choice_chars: list[int]  # len(choice), lm-eval's acc_norm divisor
    answer: int

    @property
    def pick(self) -> int:
        return max(range(len(self.lls)), key=lambda i: self.lls[i])

    @property
    def pick_norm(self) -> int:
        return max(range(len(self.lls)), key=lambda i: self.lls[i] / self.choice_chars[i])


def load_questions(path: Path = DATA) -> list[Question]:
    with open(path) as fh:
        return [Question(**json.loads(line)) for line in fh if line.strip()]


def encode_pair(
    encode: Callable[[str], list[int]], context: str, continuation: str
) -> tuple[list[int], list[int]]:
    """Context and continuation tokens the way lm-eval's API models split them: trailing spaces
    of the context move to the continuation, the whole string is encoded once, and the
    continuation is what follows the context's own encoding."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation = context[-spaces:] + continuation
        context = context[:-spaces]
    whole = encode(context + continuation)
    context_ids = encode(context)
    return context_ids, whole[len(context_ids) :]


def accuracy(scored: Sequence[Scored]) -> tuple[float, float]:
    """(acc, acc_norm) as lm-eval computes them for a multiple_choice task."""
    n = len(scored)
    acc = sum(s.pick == s.answer for s in scored) / n
    acc_norm = sum(s.pick_norm == s.answer for s in scored) / n
    return acc, acc_norm
