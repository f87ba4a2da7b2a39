"""One rank of a contract launch: `worker.py OUTDIR BACKEND SIZE [CHECK,CHECK...]` under the launcher.

Runs every named check (default: all of checks.CHECKS, in order) and writes
OUTDIR/rank<R>.json = {check: "ok" | what went wrong}. A failing check does not stop the
others; once a check leaves the group unusable (a timeout, a lost peer), the rest are
reported as not run, naming that check.

`worker.py OUTDIR BACKEND SIZE --mismatch`: rank 0 sums float32 while the others sum float64;
each rank writes {"raised": exception type, "message": ...} or {"returned": ...}.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for `contract`

import numpy as np  # noqa: E402

import adapter  # noqa: E402
from contract.checks import CHECKS, Context  # noqa: E402

# Errors after which a group is unusable by design: the remaining checks could only time out.
GROUP_BREAKING = (adapter.CollectiveTimeout, adapter.PeerError)


def run_checks(ctx: Context, names: list[str], write: Callable[[dict, dict], None]) -> None:
    """Run the checks in order, rewriting the results after each one: a launch killed for time
    still tells which checks finished and which one was running."""
    results: dict[str, str] = {}
    seconds: dict[str, float] = {}
    broken = ""
    for name in names:
        if broken:
            results[name] = f"not run: the group became unusable in {broken}"
            continue
        results[name] = "still running when the launch ended"
        write(results, seconds)
        ctx.failures.clear()
        start = time.monotonic()
        try:
            CHECKS[name](ctx)
        except GROUP_BREAKING:
            broken = name
            results[name] = "".join(f + "\n" for f in ctx.failures) + traceback.format_exc()
        except Exception:
            results[name] = "".join(f + "\n" for f in ctx.failures) + traceback.format_exc()
        else:
            results[name] = "ok" if not ctx.failures else "\n".join(ctx.failures)
        seconds[name] = round(time.monotonic() - start, 3)
    write(results, seconds)


def _writer(out_dir: str, rank: int) -> Callable[[dict, dict], None]:
    def write(results: dict, seconds: dict) -> None:
        for suffix, data in (("", results), (".seconds", seconds)):
            path = os.path.join(out_dir, f"rank{rank}{suffix}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(data, f)
            os.replace(path + ".tmp", path)
    return write


def mismatch(group: adapter.Group) -> dict[str, str]:
    try:
        got = adapter.all_sum(np.ones(4, np.float32 if group.rank() == 0 else np.float64))
    except Exception as exc:
        return {"raised": type(exc).__name__, "message": str(exc),
                "distributed": isinstance(exc, adapter.DistributedError)}
    return {"returned": repr(got)}


def main() -> None:
    out_dir, backend, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    selection = sys.argv[4] if len(sys.argv) > 4 else ""
    group = adapter.init(strict=True)
    write = _writer(out_dir, group.rank())
    if selection == "--mismatch":
        write(mismatch(group), {})
        # The group is broken by design; a normal exit could wait in the backend's shutdown.
        sys.stdout.flush()
        os._exit(0)
    names = selection.split(",") if selection else list(CHECKS)
    run_checks(Context(group, backend, size), names, write)


if __name__ == "__main__":
    main()
