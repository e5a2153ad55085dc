#!/usr/bin/env bash
# The GPU check: one NVIDIA GPU, its own PyTorch, nothing installed. Under 8 minutes on an H200.
#   bash lab/gpu_check.sh [OUT_DIR] [extra arguments for gpu_check.py]
# Writes OUT_DIR/gpu_check.json (default: $OUT, else /tmp/tidal-gpu-check) and gpu_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/tidal-gpu-check}}"
shift || true
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
py=$(command -v python3 || command -v python)
{ nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } 2>&1 || true
"$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
timeout 470 "$py" lab/gpu_check.py --out "$out/gpu_check.json" "$@" 2>&1 | tee "$out/gpu_check.log"
rc=${PIPESTATUS[0]}
echo "gpu_check: rc=$rc, results in $out/gpu_check.json"
exit "$rc"
