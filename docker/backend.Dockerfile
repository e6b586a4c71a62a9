# kvroute backend worker for Linux: one MLX model behind an OpenAI-compatible HTTP API,
# advertising its prompt cache in Redis. CPU (mlx[cpu]) by default; CUDA by build arg:
#
#   docker build -f docker/backend.Dockerfile -t kvroute-backend .                       # CPU
#   docker build -f docker/backend.Dockerfile -t kvroute-backend:cuda --build-arg MLX_EXTRA=cuda13 .
#   docker run --rm --gpus all ... kvroute-backend:cuda                                 # host driver >= 580
#
# On Apple silicon do not use this image: Docker on macOS has no Metal, so backends
# there run natively (see docs/DEPLOY.md).
#
# Without KVROUTE_MODEL the backend serves the tiny built-in demo model, which it builds
# on first start (about a second, offline) into KVROUTE_CACHE_DIR=/cache. Mount a volume
# there: it also holds Hugging Face downloads (HF_HOME=/cache/huggingface), so a model is
# fetched once and shared by every backend container mounting the same volume.
#
# Build args:
#   BASE_IMAGE  any Debian/Ubuntu image with glibc >= 2.35 (MLX's Linux wheels need it);
#               python3 is installed from apt when the image has none. Default
#               python:3.11-slim-bookworm. The CUDA wheels bring the CUDA libraries as pip
#               packages; if MLX then reports it cannot find the CUDA headers (its run-time
#               kernel compiler needs them), use a devel image such as
#               nvidia/cuda:13.0.0-devel-ubuntu24.04, which has /usr/local/cuda/include.
#   MLX_EXTRA   which MLX build: cpu (default), cuda13 (driver >= 580) or cuda12 (driver >= 550).
#
# Why not `pip install .[cuda]`: pyproject.toml requires mlx[cpu] on Linux unconditionally,
# and mlx-cpu and mlx-cuda-* both install mlx/lib/libmlx.so, so `.[cuda]` installs two
# builds over each other and whichever pip writes last wins. This file installs kvroute's
# declared dependencies with only the mlx extra swapped for MLX_EXTRA (same version
# bounds, read back from the wheel's metadata), then kvroute itself with --no-deps.
#
# Only the paths named in COPY below are read from the build context.

ARG BASE_IMAGE=python:3.11-slim-bookworm

# --- build: a virtual environment in /opt/venv ---------------------------------------
FROM ${BASE_IMAGE} AS build
ARG MLX_EXTRA=cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    DEBIAN_FRONTEND=noninteractive
RUN python3 -c "import ensurepip" 2>/dev/null || { apt-get update \
      && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
      && rm -rf /var/lib/apt/lists/*; }
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvroute ./kvroute

RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip wheel --no-deps --wheel-dir /tmp/wheels . \
 && MLX_EXTRA="${MLX_EXTRA}" /opt/venv/bin/python -c "import email, glob, os, re, zipfile; w = zipfile.ZipFile(glob.glob('/tmp/wheels/kvroute-*.whl')[0]); meta = email.message_from_bytes(w.read([n for n in w.namelist() if n.endswith('.dist-info/METADATA')][0])); extra = os.environ['MLX_EXTRA']; [print(re.sub(r'^mlx\[[^]]*\]', 'mlx[%s]' % extra, r)) for r in meta.get_all('Requires-Dist') if 'extra ==' not in r]" > /tmp/requirements.txt \
 && cat /tmp/requirements.txt \
 && /opt/venv/bin/pip install -r /tmp/requirements.txt \
 && /opt/venv/bin/pip install --no-deps /tmp/wheels/kvroute-*.whl
# A CPU build can be exercised here: import MLX and build the demo model once.
# (A CUDA build cannot: libcuda comes from the host driver at run time.)
RUN if [ "${MLX_EXTRA}" = cpu ]; then \
      /opt/venv/bin/python -c "import mlx.core, mlx_lm, kvroute.backend.boot" \
      && /opt/venv/bin/kvroute demo-model /tmp/demo-check > /dev/null && rm -rf /tmp/demo-check; \
    fi

# --- runtime -----------------------------------------------------------------------------
FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
RUN command -v python3 >/dev/null || { apt-get update \
      && apt-get install -y --no-install-recommends python3 ca-certificates \
      && rm -rf /var/lib/apt/lists/*; }
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KVROUTE_HOST=0.0.0.0 \
    KVROUTE_CACHE_DIR=/cache \
    HF_HOME=/cache/huggingface \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/kvroute \
      --shell /usr/sbin/nologin kvroute \
 && mkdir -p /cache && chown kvroute:kvroute /cache
COPY --from=build /opt/venv /opt/venv
USER kvroute
WORKDIR /home/kvroute
EXPOSE 8100
# The backend listens once its model is loaded: give a first download time to finish.
# /health needs no internal token. The port follows KVROUTE_PORT; a --port flag needs it set too.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('KVROUTE_PORT', '8100'), timeout=4)"]
ENTRYPOINT ["kvroute", "backend"]
