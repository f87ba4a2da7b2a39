"""Run each (variant, size) launch once and hand its per-rank results to many tests.

Launches start in the background, a few at a time, as soon as the first test asks, in the
order the collected tests need them: while one launch waits on sockets another computes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from ranks import launch, output_tail

from .backends import Variant

WORKER = Path(__file__).resolve().parent / "worker.py"
LAUNCH_TIMEOUT_S = 240
PARALLEL = 3  # launches at once (each launch is 1-4 processes; while one waits on sockets another computes)


@dataclass
class Outcome:
    """One launch: each rank's JSON (None for a rank that wrote none) and the launcher's output."""
    ranks: list[dict | None]
    output: str

    def rank_results(self) -> list[dict]:
        missing = [r for r, res in enumerate(self.ranks) if res is None]
        if missing:
            pytest.fail(f"ranks {missing} wrote no results\n{self.output}", pytrace=False)
        return self.ranks  # type: ignore[return-value]


def _run(variant: Variant, size: int, folder: Path, mode: str) -> Outcome:
    folder.mkdir(parents=True, exist_ok=True)
    args = ["--backend", variant.backend] if variant.hostfile is None else variant.hostfile(folder, size)
    if variant.hostfile is None:
        args += ["-n", str(size)]
    args += list(variant.launcher_args)
    worker = [str(WORKER), str(folder), variant.expected_backend, str(size)]
    if mode:
        worker.append(mode)
    else:
        worker.append(",".join(variant.checks_at(size)))
    if variant.rank_wrapper:
        worker = ["--", "sh", "-c", variant.rank_wrapper, "rank", sys.executable, *worker]
    # A broken group by design: ranks that cannot see the mismatch wait only briefly.
    env = dict(variant.env, JACKLRING_TIMEOUT="5") if mode else variant.env
    try:
        result = launch(args + worker, timeout=LAUNCH_TIMEOUT_S, env=env)
        output = output_tail(result)
    except subprocess.TimeoutExpired as exc:
        output = f"launch stopped after {LAUNCH_TIMEOUT_S} s\n--- stdout\n{(exc.stdout or '')[-3000:]}\n" \
                 f"--- stderr\n{(exc.stderr or '')[-3000:]}"
    ranks = []
    for r in range(size):
        path = folder / f"rank{r}.json"
        ranks.append(json.loads(path.read_text()) if path.exists() else None)
    return Outcome(ranks, output)


class Launches:
    def __init__(self, root: Path, wanted: list[tuple[Variant, int, str]]) -> None:
        self._root = root
        self._pool = ThreadPoolExecutor(max_workers=int(os.environ.get("CONTRACT_PARALLEL", PARALLEL)))
        self._futures: dict[tuple[str, int, str], Future] = {}
        for variant, size, mode in wanted:  # start everything the session will ask for, in order
            self._submit(variant, size, mode)

    def _submit(self, variant: Variant, size: int, mode: str) -> Future:
        key = (variant.id, size, mode)
        if key not in self._futures:
            folder = self._root / f"{variant.id}-{size}{'-' + mode.strip('-') if mode else ''}"
            self._futures[key] = self._pool.submit(_run, variant, size, folder, mode)
        return self._futures[key]

    def get(self, variant: Variant, size: int, mode: str = "") -> Outcome:
        return self._submit(variant, size, mode).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
