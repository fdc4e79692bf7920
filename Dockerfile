# posttrain training image: CUDA runtime + torch (CUDA wheels) + posttrain with its cloud extras.
# Build and push: see docs/kubernetes.md ("The image"). Tags are pinned; never use :latest.
FROM nvidia/cuda:13.0.0-cudnn-runtime-ubuntu24.04

# The torch wheel brings its own CUDA libraries; its CUDA major must match the base image's (cu130 ↔ 13.0)
# and the nodes' driver must support it. Override both together, e.g. --build-arg TORCH_INDEX=.../cu128
# with a 12.8 base image.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

# Ubuntu 24.04's python3 is 3.12 (posttrain needs >= 3.11).
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY posttrain ./posttrain
# constraints.txt pins every dependency; torch==X also accepts the X+cu130 wheel installed above.
RUN pip install -c constraints.txt ".[s3,prometheus,nvml]" \
    && python -c "import posttrain, torch; print('posttrain', posttrain.__version__, 'torch', torch.__version__)"

RUN useradd --create-home --uid 1000 posttrain
USER posttrain
WORKDIR /workspace
CMD ["posttrain", "--help"]
