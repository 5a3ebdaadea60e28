"""Speculative-decoding acceptance as a server's /metrics exposes it, read around a bench run.

pdserve's gateway re-exports its decode workers' totals (``pdserve_spec_decode_num_*``, one
series per worker); vLLM exports ``vllm:spec_decode_num_*``. Either is summed over its series
before and after a run, and the difference is the run's: acceptance rate = accepted / draft
tokens, mean acceptance length = 1 + accepted / drafts (vLLM's definitions). A server that
exposes neither (speculation off, or another server) reports nothing.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

# our name -> the counter family names servers use for it
FAMILIES = {
    "drafts": ("pdserve_spec_decode_num_drafts", "vllm:spec_decode_num_drafts"),
    "draft_tokens": ("pdserve_spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens"),
    "accepted_tokens": (
        "pdserve_spec_decode_num_accepted_tokens",
        "vllm:spec_decode_num_accepted_tokens",
    ),
}


@dataclass
class SpecTotals:
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0

    def since(self, before: SpecTotals) -> SpecTotals:
        return SpecTotals(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted_tokens - before.accepted_tokens,
        )


def parse_spec(text: str) -> SpecTotals | None:
    """The speculative-decoding totals in a Prometheus text page, or None without any."""
    from prometheus_client.parser import text_string_to_metric_families

    totals, found = SpecTotals(), False
    names = {family: field for field, families in FAMILIES.items() for family in families}
    for family in text_string_to_metric_families(text):
        base = family.name.removesuffix("_total")  # typed counters lose the suffix, others not
        field = names.get(base)
        if field is None:
            continue
        found = True
        value = sum(s.value for s in family.samples if s.name == base + "_total")
        setattr(totals, field, getattr(totals, field) + value)
    return totals if found else None


def scrape_metrics(base_url: str, api_key: str | None = None, timeout: float = 5.0) -> str | None:
    """``base_url``'s /metrics page; None when it cannot be read."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    req = urllib.request.Request(base_url.rstrip("/") + "/metrics", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.read().decode(errors="replace")
    except (OSError, ValueError):
        return None


def scrape_spec(
    base_url: str, api_key: str | None = None, timeout: float = 5.0
) -> SpecTotals | None:
    """``base_url``'s /metrics totals; None when it exposes none or cannot be read."""
    page = scrape_metrics(base_url, api_key, timeout)
    try:
        return parse_spec(page) if page is not None else None
    except ValueError:  # not a Prometheus page
        return None
