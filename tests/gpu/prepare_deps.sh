#!/usr/bin/env bash
# Build .gpu-deps/: the pure-Python packages the GPU check needs beyond torch and
# transformers (pytest, pytest-xdist and their dependencies), for a GPU machine that cannot install
# anything. Run here, then carry .gpu-deps with the checkout (it is git-ignored).
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .gpu-deps
python3 -m pip install --quiet --no-deps --target .gpu-deps pytest pluggy iniconfig pygments pytest-xdist execnet
du -sh .gpu-deps
