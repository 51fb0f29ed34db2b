# Two commands: `make run` (set-up + every notebook through papermill into reports/, notebook 07 also on
# the other pre-trained families: FAMILIES) and `make test` (set-up + pytest; `make test-quick`: without
# the slow tests); `make report` writes reports/index.html, `make lab` opens the workbook, `make test-lab`
# tests it in a browser. Both are idempotent: set-up runs again only when pyproject.toml or
# constraints.txt change.
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
export LORA_LAB_PLAN_CACHE     := $(CURDIR)/$(VENV)/cache/plans
export LORA_LAB_NATIVE_CACHE   := $(CURDIR)/$(VENV)/cache/native
export PYDEVD_DISABLE_FILE_VALIDATION := 1
# No MPLBACKEND here: a kernel that inherits one shows no figure inline in JupyterLab. The runner
# gives its kernels the inline backend (figures in the executed copies); pytest draws with Agg.

.PHONY: setup run report test test-quick test-lab lab lint gpu clean

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

# ARGS: more of the runner's arguments, e.g. ARGS="03_lora_dora --sweep RANK=1,2,4,8 --seeds 0,1,2"
ARGS ?=
# Without ARGS, notebook 07 also runs on the other pre-trained families (its default is sd3): a sweep over
# MODEL into reports/sweeps/07_diffusion_lora-MODEL/MODEL=<family>/, afresh each time (a sweep resumes
# otherwise), in `make report`'s index. FAMILIES= (empty) leaves it out.
FAMILIES ?= z-image,chroma,flux2,qwen-image
FAMILY_SWEEP := reports/sweeps/07_diffusion_lora-MODEL
run: setup
	$(PY) -m lora_lab.notebook --out reports $(ARGS)
	$(if $(ARGS),,$(if $(FAMILIES),rm -rf $(FAMILY_SWEEP) && $(PY) -m lora_lab.notebook 07_diffusion_lora --sweep MODEL=$(FAMILIES) --out reports))

# reports/index.html from what `make run` and sweeps left in reports/ (offline: no CDN, no scripts)
report: setup
	$(PY) -m lora_lab.notebook --report --out reports

# Two test workers on two cores: one torch thread each (the notebook kernels inherit it), else
# the workers' thread pools fight and small notebooks run several times slower.
# The browser test (tests/notebook/test_lab.py) runs here too where Chromium is installed, else it is skipped.
test: setup
	MPLBACKEND=Agg OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadgroup -q

# The inner loop: every folder's quick tests, the slow ones (marked `slow`: the longest of
# `pytest --durations=0`) left out; at most 3 minutes on 2 cores. `make test` runs them all.
test-quick: setup
	MPLBACKEND=Agg OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadgroup -q -m "not slow"

# The workbook in a real browser: JupyterLab on a free loopback port, driven by Playwright on
# Debian's Chromium (installed here with apt-get when missing and we are root); fails, not skips,
# without it. Screenshots: reports/lab/.
CHROMIUM ?= /usr/bin/chromium
test-lab: setup
	@test -x $(CHROMIUM) || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing Debian's chromium for the browser test (apt-get) ..."; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  fi; }
	@test -x $(CHROMIUM) || { echo "make test-lab needs Chromium at $(CHROMIUM): sudo apt-get install -y chromium (or CHROMIUM=/path)"; exit 2; }
	LORA_LAB_CHROMIUM=$(CHROMIUM) LORA_LAB_REQUIRE_BROWSER=1 MPLBACKEND=Agg OMP_NUM_THREADS=1 $(PY) -m pytest tests/notebook/test_lab.py tests/notebook/test_report.py -q

# JupyterLab on 127.0.0.1 (LAB_ARGS="--ip=0.0.0.0" to listen elsewhere; other flags likewise). It
# prints the URL with its token. JupyterLab refuses to start as root unless told: the flag is added
# where we are root (containers), whatever LAB_ARGS holds.
LAB_ARGS ?=
LAB_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)
LAB_IP    = $(if $(findstring --ip,$(LAB_ARGS))$(findstring .ip=,$(LAB_ARGS)),,--ip=127.0.0.1)
lab: setup
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks $(LAB_IP) $(LAB_ROOT) $(LAB_ARGS)

# Everything that needs a CUDA GPU (kernels compiled, their timings, the planner at real size against
# max_memory_allocated) into one table and reports/gpu.json; without CUDA it says so and exits 0.
gpu: setup
	$(PY) benchmarks/gpu_check.py

lint: setup
	$(VENV)/bin/ruff check lora_lab tests benchmarks data

clean:
	rm -rf reports .pytest_cache
