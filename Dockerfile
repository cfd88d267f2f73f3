# One image for every PlexRL service; the command picks which one runs:
#   docker run --rm plexrl:dev plexrl serve gateway|scheduler|gpu-worker|state-store
# docker-compose.yml runs all four with Kafka, Redis, Jaeger and Prometheus.
#
# Every dependency comes from requirements.lock (exact versions, the ones the README's
# figures came from; scripts/lock.sh refreshes it), so an image built on any day holds
# the same packages. torch comes from PyPI, which on x86_64 means the CUDA build (the GPU
# worker wants it). For a much smaller CPU-only image (the lock's CUDA wheels are then
# left out, torch comes from PyTorch's CPU index at the locked version):
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t plexrl:dev .
FROM python:3.11-slim

ARG TORCH_INDEX_URL=

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_INPUT=1

# Dependencies first, from the lock alone, so that a code change rebuilds only the last
# layers instead of reinstalling torch.
COPY requirements.lock /tmp/requirements.lock
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
      torch=$(grep -E '^torch==' /tmp/requirements.lock | cut -d' ' -f1) \
      && pip install --index-url "$TORCH_INDEX_URL" "$torch" \
      && grep -v -E '^(nvidia-|cuda-|triton==)' /tmp/requirements.lock > /tmp/req.txt \
      && mv /tmp/req.txt /tmp/requirements.lock; \
    fi \
 && pip install -r /tmp/requirements.lock \
 && rm /tmp/requirements.lock

# The project itself, without touching the locked dependencies.
COPY pyproject.toml /tmp/src/pyproject.toml
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

# gateway, scheduler (health, metrics), gpu-worker (health, metrics), state-store
EXPOSE 8000 8100 8200 8300

CMD ["plexrl", "--help"]
