"""The checkpoint a disk tier's blocks were computed with: a digest of the model's weights.

The KV layout fingerprint names a model by its served name and shape only, so a different
checkpoint served under the same name and shape (a fine-tune, a re-conversion, a patched layer)
would load the old checkpoint's blocks from disk as its own: wrong KV, silently. The disk files'
identity therefore carries this digest beside the layout id (``block_file.py``).

**What is hashed: every byte.** xxh3-64 over, in order, ``config.json`` (RoPE and norm settings
change the KV with the same tensors), the safetensors index if any, each weight file's name,
size and whole contents, and the ``--quantization`` mode (weights quantized at load compute
other KV). A sample (the safetensors headers, sizes and some chunks) would be cheaper on a large
model, but a checkpoint that differs in a few rows of one tensor (a merged LoRA on one
projection, an edited layer) can slip between samples and serve wrong KV; a full pass cannot
miss a changed byte. xxh3 is not a cryptographic hash: this guards against accidents, not
against someone who can already replace the weights.

**Cost.** The loader has just read the files, so they are usually in the page cache: xxh3 runs
at several GB/s on one core (SmolLM2-135M's 538 MB fp32 safetensors: ~0.12 s on this VM's
vCPU). It runs on the disk tier's own thread as its first job, in 8 MiB reads (each hash call
holds the GIL for about a millisecond), so neither the start nor the engine thread waits for
it: until it is done the disk tier is simply empty.
"""

from __future__ import annotations

import json
from pathlib import Path

import xxhash

CHUNK = 8 << 20


def weight_files(model_dir: Path) -> list[Path]:
    """The files whose bytes make the model: its config, the index and every weight file."""
    index = model_dir / "model.safetensors.index.json"
    files = [model_dir / "config.json"]
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        return [*files, index, *(model_dir / s for s in shards)]
    return [*files, model_dir / "model.safetensors"]


def weights_digest(model_dir: Path, quantization: str = "none") -> str:
    """16 hex digits that change whenever any byte of the model's weights or config does."""
    h = xxhash.xxh3_64()
    for path in weight_files(Path(model_dir)):
        h.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
    h.update(f"quantization={quantization}".encode())
    return h.hexdigest()
