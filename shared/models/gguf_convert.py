"""A GGUF file -> a cached Hugging Face style directory that every pdserve process loads.

Dequantizing a GGUF takes seconds to minutes; a ``pdserve up`` starts three or more processes.
So the first load converts once, into ``<cache>/gguf/<stem>-<hash>-v<N>``, keyed by the file's
content hash (blake2b, remembered per path/size/mtime so later starts skip hashing), and later
loads open that directory at once.

Safety: one process converts while the others wait on a ``flock``; the entry is built in a
temporary directory beside it and renamed into place only when complete, so a crash half-way
leaves a ``.tmp-*`` directory that is never taken for an entry (and is removed by the next
conversion). Nothing here imports torch: the gateway can convert too.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.shared.errors import ModelLoadError

log = logging.getLogger(__name__)

# Bump when the converted output changes, so old cache entries are not reused.
CONVERTER_VERSION = 2  # 2: Q8_0 linear matrices kept as int8 values + float16 scales
SOURCE_FILE = "pdserve-source.json"  # written last: describes the GGUF the entry came from


@dataclass(frozen=True)
class GGUFSource:
    """What a cache entry says about the file it was converted from."""

    path: str
    blake2b: str
    size: int
    file_type: str  # dominant weight type, e.g. "Q4_1"
    num_parameters: int
    name: str  # general.name, may be ""

    @classmethod
    def read(cls, entry: Path) -> GGUFSource:
        raw = json.loads((entry / SOURCE_FILE).read_text())
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__})


def gguf_cache_root() -> Path:
    from pdserve.shared.models.demo import cache_dir

    return cache_dir() / "gguf"


def ensure_converted(path: Path) -> Path:
    """The cache directory for ``path`` (a .gguf file), converting it first if needed."""
    path = path.expanduser().resolve()
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such file")
    digest = file_digest(path)
    root = gguf_cache_root()
    entry = root / f"{_safe(path.stem)}-{digest[:16]}-v{CONVERTER_VERSION}"
    if (entry / SOURCE_FILE).is_file():
        return entry
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f"{entry.name}.lock"):
        if (entry / SOURCE_FILE).is_file():  # another process converted it while we waited
            return entry
        for stale in root.glob(f".{entry.name}.tmp-*"):  # a crashed conversion's leftovers
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-", dir=root))
        try:
            started = time.monotonic()
            log.info("converting %s into %s (first load of this file)", path, entry)
            convert(path, tmp, digest)
            if entry.exists():  # an incomplete entry from an older layout: replace it
                shutil.rmtree(entry)
            tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
            tmp.rename(entry)
            log.info("converted %s in %.1f s", path.name, time.monotonic() - started)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return entry


def convert(path: Path, out: Path, digest: str) -> None:
    """Write config, generation config, tokenizer and weights for ``path`` into ``out``."""
    from pdserve.shared.models.gguf_config import generation_config, hf_config
    from pdserve.shared.models.gguf_file import GGUFFile
    from pdserve.shared.models.gguf_tokenizer import build_tokenizer, tokenizer_config
    from pdserve.shared.models.gguf_weights import plan, write_safetensors

    f = GGUFFile(path)
    cfg = hf_config(f)
    planned = plan(f, cfg)  # every tensor checked before anything is written
    tokenizer = build_tokenizer(f)
    n_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    if n_tokens > cfg["vocab_size"]:
        raise ModelLoadError(
            f"{path}: the tokenizer has {n_tokens} tokens, the embedding only {cfg['vocab_size']}"
        )
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", generation_config(f))
    _write_json(out / "tokenizer_config.json", tokenizer_config(f))
    tokenizer.save(str(out / "tokenizer.json"))
    meta = {"format": "pt", "source": path.name, "source_blake2b": digest}
    try:
        write_safetensors(out / "model.safetensors", planned, meta)
    except OSError as exc:
        raise ModelLoadError(f"{out}: cannot write the converted weights: {exc}") from None
    source = GGUFSource(
        path=str(path),
        blake2b=digest,
        size=path.stat().st_size,
        file_type=f.file_type(),
        num_parameters=sum(_numel(p.source.shape) for p in planned),
        name=str(f.get("general.name") or ""),
    )
    _write_json(out / SOURCE_FILE, source.__dict__)


def file_digest(path: Path) -> str:
    """blake2b of the file's bytes, remembered by (path, size, mtime) in the cache directory."""
    st = path.stat()
    key = hashlib.blake2b(str(path).encode(), digest_size=16).hexdigest()
    memo = gguf_cache_root() / "hashes" / f"{key}.json"
    stamp = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    try:
        known = json.loads(memo.read_text())
        if {k: known.get(k) for k in stamp} == stamp and isinstance(known.get("blake2b"), str):
            return known["blake2b"]
    except (OSError, ValueError):
        pass
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    digest = h.hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        _write_json(memo, {**stamp, "blake2b": digest}, atomic=True)
    except OSError:
        pass  # a read-only cache only costs re-hashing next time
    return digest


class _locked:
    """An exclusive ``flock`` on ``path`` for the ``with`` block (released if the process dies)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1

    def __enter__(self) -> _locked:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process to convert %s", self.path.stem)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _write_json(path: Path, value: object, atomic: bool = False) -> None:
    text = json.dumps(value, indent=2, ensure_ascii=False) + "\n"
    if not atomic:
        path.write_text(text, encoding="utf-8")
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def _safe(stem: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in stem)[:80] or "model"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
