#!/usr/bin/env bash
# Build .gpu-deps/: the pure-Python packages the GPU check needs beyond torch and
# transformers (pytest, pytest-xdist and their dependencies; the server stack of looptool serve), for a GPU machine that cannot install
# anything. Run here, then carry .gpu-deps with the checkout (it is git-ignored).
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .gpu-deps
python3 -m pip install --quiet --no-deps --target .gpu-deps pytest pluggy iniconfig pygments pytest-xdist execnet filelock cachetools
# looptool serve (bench_serve): pure-Python, plus pydantic-core built for the GPU machine's Python 3.12
python3 -m pip install --quiet --no-deps --target .gpu-deps fastapi starlette uvicorn h11 click prometheus-client \
    httpx httpcore anyio sniffio certifi idna pydantic annotated-types typing-inspection typing-extensions annotated-doc
python3 -m pip install --quiet --no-deps --target .gpu-deps --upgrade --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 pydantic-core
du -sh .gpu-deps
