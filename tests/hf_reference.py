"""HF transformers on a tiny checkpoint as the oracle for what the engine computes from logits:
next-token logits and log-probs at every position, and a greedy loop whose logits a test can
process with a plain per-row reference of a sampling control."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.shared.sampling import TokenLogprobs

# (logits of the next token [V] float64, the output tokens so far) -> processed logits
Processor = Callable[[torch.Tensor, list[int]], torch.Tensor]


class HFReference:
    def __init__(self, model_dir: Path) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float64
        ).eval()

    @torch.no_grad()
    def logits(self, tokens: list[int]) -> torch.Tensor:
        """[len(tokens), V] float64: row i scores the token after ``tokens[: i + 1]``."""
        return self.model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0]

    def logprobs(self, tokens: list[int]) -> torch.Tensor:
        return torch.log_softmax(self.logits(tokens), dim=-1)

    def greedy(self, prompt: list[int], max_tokens: int, process: Processor) -> list[int]:
        out: list[int] = []
        for _ in range(max_tokens):
            logits = process(self.logits(prompt + out)[-1].clone(), out)
            out.append(int(logits.argmax()))
        return out


def assert_logprobs_match(
    got: TokenLogprobs, ref_rows: torch.Tensor, chosen: list[int], k: int, atol: float = 1e-4
) -> None:
    """Entry j of ``got`` is token ``chosen[j]`` scored by the log-probs ``ref_rows[j]``: its
    log-prob, its rank (1 + tokens strictly likelier) and the k likeliest, in order."""
    assert len(got) == len(chosen) == len(ref_rows)
    assert got.top_k == k
    for j, (ref, token) in enumerate(zip(ref_rows, chosen, strict=True)):
        assert abs(got.token_logprobs[j] - ref[token].item()) < atol, (j, token)
        assert got.ranks[j] == 1 + int((ref > ref[token]).sum()), (j, token)
        top_ref = ref.topk(k)
        top = got.top(j)
        assert [t for t, _ in top] == top_ref.indices.tolist(), j
        assert torch.allclose(
            torch.tensor([v for _, v in top], dtype=torch.float64), top_ref.values, atol=atol
        )
