#!/usr/bin/env bash
# The GPU check: one command on a machine with one (or more) NVIDIA GPUs, under 5 minutes.
#   scripts/gpu_check.sh            # uses .venv/bin/python, else python3; PYTHON=... to choose
# Installs what is missing into that Python's environment (cupy-cuda12x, nvidia-nccl-cu12 and
# the CUDA 12 runtime/NVRTC wheels cupy loads; a CUDA build of torch when the installed torch
# has no CUDA). GPU_CHECK_NO_INSTALL=1 installs nothing. Then runs tests/gpu:
#   - NCCL with world size 1, every op, host and device buffers
#   - pinned staging of cupy arrays and CUDA tensors
#   - two processes sharing the GPU through the ring backend with cupy buffers
#   - a CUDA DDP step on the jacklring torch process group (2 processes, model on cuda:0)
#   - NCCL between two processes (only with 2+ GPUs)
# and prints a PASS/FAIL summary; the exit code is 0 only when everything passed.
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi; fi
START=$(date +%s)
LOG=$(mktemp -d)/gpu_check
mkdir -p "$LOG"
step() { printf '\n== %s\n' "$*"; }

step "machine"
nvidia-smi -L 2>&1 || echo "nvidia-smi: not available"
"$PY" -c 'import sys; print("python", sys.version.split()[0], sys.executable)'

cupy_ok() {
  "$PY" - <<'PY' 2>&1
import cupy
from cupy.cuda import nccl
assert nccl.available, "cupy cannot load libnccl"
n = cupy.cuda.runtime.getDeviceCount()
x = (cupy.arange(8) * 2).astype(cupy.int16).sum()  # needs NVRTC: a kernel is compiled
print(f"cupy {cupy.__version__}, NCCL {nccl.get_version()}, {n} device(s), kernel ok ({int(x)})")
PY
}
torch_cuda_ok() {
  "$PY" -c 'import torch; assert torch.cuda.is_available(), f"torch {torch.__version__} has no CUDA"; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))' 2>&1
}

step "dependencies"
if ! cupy_ok; then
  if [ "${GPU_CHECK_NO_INSTALL:-0}" = 1 ]; then echo "cupy missing or broken (GPU_CHECK_NO_INSTALL=1: not installing)"
  else
    echo "installing cupy-cuda12x, nvidia-nccl-cu12 and the CUDA 12 runtime wheels"
    timeout 150 "$PY" -m pip install -q cupy-cuda12x nvidia-nccl-cu12 nvidia-cuda-runtime-cu12 nvidia-cuda-nvrtc-cu12 2>&1 | tail -3
    cupy_ok || echo "cupy still unusable after installing"
  fi
fi
if ! torch_cuda_ok; then
  if [ "${GPU_CHECK_NO_INSTALL:-0}" = 1 ]; then echo "torch without CUDA (GPU_CHECK_NO_INSTALL=1: not installing)"
  else
    for cu in cu128 cu126 cu130; do
      echo "installing torch from https://download.pytorch.org/whl/$cu"
      timeout 200 "$PY" -m pip install -q --upgrade torch --index-url "https://download.pytorch.org/whl/$cu" 2>&1 | tail -2 \
        && torch_cuda_ok && break
    done
  fi
fi
"$PY" -c 'import pytest, pytest_timeout' 2>/dev/null || timeout 60 "$PY" -m pip install -q pytest pytest-timeout

step "tests/gpu"
declare -A RESULT
run_part() {  # name, pytest selection...
  local name=$1; shift
  local out="$LOG/${name// /_}.txt"
  timeout 240 "$PY" -m pytest -q -rA -p no:cacheprovider "$@" >"$out" 2>&1
  local rc=$?
  tail -n 25 "$out"
  if grep -q "^SKIPPED.*needs a CUDA device" "$out"; then RESULT[$name]="FAIL (no CUDA device: tests skipped)"
  elif [ $rc -eq 0 ]; then RESULT[$name]=PASS
  elif [ $rc -eq 124 ]; then RESULT[$name]="FAIL (timed out)"
  else RESULT[$name]="FAIL (see $out)"; fi
}
run_part "nccl world of one" tests/gpu/test_nccl_world1.py
run_part "pinned staging" tests/gpu/test_gpu_staging.py
run_part "ring with cupy buffers, 2 processes" "tests/gpu/test_two_processes.py::test_ring_with_cupy_buffers_on_one_gpu"
run_part "CUDA DDP step on jacklring, 2 processes" "tests/gpu/test_two_processes.py::test_cuda_ddp_step_on_jacklring"
run_part "nccl between 2 processes (2+ GPUs)" "tests/gpu/test_two_processes.py::test_nccl_between_two_processes"

step "summary ($(( $(date +%s) - START )) s)"
status=0
for name in "nccl world of one" "pinned staging" "ring with cupy buffers, 2 processes" \
            "CUDA DDP step on jacklring, 2 processes" "nccl between 2 processes (2+ GPUs)"; do
  verdict=${RESULT[$name]}
  if [ "$name" = "nccl between 2 processes (2+ GPUs)" ] && grep -q "needs 2 CUDA devices" "$LOG/${name// /_}.txt"; then
    verdict="SKIP (one GPU)"
  fi
  printf '%-45s %s\n' "$name" "$verdict"
  case $verdict in FAIL*) status=1 ;; esac
done
[ $status -eq 0 ] && echo "GPU CHECK: PASS" || echo "GPU CHECK: FAIL"
exit $status
