#!/usr/bin/env bash
# One-time set-up on a fresh Debian machine: the servers the tests start (sshd, Slurm), a venv with
# the CPU build of torch, and jacklring with every CPU extra. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! [ -x /usr/sbin/sshd ] || ! command -v ip >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq openssh-server openssh-client iproute2 >/dev/null
    else
        echo "setup: openssh-server and iproute2 are missing; install them (sudo apt-get install openssh-server iproute2)" >&2
    fi
fi

# Slurm and munge: tests/engines starts a real one-node Slurm (munged, slurmctld, slurmd) by hand;
# libpmix-dev lets Slurm's PMIx plugin load (srun --mpi=pmix).
if ! [ -x /usr/sbin/slurmctld ] || ! [ -x /usr/sbin/munged ] || ! [ -e /usr/lib/x86_64-linux-gnu/libpmix.so ]; then
    if [ "$(id -u)" = 0 ]; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq slurm-wlm munge libpmix-dev >/dev/null
    else
        echo "setup: slurm-wlm and munge are missing; install them (sudo apt-get install slurm-wlm munge libpmix-dev) or the Slurm tests skip" >&2
    fi
fi

PY=${PYTHON:-python3}

# The shared-memory engine is C, compiled at install (setup.py): a C compiler and the headers of
# the Python the venv is made from. JACKLRING_NO_NATIVE=1 installs without it (sockets instead).
has_headers() { "$PY" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; }
if [ "${JACKLRING_NO_NATIVE:-}" != 1 ] && { ! command -v cc >/dev/null || ! has_headers; }; then
    if [ "$(id -u)" = 0 ]; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq gcc python3-dev >/dev/null
    else
        echo "setup: a C compiler or Python's headers are missing; install them (sudo apt-get install gcc python3-dev) or set JACKLRING_NO_NATIVE=1" >&2
    fi
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# uv installs the same packages as pip, resolved the same way, several times faster (it fetches
# and unpacks in parallel); where uv cannot be had, pip does the same work.
.venv/bin/python -m pip install -q uv 2>&1 | grep -v "is ignored" || true
install() {
    if [ -x .venv/bin/uv ]; then
        .venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python ${PIP_FIND_LINKS:+--find-links "$PIP_FIND_LINKS"} "$@"
    else
        .venv/bin/python -m pip install -q "$@" 2>&1 | grep -v "is ignored" || true
    fi
}
# The CPU build of torch: a plain "torch" requirement would pull a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    install "torch==2.13.0"
fi
# compat: the editable install is one path line in a .pth file. The default mode installs a finder
# module that every Python process imports at start-up (pathlib, importlib.util): 22 ms of CPU
# per process here, and the test suite starts thousands of them.
install -e ".[all]" --config-settings editable_mode=compat
.venv/bin/python -c "import adapter, torch, mpi4py, fabric, sklearn" 
# The torch process group's C++ c10d Backend (csrc/torch/), compiled against this torch into the
# user's private cache (adapter/torch_backend/native.py); training jobs never compile it. Without
# a compiler (or ninja) it is not built and the torch process group runs in Python.
command -v ninja >/dev/null || [ -x .venv/bin/ninja ] || install ninja
if ! PATH="$PWD/.venv/bin:$PATH" .venv/bin/python -m adapter.torch_backend.native; then
    echo "setup: the C++ torch backend did not build (above: why); the torch process group runs in Python" >&2
fi
echo "setup: ready (.venv)"
