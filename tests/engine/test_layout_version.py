"""A rollout's model version is part of the KV layout fingerprint: KV that one version's weights
computed is never pulled into another's decode (the gateway pairs by layout id, the KV client
refuses a foreign fingerprint), nor read back from another's disk tier."""

from __future__ import annotations

from pdserve.shared.kv.layout import layout_id
from tests.engine_support import make_engine


def test_an_explicit_model_version_enters_the_fingerprint(llama_dir) -> None:
    plain = make_engine(llama_dir).layout_fingerprint()
    v2 = make_engine(llama_dir, model_version="v2").layout_fingerprint()
    v3 = make_engine(llama_dir, model_version="v3").layout_fingerprint()
    assert "model_version" not in plain  # no version named: fleets pair as before
    assert v2["model_version"] == "v2"
    assert len({layout_id(plain), layout_id(v2), layout_id(v3)}) == 3
    assert {k: v for k, v in v2.items() if k != "model_version"} == plain
