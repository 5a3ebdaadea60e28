#!/usr/bin/env bash
# perf/compat/run.sh [guidellm|lm-eval|aiperf|langchain|anthropic|all] [--model NAME] [--out DIR] [--no-install]
# guidellm, lm-eval, aiperf, LangChain and Anthropic's SDK, unmodified, against a local pdserve up (see perf/compat/run.py).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo"
exec .venv/bin/python -m perf.compat.run "$@"
