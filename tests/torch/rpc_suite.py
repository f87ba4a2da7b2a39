"""Run torch's RPC + distributed autograd + DDP tests (shipped in the wheel:
torch.testing._internal.distributed.ddp_under_dist_autograd_test, mixed with the TensorPipe RPC
agent as torch's own test_tensorpipe_agent.py does through rpc_utils.generate_tests) with the
process group on jacklring and on gloo, and print the counts side by side.

    python tests/torch/rpc_suite.py                       # both classes, one run each backend
    python tests/torch/rpc_suite.py --runs 5              # runs alternate jacklring / gloo
    python tests/torch/rpc_suite.py -k comparison         # tests whose name contains a word
    python tests/torch/rpc_suite.py --list
    python tests/torch/rpc_suite.py --start spawn         # ranks spawned, as torch's CI does (default: forked)

torch's test module hard-codes the process-group backend: every test calls
`dist.init_process_group(backend="gloo", ...)` through its module global `dist`. In the child
process of one backend (and in every rank torch starts from it: forked by default, or spawned with
`--start spawn`, when they re-import this module) that
global is replaced by `_SwitchedDist`, a stand-in for torch.distributed whose
`init_process_group` swaps backend "gloo" for $RPC_SUITE_BACKEND; every other attribute is
torch.distributed's own. Nothing else is patched: RPC (TensorPipe), distributed autograd, DDP and
`dist.new_group` (which follows the default group's backend) are torch's. With
RPC_SUITE_BACKEND=gloo the stand-in changes nothing, so both backends run the same code.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# The CPU tests of the two classes (CudaDdpComparisonTest needs 4 GPUs and NCCL).
CLASSES = {
    "TensorPipeDdpComparisonTest": ["test_ddp_comparison", "test_ddp_comparison_uneven_inputs",
                                    "test_ddp_dist_autograd_sparse_grads",
                                    "test_ddp_dist_autograd_local_vs_remote"],
    "TensorPipeDdpUnderDistAutogradTest": ["test_backward_no_ddp", "test_backward_ddp_outside",
                                           "test_backward_ddp_outside_uneven_inputs",
                                           "test_backward_ddp_inside"],
}


class _SwitchedDist(types.ModuleType):
    """torch.distributed, except that init_process_group(backend="gloo") uses another backend."""

    def __init__(self, real: types.ModuleType, backend: str) -> None:
        super().__init__(real.__name__)
        self._real, self._backend = real, backend

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def init_process_group(self, backend=None, *args, **kwargs):
        if backend == "gloo":
            backend = self._backend
        return self._real.init_process_group(backend, *args, **kwargs)


def define_suites(backend: str) -> dict[str, type]:
    """torch's two test classes with the TensorPipe agent, their process groups on `backend`.
    Defined at import in the child and in every rank torch spawns (they find them by name)."""
    sys.path.insert(0, ROOT)
    import torch.distributed as dist
    from torch.testing._internal.distributed import ddp_under_dist_autograd_test as module
    from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (
        TensorPipeRpcAgentTestFixture,
    )
    from torch.testing._internal.distributed.rpc_utils import generate_tests

    import adapter.torch_backend  # noqa: F401  registers "jacklring"

    module.dist = _SwitchedDist(dist, backend)
    suites = generate_tests("TensorPipe", TensorPipeRpcAgentTestFixture,
                            [module.DdpComparisonTest, module.DdpUnderDistAutogradTest], __name__)
    if os.environ.get("RPC_SUITE_START", "fork") == "fork":
        suites = {name: _forking(cls) for name, cls in suites.items()}
    return suites


def _forking(cls: type) -> type:
    """cls, its ranks forked from this process instead of spawned: a spawned rank re-imports torch
    and the test module (seconds of CPU each, 4 ranks a test); torch's RPC tests spawn by default
    only because CUDA needs it, and these tests are CPU-only."""
    import torch.multiprocessing

    def _spawn_processes(self) -> None:
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    return type(cls.__name__, (cls,), {"_spawn_processes": _spawn_processes, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


if os.environ.get("RPC_SUITE_BACKEND"):
    globals().update(define_suites(os.environ["RPC_SUITE_BACKEND"]))


def child(names: list[str]) -> None:
    """Runs in a child process: the named tests ("Class.test"), results as one JSON line."""
    import unittest

    suite = unittest.TestSuite(globals()[cls](test) for cls, test in (n.split(".") for n in names))
    result = unittest.TextTestRunner(stream=sys.stderr, verbosity=2).run(suite)

    def short(t) -> str:
        return ".".join(t.id().split(".")[-2:])
    failed = sorted({short(t) for t, _ in result.failures + result.errors})
    skipped = sorted({short(t) for t, _ in result.skipped})
    passed = [n for n in names if n not in failed and n not in skipped]
    print("RESULT " + json.dumps({"passed": passed, "failed": failed, "skipped": skipped}), flush=True)


def run_backend(backend: str, names: list[str], timeout: float, start: str = "fork") -> dict:
    with tempfile.TemporaryDirectory() as temp:
        env = dict(os.environ, RPC_SUITE_BACKEND=backend, RPC_SUITE_START=start, TEMP_DIR=temp, PYTHONPATH=ROOT,
                   OMP_NUM_THREADS="1")
        try:
            done = subprocess.run([sys.executable, __file__, "--child", *names], env=env, cwd=ROOT,
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            log = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            return {"passed": [], "failed": [f"(the run timed out after {timeout:.0f} s)"], "skipped": [],
                    "log": log[-3000:]}
    match = re.search(r"^RESULT (.*)$", done.stdout, re.M)
    if not match:
        return {"passed": [], "failed": [f"(the run crashed: exit {done.returncode})"], "skipped": [],
                "log": done.stderr[-3000:]}
    return dict(json.loads(match.group(1)), log=done.stderr[-3000:])


def selected(k: str | None) -> list[str]:
    return [f"{cls}.{test}" for cls, tests in CLASSES.items() for test in tests
            if not k or k in f"{cls}.{test}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("-k", help="only tests whose Class.test name contains this")
    parser.add_argument("--backends", default="jacklring,gloo")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--start", choices=("fork", "spawn"), default="fork",
                        help="how torch's harness starts ranks (torch's own CI spawns)")
    parser.add_argument("names", nargs="*")
    args = parser.parse_args()
    if args.child:
        child(args.names)
        return 0
    names = list(args.names) or selected(args.k)
    if args.list:
        print("\n".join(names))
        return 0
    backends = args.backends.split(",")
    table: dict[str, dict[str, list[int]]] = {b: {"passed": [], "failed": [], "skipped": []} for b in backends}
    seconds: dict[str, list[float]] = {b: [] for b in backends}
    for run in range(args.runs):
        for backend in backends:  # interleaved, so both see the same machine load
            start = time.monotonic()
            result = run_backend(backend, names, args.timeout, args.start)
            seconds[backend].append(time.monotonic() - start)
            for key in table[backend]:
                table[backend][key].append(len(result[key]))
            print(f"run {run + 1} {backend}: {len(result['passed'])} passed, {len(result['failed'])} failed, "
                  f"{len(result['skipped'])} skipped in {seconds[backend][-1]:.0f} s"
                  + (f"; failed: {', '.join(result['failed'])}" if result["failed"] else ""), flush=True)
            if result["failed"] and result.get("log"):
                print(result["log"][-1500:], flush=True)
    print(f"\n{len(names)} tests, {args.runs} run(s)")
    print("| backend | passed | failed | skipped | seconds |\n|---|---|---|---|---|")
    for backend in backends:
        cells = ["/".join(str(c) for c in table[backend][k]) for k in ("passed", "failed", "skipped")]
        cells.append("/".join(f"{s:.0f}" for s in seconds[backend]))
        print(f"| {backend} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
