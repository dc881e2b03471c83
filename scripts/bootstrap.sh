#!/usr/bin/env bash
# Create .venv with the exact versions of uv.lock. Needs Python >= 3.11 and network
# access to PyPI; installs a pinned uv into .tools if none is on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."

UV_VERSION=0.13.9
export UV_PYTHON_DOWNLOADS=never

if command -v uv >/dev/null 2>&1 && [ "$(uv --version | cut -d' ' -f2)" = "$UV_VERSION" ]; then
  UV=uv
else
  if [ ! -x .tools/bin/uv ] || [ "$(.tools/bin/uv --version | cut -d' ' -f2)" != "$UV_VERSION" ]; then
    echo "bootstrap: installing uv $UV_VERSION into .tools"
    python3 -m venv .tools
    .tools/bin/pip install --quiet --disable-pip-version-check "uv==$UV_VERSION"
  fi
  UV=.tools/bin/uv
fi
# Bytecode compiled once here: where PYTHONDONTWRITEBYTECODE is set (as in many CI images), every
# process would otherwise compile every module it imports at each start (seconds of CPU for each
# command of the service). The container image compiles it the same way (Dockerfile).
UV_COMPILE_BYTECODE=1 $UV sync --frozen --quiet
.venv/bin/python -m compileall -q src
