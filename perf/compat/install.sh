#!/usr/bin/env bash
# Install one client tool into its own venv outside the repo:
#   perf/compat/install.sh guidellm|lm-eval|aiperf|langchain|anthropic
# The venv lives in $PDSERVE_COMPAT_DIR/<tool> (default ~/.cache/pdserve-compat/<tool>), so the
# tools' dependencies (their own transformers, datasets, ...) never touch pdserve's .venv.
# torch goes in first, pinned to the CPU build already on this machine: otherwise the tools'
# dependency on torch pulls a multi-GB CUDA build from PyPI.
set -euo pipefail

TORCH="torch==2.13.0"
# lm-eval's api extra does not bring transformers, which its huggingface tokenizer backend (what
# local-completions uses to split context and continuation into tokens) imports.
declare -A PINS=(
  [guidellm]="guidellm==0.8.1"
  [lm-eval]="lm-eval[api]==0.4.13 transformers"
  [aiperf]="aiperf==0.13.0"
  [langchain]="langchain==1.5.2 langchain-openai==1.8.1"
  [anthropic]="anthropic==2.10.0"
)
# Anthropic's SDK needs no torch: its venv is the SDK alone.
declare -A NO_TORCH=([anthropic]=1)

tool="${1:?usage: install.sh guidellm|lm-eval|aiperf|langchain|anthropic}"
pin="${PINS[$tool]:?unknown tool '$tool' (guidellm, lm-eval, aiperf, langchain or anthropic)}"
if [[ -n "${NO_TORCH[$tool]:-}" ]]; then TORCH=""; fi
root="${PDSERVE_COMPAT_DIR:-$HOME/.cache/pdserve-compat}"
venv="$root/$tool"
# The same interpreter as pdserve's .venv: the CPU torch wheel on this machine is for it.
python="${PDSERVE_COMPAT_PYTHON:-python3.11}"

marker="$venv/.pdserve-compat-installed"  # written last: what a complete install put there
if [[ -f "$marker" && "$(cat "$marker")" == "$TORCH $pin" ]]; then
  echo "$tool: already installed in $venv"
  exit 0
fi
mkdir -p "$root"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
if [[ -n "$TORCH" ]]; then "$venv/bin/python" -m pip install -q "$TORCH"; fi
# shellcheck disable=SC2086  # $pin may name several requirements
"$venv/bin/python" -m pip install -q $pin
echo "$TORCH $pin" >"$marker"
if [[ -n "$TORCH" ]]; then
  echo "$tool: installed $pin with $("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)') in $venv"
else
  echo "$tool: installed $pin in $venv"
fi
