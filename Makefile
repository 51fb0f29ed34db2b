# Two commands: `make run` (set-up + every notebook through papermill into reports/)
# and `make test` (set-up + pytest). Both are idempotent: set-up runs again only when
# pyproject.toml or constraints.txt change.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PIP    := $(PY) -m pip install --disable-pip-version-check -q -c constraints.txt
# Keep every cache out of the user's home folder.
export MPLCONFIGDIR            := $(CURDIR)/$(VENV)/cache/matplotlib
export IPYTHONDIR              := $(CURDIR)/$(VENV)/cache/ipython
export JUPYTER_CONFIG_DIR      := $(CURDIR)/$(VENV)/cache/jupyter_config
export JUPYTER_RUNTIME_DIR     := $(CURDIR)/$(VENV)/cache/jupyter_runtime
export JUPYTER_DATA_DIR        := $(CURDIR)/$(VENV)/cache/jupyter_data
export TORCHINDUCTOR_CACHE_DIR := $(CURDIR)/$(VENV)/cache/inductor
export TRITON_CACHE_DIR        := $(CURDIR)/$(VENV)/cache/triton
export MPLBACKEND              := Agg
export PYDEVD_DISABLE_FILE_VALIDATION := 1

.PHONY: setup run test lab lint clean

setup: $(STAMP) $(VENV)/cache

$(STAMP): pyproject.toml constraints.txt | $(VENV)/cache
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing torch==2.13.0 (CPU) first, then lora_lab with all extras into $(VENV) ..."
	$(PIP) torch==2.13.0
	$(PIP) -e '.[notebooks,diffusion,kernels,dev]'
	$(PY) -m ipykernel install --sys-prefix --name lora-lab --display-name "Python (lora-lab)" >/dev/null
	@touch $(STAMP)

$(VENV)/cache:
	@mkdir -p $(MPLCONFIGDIR) $(IPYTHONDIR) $(JUPYTER_CONFIG_DIR) $(JUPYTER_RUNTIME_DIR) $(JUPYTER_DATA_DIR) $(TORCHINDUCTOR_CACHE_DIR) $(TRITON_CACHE_DIR)

run: setup
	$(PY) -m lora_lab.notebook --out reports

# Two test workers on two cores: one torch thread each (the notebook kernels inherit it), else
# the workers' thread pools fight and small notebooks run several times slower.
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadfile -q

# JupyterLab refuses to start as root unless told; add the flag only where we are root (containers).
LAB_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root,)
lab: setup
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks $(LAB_ARGS)

lint: setup
	$(VENV)/bin/ruff check lora_lab tests benchmarks data

clean:
	rm -rf reports .pytest_cache
