"""Open a GGUF file with the ``gguf`` package (maintained with llama.cpp) and expose what the
converter needs: metadata values as plain Python, and the tensor table.

Every way a file can be unreadable (wrong magic, truncated, a metadata value of the wrong type)
becomes one ``ModelLoadError`` naming the file, so a bad download never shows as a traceback.
Nothing here imports torch: the gateway converts a GGUF's tokenizer without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.shared.errors import ModelLoadError


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str  # ggml type as llama.cpp spells it: "Q4_K", "F16", ...
    shape: tuple[int, ...]  # row-major (numpy/torch order): (rows, cols) for a matrix
    raw: Any  # the reader's memory-mapped array (blocks of bytes for quantized types)
    type_id: Any  # gguf.GGMLQuantizationType, for gguf.quants.dequantize


class GGUFFile:
    """Metadata and tensors of one GGUF file (memory-mapped, read lazily)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            import gguf
        except ImportError:
            raise ModelLoadError(
                f"{path}: reading GGUF files needs the 'gguf' package: pip install gguf"
            ) from None
        if not path.is_file():
            raise ModelLoadError(f"{path}: no such file")
        try:
            reader = gguf.GGUFReader(path)
        except Exception as exc:  # the reader raises ValueError, IndexError, KeyError...
            raise ModelLoadError(f"{path}: {_diagnose(exc)}") from None
        self._reader = reader
        self.tensors: dict[str, GGUFTensor] = {}
        for t in reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            self.tensors[t.name] = GGUFTensor(
                name=t.name,
                type_name=t.tensor_type.name,
                shape=shape,
                raw=t.data,
                type_id=t.tensor_type,
            )
        self._check_extent()

    def _check_extent(self) -> None:
        # The reader maps tensor data lazily; a file cut inside the data section would only fail
        # when that tensor is read, so check that the last byte of every tensor is in the file.
        size = self.path.stat().st_size
        for t in self._reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ModelLoadError(
                    f"{self.path}: truncated: tensor {t.name!r} ends at byte "
                    f"{t.data_offset + t.n_bytes}, the file has {size}"
                )

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as str, int, float, bool or list; ``default`` when absent."""
        field = self._reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as exc:
            raise ModelLoadError(
                f"{self.path}: unreadable metadata {key!r}: {_short(exc)}"
            ) from None

    def integer(self, key: str, default: int | None = None) -> int | None:
        value = self.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelLoadError(
                f"{self.path}: metadata {key!r} should be an integer, is {value!r}"
            )
        return value

    def number(self, key: str, default: float | None = None) -> float | None:
        value = self.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModelLoadError(f"{self.path}: metadata {key!r} should be a number, is {value!r}")
        return float(value)

    def file_type(self) -> str:
        """The dominant weight type (what a hub calls the file's quantization: "Q4_1")."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            if len(t.shape) == 2:
                counts[t.type_name] = counts.get(t.type_name, 0) + _numel(t.shape)
        return max(counts, key=counts.__getitem__) if counts else "F32"

    def num_parameters(self) -> int:
        return sum(_numel(t.shape) for t in self.tensors.values())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _diagnose(exc: BaseException) -> str:
    # The reader maps the file and slices it where the header says: past the end of a cut file a
    # slice comes back short, which shows as a failed reshape or an index into an empty array.
    if isinstance(exc, IndexError) or (isinstance(exc, ValueError) and "reshape" in str(exc)):
        return (
            "truncated: the file ends before the data its header describes (incomplete download?)"
        )
    return f"not a readable GGUF file (corrupt?): {_short(exc)}"


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
