#!/usr/bin/env bash
# The GPU check: one command on a CUDA machine (at most 9 min 25 s: each stage has a time limit). It needs no
# network and no install: looptool is imported from this checkout through a package shim,
# and pure-Python test/CLI dependencies the machine lacks come from .gpu-deps/ when present
# (built here by tests/gpu/prepare_deps.sh and carried along).
#
#   bash tests/gpu/run.sh                 # on the GPU machine; results in $OUT or ./gpu-results/
#   GPU_CHECK_DRY=1 bash tests/gpu/run.sh # plumbing check on a CPU: tiny shapes, --device cpu
#   GPU_CHECK_STAGES="env shim decode" GPU_CHECK_ROUNDS=1 GPU_CHECK_K=exact bash tests/gpu/run.sh  # a partial rerun
#
# Writes: env.json, pytest_gpu.xml + pytest_gpu.log (tests/gpu: exactness, generation, and the
# TensorRT step engine serving a mixed-budget batch where TensorRT is installed; on
# CUDA; tests/test_kernels.py, the Triton kernels on CUDA), kernels.json (bench_kernels: GB/s
# against copy bandwidth, MoE TFLOP/s against a dense bf16 GEMM), train_smollm2.json, train_llama1b.json (bench_train: tokens/s per budget and mixed
# vs plain, MFU, memory with and without --checkpoint), decode.json (bench_decode), serve.json
# (bench_serve: looptool serve on a 1B-shaped random-weight model, one stream and 8 streams over
# every budget; numbers only), and gpu_check.json (all of it, with each stage's exit code and seconds), gpu_check.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
OUT=${OUT:-$ROOT/gpu-results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
LOG="$OUT/gpu_check.log"
: > "$LOG"

SHIM=$(mktemp -d)
mkdir "$SHIM/looptool"
for f in "$ROOT"/looptool/*; do ln -s "$f" "$SHIM/looptool/"; done
ln -s "$ROOT/passes" "$SHIM/looptool/passes"
ln -s "$ROOT/backends" "$SHIM/looptool/backends"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
if [ -d "$ROOT/.gpu-deps" ]; then export PYTHONPATH="$PYTHONPATH:$ROOT/.gpu-deps"; fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

if [ "${GPU_CHECK_DRY:-0}" = 1 ]; then
    DEVICE=cpu; SMALL=tiny; LARGE=tiny; SEQ=64; DTYPE=float32; BF16=""; ROUNDS=1; NEW=8
else
    DEVICE=cuda; SMALL=smollm2-random; LARGE=llama-1b; SEQ=2048; DTYPE=bfloat16; BF16="--bf16"; ROUNDS=3; NEW=64
fi

ROUNDS=${GPU_CHECK_ROUNDS:-$ROUNDS}
STAGES=()
stage() {  # stage NAME TIMEOUT_S COMMAND...: run with a time limit, log it, record rc and seconds
    local name=$1 limit=$2; shift 2
    # GPU_CHECK_STAGES="env shim decode": run those stages only (a rerun of what failed)
    if [ -n "${GPU_CHECK_STAGES:-}" ] && [[ " $GPU_CHECK_STAGES " != *" $name "* ]]; then return; fi
    local t0=$SECONDS
    echo "== $name: $*" | tee -a "$LOG"
    timeout "$limit" "$@" >> "$LOG" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG"
    STAGES+=("$name:$rc:$((SECONDS - t0))")
}

stage env 30 "$PY" - "$OUT/env.json" <<'PY'
import json, platform, sys
import torch, transformers
info = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
        "cuda_available": torch.cuda.is_available(), "machine": platform.machine()}
if torch.cuda.is_available():
    info.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda, gpus=torch.cuda.device_count(),
                bf16=torch.cuda.is_bf16_supported())
try:
    import triton
    info["triton"] = triton.__version__
except ImportError:
    info["triton"] = None
json.dump(info, open(sys.argv[1], "w"), indent=2)
print(info)
PY
# -P: the checkout's own looptool/ folder (without passes/ and backends/) must not shadow the shim
stage shim 30 "$PY" -P -c "import looptool.passes, looptool.backends.onnx.export; print(looptool.__file__)"
stage pytest_gpu 140 "$PY" -P -m pytest tests/gpu tests/test_kernels.py -q -s -p no:cacheprovider -rs -n 0 ${GPU_CHECK_K:+-k "$GPU_CHECK_K"} --junitxml="$OUT/pytest_gpu.xml"
if [ "$DEVICE" = cuda ]; then  # Triton kernels against copy bandwidth and dense bf16 GEMM throughput
    stage kernels 45 "$PY" tests/bench/bench_kernels.py --rounds "$ROUNDS" --out "$OUT/kernels.json"
fi
stage train_smollm2 80 "$PY" tests/bench/bench_train.py --device "$DEVICE" --shape "$SMALL" $BF16 --seq-len "$SEQ" \
    --batch 4 --rounds "$ROUNDS" --out "$OUT/train_smollm2.json"
stage train_llama1b 60 "$PY" tests/bench/bench_train.py --device "$DEVICE" --shape "$LARGE" $BF16 --seq-len "$SEQ" \
    --batch 2 --rounds "$ROUNDS" --schemes prefix --out "$OUT/train_llama1b.json"
stage decode 80 "$PY" tests/bench/bench_decode.py --device "$DEVICE" --shape "$SMALL" --dtype "$DTYPE" \
    --rounds "$ROUNDS" --new "$NEW" --out "$OUT/decode.json"
stage serve 100 "$PY" tests/bench/bench_serve.py --shape "$LARGE" --device "$DEVICE" --dtype "$DTYPE" --runs 1 \
    --requests 16 --concurrency 8 --new "$NEW" --capacity 256 --out "$OUT/serve.json"

"$PY" - "$OUT" "${STAGES[@]}" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
stages = {}
for item in sys.argv[2:]:
    name, rc, seconds = item.rsplit(":", 2)
    stages[name] = {"rc": int(rc), "seconds": int(seconds)}
result = {"stages": stages}
for name in ("env", "kernels", "train_smollm2", "train_llama1b", "decode", "serve"):
    path = out / f"{name}.json"
    if path.exists():
        result[name] = json.loads(path.read_text())
(out / "gpu_check.json").write_text(json.dumps(result, indent=2))
print(json.dumps(stages))
PY
FAILED=0
for s in "${STAGES[@]}"; do
    IFS=: read -r name rc _ <<< "$s"
    if [ "$rc" != 0 ]; then echo "stage $name failed (rc=$rc); see $LOG"; FAILED=1; fi
done
[ "$FAILED" = 0 ] && echo "all stages passed; results in $OUT"
exit "$FAILED"
