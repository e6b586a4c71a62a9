# kvroute front proxy: the OpenAI endpoint that routes each request to the backend
# holding its prompt's KV cache. It never touches a model, so this image holds no
# MLX: only kvroute's own code and its network/Redis dependencies.
#
#   docker build -f docker/proxy.Dockerfile -t kvroute-proxy .      # from the repository root
#   docker run --rm -p 8000:8000 -e KVROUTE_REDIS_URL=redis://redis-host:6379 \
#     -e KVROUTE_SECRET=... -e KVROUTE_INTERNAL_TOKEN=... kvroute-proxy
#
# Every flag of `kvroute proxy` can be given as KVROUTE_<FLAG> (see docker/README.md),
# or appended to `docker run ... kvroute-proxy --policy least-loaded`.
#
# Only the paths named in COPY below are read from the build context.

ARG BASE_IMAGE=python:3.11-slim-bookworm

# --- build: a virtual environment in /opt/venv ---------------------------------------
FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvroute ./kvroute

# 1. Build kvroute's wheel (kvroute/backend/ comes along in it but is only imported by
#    `kvroute backend`, which this image never runs).
# 2. Install its dependencies as pyproject.toml declares them (read back from the
#    wheel's metadata, so versions and markers never drift from pyproject.toml)
#    minus mlx and mlx-lm: aiohttp, redis[hiredis], xxhash, orjson, prometheus-client,
#    rich, uvloop. All of them ship manylinux wheels: no compiler is needed.
# 3. Install the wheel itself with --no-deps.
# 4. Fail the build if importing the proxy would pull in MLX.
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip wheel --no-deps --wheel-dir /tmp/wheels . \
 && KVROUTE_SKIP="mlx mlx-lm" /opt/venv/bin/python -c "import email, glob, os, re, zipfile; w = zipfile.ZipFile(glob.glob('/tmp/wheels/kvroute-*.whl')[0]); meta = email.message_from_bytes(w.read([n for n in w.namelist() if n.endswith('.dist-info/METADATA')][0])); skip = os.environ['KVROUTE_SKIP'].split(); name = lambda r: re.sub(r'[-_.]+', '-', re.match(r'[A-Za-z0-9._-]+', r).group()).lower(); [print(r) for r in meta.get_all('Requires-Dist') if 'extra ==' not in r and name(r) not in skip]" > /tmp/requirements.txt \
 && cat /tmp/requirements.txt \
 && /opt/venv/bin/pip install -r /tmp/requirements.txt \
 && /opt/venv/bin/pip install --no-deps /tmp/wheels/kvroute-*.whl \
 && /opt/venv/bin/python -c "import sys, kvroute.proxy.app, kvroute.cli; bad = sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm') or m.startswith('kvroute.backend')); assert not bad, bad" \
 && /opt/venv/bin/kvroute proxy --help > /dev/null

# --- runtime -----------------------------------------------------------------------------
FROM ${BASE_IMAGE}
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KVROUTE_HOST=0.0.0.0
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/kvroute \
      --shell /usr/sbin/nologin kvroute
COPY --from=build /opt/venv /opt/venv
USER kvroute
WORKDIR /home/kvroute
EXPOSE 8000
# /health answers 200 as long as the proxy serves (also while Redis is down: it then
# routes by load). The port follows KVROUTE_PORT; a --port flag needs it set too.
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('KVROUTE_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["kvroute", "proxy"]
