# evolution-ingest: every Evolution API event, by webhook and RabbitMQ, processed once.
#
#   docker build -t evolution-ingest .                 (podman: add --format docker to keep the HEALTHCHECK)
#   docker run --env-file .env evolution-ingest        (up; or serve, worker, reconcile, migrate, topology, ...)
#
# Configured only through EVOLUTION_INGEST_* variables; nothing secret is baked in.

FROM debian:bookworm-slim AS build
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UV_PYTHON_DOWNLOADS=never \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3=3.11.* python3-venv=3.11.* \
    && apt-get clean && rm -rf /var/lib/apt/lists/*
# The same uv as the project's bootstrap, in a venv of its own.
RUN python3 -m venv /opt/uv && /opt/uv/bin/pip install --no-cache-dir uv==0.13.9
WORKDIR /app
# The dependencies first (a layer that changes only with uv.lock), then the package itself.
COPY pyproject.toml uv.lock README.md ./
RUN /opt/uv/bin/uv sync --frozen --no-dev --no-install-project --no-cache --python /usr/bin/python3
COPY src ./src
RUN /opt/uv/bin/uv sync --frozen --no-dev --no-editable --no-cache --python /usr/bin/python3

FROM debian:bookworm-slim
# ca-certificates: route destinations and alert webhooks over HTTPS, TLS to the stores.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3=3.11.* ca-certificates=20230311* \
    && apt-get clean && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home --home-dir /app --shell /usr/sbin/nologin ingest
COPY --from=build /app/.venv /app/.venv
ENV PATH=/app/.venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    EVOLUTION_INGEST_HOST=0.0.0.0 \
    EVOLUTION_INGEST_LOG_FORMAT=json
WORKDIR /app
USER 10001
EXPOSE 8080
# Ready when Postgres (migrations current), Redis and RabbitMQ answer (the webhook app's /readyz).
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/readyz' % os.environ.get('EVOLUTION_INGEST_PORT', '8080'), timeout=4)"]
# Exec form: the process gets SIGTERM itself and stops within SHUTDOWN_TIMEOUT_SECONDS.
ENTRYPOINT ["evolution-ingest"]
CMD ["up"]
