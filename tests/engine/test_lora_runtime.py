"""LoRA adapters loaded and unloaded at run time (``LLMEngine.load_lora`` / ``unload_lora``,
the engine commands behind ``POST /v1/load_lora_adapter``): an engine started with
``--enable-lora`` and no modules serves an adapter loaded later exactly as HF + PEFT; the
refusals (a name twice, a rank above ``--max-lora-rank``, a bad directory); an unload while a
request runs under the adapter waits for it (it finishes with the right tokens), new requests
are refused at once, and the slot frees when it ends."""

from __future__ import annotations

import pytest

from pdserve.shared.errors import ModelLoadError
from pdserve.shared.sampling import SamplingParams
from tests.engine_support import make_engine, random_prompts, step_outputs
from tests.lora_support import build_adapter, peft_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter(checkpoints, tmp_path_factory):
    base = checkpoints["llama-gqa"]
    root = tmp_path_factory.mktemp("lora-rt")
    return base, build_adapter(base, root / "a", seed=3, rank=8), root


def answer(engine, future):
    """Apply the posted command (a step) and return its answer."""
    engine.step()
    return future.result(timeout=0)


def test_load_at_run_time_matches_hf_peft(adapter):
    base, path, _ = adapter
    engine = make_engine(base, enable_lora=True)
    assert engine.lora_names() == ()
    prompt = random_prompts(1, seed=9)[0]
    with pytest.raises(ValueError):
        engine.add_request("early", prompt, GREEDY, lora="a")
    assert answer(engine, engine.load_lora("a", str(path))) is None
    assert engine.lora_names() == ("a",)
    engine.add_request("r", prompt, GREEDY, lora="a")
    out: list[int] = []
    while engine.has_unfinished():
        out += [t for o in step_outputs(engine) for t in o.new_token_ids]
    assert out == peft_greedy(base, path, [prompt], GREEDY.max_tokens)[0]


def test_load_refusals(adapter, tmp_path):
    base, path, root = adapter
    engine = make_engine(base, enable_lora=True, max_lora_rank=4)
    with pytest.raises(ModelLoadError, match="above --max-lora-rank"):
        answer(engine, engine.load_lora("a", str(path)))
    with pytest.raises(ModelLoadError, match="cannot read"):
        answer(engine, engine.load_lora("x", str(tmp_path)))
    small = build_adapter(base, root / "small", seed=4, rank=4)
    answer(engine, engine.load_lora("s", str(small)))
    with pytest.raises(ModelLoadError, match="already loaded"):
        answer(engine, engine.load_lora("s", str(small)))
    with pytest.raises(KeyError):
        answer(engine, engine.unload_lora("nope"))


def test_no_enable_lora_refuses_loads(adapter):
    base, path, _ = adapter
    engine = make_engine(base)
    with pytest.raises(ValueError, match="--enable-lora"):
        answer(engine, engine.load_lora("a", str(path)))


def test_unload_waits_for_running_requests(adapter):
    base, path, _ = adapter
    engine = make_engine(base, enable_lora=True)
    answer(engine, engine.load_lora("a", str(path)))
    prompt = random_prompts(1, seed=11)[0]
    engine.add_request("long", prompt, GREEDY, lora="a")
    out: list[int] = [t for o in step_outputs(engine) for t in o.new_token_ids]
    assert engine.lora is not None and engine.lora.resident == ["a"]
    deferred = engine.unload_lora("a")
    out += [t for o in step_outputs(engine) for t in o.new_token_ids]
    assert deferred.result(timeout=0) is False  # deferred: the request still runs
    assert engine.lora_names() == ()
    with pytest.raises(ValueError):  # new requests are refused at once
        engine.add_request("new", prompt, GREEDY, lora="a")
    assert engine.lora.resident == ["a"]  # its slot is kept for the running request
    while engine.has_unfinished():
        out += [t for o in step_outputs(engine) for t in o.new_token_ids]
    assert out == peft_greedy(base, path, [prompt], GREEDY.max_tokens)[0]
    assert engine.lora.resident == [] and "a" not in engine.lora.modules
    # the name may be loaded again once gone
    assert answer(engine, engine.load_lora("a", str(path))) is None


def test_request_posted_before_unload_still_runs(adapter):
    """A request checked on the caller's thread before the unload, applied after it: the
    adapter stays until that request ends too (commands are applied in order)."""
    base, path, _ = adapter
    engine = make_engine(base, enable_lora=True)
    answer(engine, engine.load_lora("a", str(path)))
    prompt = random_prompts(1, seed=12)[0]
    engine.add_request("r", prompt, GREEDY, lora="a")
    gone = engine.unload_lora("a")  # posted after the request: it runs it out
    out: list[int] = []
    while engine.has_unfinished():
        out += [t for o in step_outputs(engine) for t in o.new_token_ids]
    assert gone.result(timeout=0) is False
    assert out == peft_greedy(base, path, [prompt], GREEDY.max_tokens)[0]
    assert engine.lora_names() == () and engine.lora is not None and not engine.lora.modules
