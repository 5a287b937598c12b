# Two entry points (README quick start):
#   make serve   set up .venv if missing, then start the Serve cluster with the shipped default models
#   make test    set up .venv if missing, then run the test suite (what CI runs)
# Both run `make web` (the playground's browser device; needs node and npm, skipped with a note without them).
# torch is installed first and pinned (a CPU wheel is cached on our machines; an unpinned torch pulls GBs of
# CUDA packages). GPU users: `make setup TORCH_SPEC=torch` or install their own torch into .venv first.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# reference implementations the tests compare against, kept OFF sys.path: torch-fidelity's FID Inception
# (installed without its torchvision dependency, for which no wheel exists beside the pinned CPU torch)
REFERENCE := $(VENV)/reference
REFERENCE_STAMP := $(REFERENCE)/.installed
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup test test-slow serve load clean-venv browser onnx web

$(STAMP): pyproject.toml client/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ./client
	$(BIN)/python -m pip install --quiet -e ".[serve,load,test,export]"
	touch $(STAMP)

$(REFERENCE_STAMP): | $(STAMP)
	$(BIN)/python -m pip install --quiet --no-deps --target $(REFERENCE) "torch-fidelity==0.4.0"
	touch $(REFERENCE_STAMP)

setup: $(STAMP)

# the playground's browser test drives the system chromium (Debian's package; Playwright's downloads are not used):
# installed here when missing (as root, or with password-less sudo); CIAR_CHROMIUM names another binary
CHROMIUM ?= $(or $(CIAR_CHROMIUM),$(shell command -v chromium || command -v chromium-browser))

browser:
	@if [ -n "$(CHROMIUM)" ]; then echo "browser: $(CHROMIUM)"; \
	elif command -v apt-get >/dev/null; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo "sudo -n" ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null \
	  || { echo "could not install chromium (the playground's browser test needs it): apt-get install chromium, or set CIAR_CHROMIUM" >&2; exit 1; }; \
	else echo "no chromium and no apt-get: install chromium and set CIAR_CHROMIUM to its binary" >&2; exit 1; fi

# the playground's browser device: onnxruntime-web, pinned by web/package-lock.json and served by the ingress at
# /web/ort/ (services/web.py); installed again when the lockfile is newer than the install. Without npm the
# cluster still serves and GET /web/ort/ says how to enable it.
NPM ?= $(shell command -v npm)
ORT := web/node_modules/onnxruntime-web

web:
	@if [ -d $(ORT) ] && [ web/node_modules/.package-lock.json -nt web/package-lock.json ]; then \
	  echo "web: onnxruntime-web $$(sed -n 's/^  "version": "\(.*\)",/\1/p' $(ORT)/package.json)"; \
	elif [ -n "$(NPM)" ]; then $(NPM) ci --prefix web --ignore-scripts --no-audit --no-fund --loglevel=error; \
	else echo "web: no npm, so the playground's browser device is disabled (install node and npm, then: make web)"; fi

test: $(STAMP) $(REFERENCE_STAMP) browser web
	$(BIN)/python -m pytest -m "not slow and not gpu" $(PYTEST_ARGS)

test-slow: $(STAMP) $(REFERENCE_STAMP)
	$(BIN)/python -m pytest -m "slow" $(PYTEST_ARGS)

# a busy laptop can miss Serve's 5 s proxy readiness check; give it a minute
SERVE_ENV := RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S=60 RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S=60

# the device model exported for real devices (ONNX; generated from the committed safetensors, served by the ingress)
SHIPPED := weights/scenes-v2
ONNX := $(SHIPPED)/onnx/manifest.json
$(ONNX): $(STAMP) $(SHIPPED)/device.safetensors $(SHIPPED)/tokenizer.safetensors $(SHIPPED)/cloud.safetensors pipelines/export_onnx.py
	$(BIN)/python -m pipelines.export_onnx

onnx: $(ONNX)

serve: $(STAMP) $(ONNX) web
	$(SERVE_ENV) $(BIN)/serve run serve_config.yaml

# a 30 s ramp to 8 users against a cluster it starts and stops itself (summary in runs/load/summary.json)
load: $(STAMP)
	$(SERVE_ENV) $(BIN)/python -m loadtests.run --users 8 --duration 30 --scenario ramp --out runs/load

clean-venv:
	rm -rf $(VENV)
