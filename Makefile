# The two set-up commands of the README: `make up` runs the service, `make test` tests it.
# Both work on a fresh machine: they create .venv from uv.lock and start the local
# Postgres, Redis and RabbitMQ if they are not running; `make test` also installs Debian's
# chromium (for the dashboard's browser test) when it is missing.

.PHONY: up test bootstrap services browser lint

up: bootstrap services
	.venv/bin/evolution-ingest up

test: bootstrap services browser lint
	.venv/bin/pytest

bootstrap:
	@scripts/bootstrap.sh

services:
	@scripts/services.sh

browser:
	@scripts/browser.sh

lint:
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy
	.venv/bin/hadolint Dockerfile
