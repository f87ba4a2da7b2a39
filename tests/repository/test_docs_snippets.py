"""Every code block of README.md and docs/*.md runs as shown, or says that it does not.

A fenced block tagged python, py, sh, bash, shell or console is code; blocks tagged otherwise
(json, yaml) or not at all are data, pictures or sample output, and are not run. The line
before a code block's opening fence (blank lines aside) may carry a marker, an HTML comment
that readers of the rendered page do not see:

  <!-- fragment -->     not runnable as shown: a piece of a larger program (the reader's own
                        model or data), or commands that need what a test here cannot have or
                        should not spend (other hosts, sudo, a Slurm cluster, Kubernetes, Ray,
                        the reader's train.py, minutes of benchmarks, installing packages).
  <!-- tested-NAME -->  run by another test, which looks the block up by this marker (e.g.
                        tested-slurm-job: tests/engines/test_slurm.py).

Every other code block runs here, all at once (each is mostly waiting on its ranks): a python
block as a script under `launcher -n 2` (a distributed block forms a group of two; torch's
RANK, WORLD_SIZE, MASTER_* are set as torchrun sets them), a shell block with `bash -e` from
the repository root with this Python's bin folder first on PATH. Each must exit 0 within
BLOCK_TIMEOUT_S. A new block that follows the rule needs no change here.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import doc_blocks
import pytest

BLOCK_TIMEOUT_S = 240
REPO = doc_blocks.REPO


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MLX_", "OMPI_", "PMIX_", "NCCL_", "JACKLRING_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(OMP_NUM_THREADS="1", JACKLRING_TIMEOUT="60")
    return env


def _start(block: doc_blocks.Block, folder: Path) -> subprocess.Popen:
    name = re.sub(r"\W", "_", block.where())
    if block.language == "python":
        script = folder / f"{name}.py"
        script.write_text(block.text)
        command = [sys.executable, "-m", "launcher.cli", "-n", "2", str(script)]
    else:
        command = ["bash", "-e", "-c", block.text]
    return subprocess.Popen(command, cwd=REPO, env=_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.timeout(BLOCK_TIMEOUT_S + 60)
def test_every_code_block_runs_or_is_marked(tmp_path):
    runnable = [b for b in doc_blocks.all_blocks() if b.language and b.marker is None]
    assert runnable, "no runnable block found: the extraction is broken"
    procs = [(block, _start(block, tmp_path)) for block in runnable]
    deadline = time.monotonic() + BLOCK_TIMEOUT_S
    failures = []
    for block, proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, _ = proc.communicate()
            failures.append(f"{block.where()}: still running after {BLOCK_TIMEOUT_S} s\n{out[-1500:]}")
            continue
        if proc.returncode != 0:
            failures.append(f"{block.where()} ({block.language}) exited {proc.returncode}: run it as shown, "
                            f"or mark it <!-- fragment --> if it cannot run here\n{block.text}---\n{out[-2500:]}")
    assert not failures, "\n\n".join(failures)


def test_markers_stand_before_code_blocks_and_tested_ones_are_tested():
    for path in doc_blocks.documents():
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if not doc_blocks.MARKER.match(line):
                continue
            following = next((lines[j] for j in range(i + 1, len(lines)) if lines[j].strip()), "")
            fence = doc_blocks.FENCE.match(following)
            assert fence and doc_blocks.CODE.get(fence.group(3).lower()), \
                f"{path.relative_to(REPO)}:{i + 1}: {line.strip()} must stand just before a code block"
    tests_text = "\n".join(p.read_text() for p in (REPO / "tests").rglob("test_*.py"))
    for block in doc_blocks.all_blocks():
        if block.marker and block.marker.startswith("tested-"):
            assert f"<!-- {block.marker} -->" in tests_text, f"{block.where()}: no test reads <!-- {block.marker} -->"
