# One image for every PlexRL service; the command picks which one runs:
#   docker run --rm plexrl:dev plexrl serve gateway|scheduler|gpu-worker|state-store
# docker-compose.yml runs all four with Kafka, Redis and Jaeger.
#
# torch comes from PyPI, which on x86_64 means the CUDA build (the GPU worker wants it).
# For a much smaller CPU-only image:
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t plexrl:dev .
FROM python:3.11-slim

ARG TORCH_INDEX_URL=

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_INPUT=1

# Dependencies first, read from pyproject.toml alone, so that a code change rebuilds only
# the last layers instead of reinstalling torch.
COPY pyproject.toml /tmp/src/pyproject.toml
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install --index-url "$TORCH_INDEX_URL" torch; fi \
 && python -c "import tomllib; print('\n'.join(tomllib.load(open('/tmp/src/pyproject.toml', 'rb'))['project']['dependencies']))" \
      > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt

COPY libs /tmp/src/libs
COPY services /tmp/src/services
RUN pip install --no-deps /tmp/src && rm -rf /tmp/src

# Run as an unprivileged user. The volume mount points exist and belong to it, so
# fresh named volumes mounted there inherit that ownership.
RUN useradd --create-home --uid 1000 plexrl \
 && mkdir -p /data/blobs /models \
 && chown plexrl:plexrl /data/blobs /models
USER plexrl
WORKDIR /home/plexrl

ENV PLEXRL_STATE_STORE_DIR=/data/blobs \
    PLEXRL_MODEL_REGISTRY=/models

# gateway, scheduler (health), gpu-worker (health), state-store
EXPOSE 8000 8100 8200 8300

CMD ["plexrl", "--help"]
