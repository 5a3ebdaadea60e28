"""A draft model for ``--speculative draft`` cut from the target itself: its first N layers, then
its final norm and LM head (early exit, as in LayerSkip's self-speculation).

SmolLM2-135M is the smallest model of its family, so there is no smaller model with its
tokenizer to draft for it offline; this makes one. Without the early-exit training LayerSkip
gives its models, a cut stack predicts the full one's tokens only part of the time: what that
buys is measured by ``perf/spec_bench.py --draft-model DIR`` (perf/README.md).

    python -m perf.make_draft OUT_DIR [--model smollm2-135m-instruct] [--layers 10]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from pdserve.shared.models.resolve import resolve

LAYER = re.compile(r"^model\.layers\.(\d+)\.")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def cut(model_dir: Path, out: Path, layers: int) -> Path:
    """Write the first ``layers`` layers of the checkpoint in ``model_dir`` to ``out``."""
    config = json.loads((model_dir / "config.json").read_text())
    if not 1 <= layers <= config["num_hidden_layers"]:
        raise SystemExit(f"--layers must be 1..{config['num_hidden_layers']}, got {layers}")
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            match = LAYER.match(name)
            if match is None or int(match.group(1)) < layers:
                tensors[name] = tensor
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors")
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, out / name)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--layers", type=int, default=10)
    args = ap.parse_args(argv)
    out = cut(resolve(args.model).path, args.out, args.layers)
    print(f"draft: the first {args.layers} layers of {args.model} in {out}")


if __name__ == "__main__":
    main()
