"""Run torch's own DistributedTest (shipped in the wheel:
torch.testing._internal.distributed.distributed_test) against jacklring and gloo and print the
counts side by side. Opt-in: it spawns one process group per test and takes minutes.

    python tests/torch/torchsuite.py                     # the default subset, world size 2
    python tests/torch/torchsuite.py --world-size 3 --runs 5
    python tests/torch/torchsuite.py --all               # every test of the class
    python tests/torch/torchsuite.py -k send_recv        # tests whose name contains a word
    python tests/torch/torchsuite.py --list              # the subset, nothing run

torch's test class reads BACKEND / WORLD_SIZE / TEMP_DIR at import, so each backend runs in a
child process of this script (`--child BACKEND`); torch's harness then spawns the ranks. Needs
the `expecttest` package (torch's test utilities import it).
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

SUBSET = [
    "test_all_reduce_sum", "test_all_reduce_sum_async", "test_all_reduce_max", "test_all_reduce_product",
    "test_all_reduce_coalesced_sum", "test_reduce_sum", "test_broadcast", "test_broadcast_group",
    "test_all_gather", "test_all_gather_into_tensor_ops", "test_gather", "test_scatter",
    "test_all_to_all", "test_all_to_all_single_equal_split", "test_reduce_scatter_tensor",
    "test_barrier", "test_barrier_group", "test_barrier_timeout_global",
    "test_send_recv", "test_send_recv_with_tag", "test_send_recv_any_source", "test_irecv", "test_isend",
    "test_batch_isend_irecv_gloo", "test_batch_isend_irecv_gloo_tags",
    "test_sparse_all_reduce_sum", "test_broadcast_object_list", "test_all_gather_object",
    "test_ddp_join_model_equivalence", "test_ddp_uneven_inputs", "test_ddp_grad_div_uneven_inputs",
    "test_ddp_comm_hook_logging", "test_DistributedDataParallel_non_default_stream",
]


def define_suite() -> type:
    """torch's test class for $BACKEND. Defined at import in the child and in every rank torch
    spawns (they re-import this module and find the class by name)."""
    sys.path.insert(0, ROOT)
    from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

    import adapter.torch_backend  # noqa: F401  registers "jacklring"

    class TorchSuite(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._spawn_processes()

    TorchSuite.__qualname__ = "TorchSuite"  # pickled by name: module attribute below
    return TorchSuite


if os.environ.get("BACKEND") and os.environ.get("TEMP_DIR"):
    TorchSuite = define_suite()


def child(backend: str, names: list[str]) -> None:
    """Runs in a child process: torch's test class with $BACKEND, results as one JSON line."""
    import unittest

    suite = unittest.TestSuite(TorchSuite(name) for name in names if hasattr(TorchSuite, name))
    result = unittest.TextTestRunner(stream=sys.stderr, verbosity=1).run(suite)
    failed = sorted({t.id().rsplit(".", 1)[-1] for t, _ in result.failures + result.errors})
    skipped = sorted({t.id().rsplit(".", 1)[-1] for t, _ in result.skipped})
    passed = [n for n in names if hasattr(TorchSuite, n) and n not in failed and n not in skipped]
    print("RESULT " + json.dumps({"passed": passed, "failed": failed, "skipped": skipped}), flush=True)


def run_backend(backend: str, names: list[str], world_size: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as temp:
        env = dict(os.environ, BACKEND=backend, WORLD_SIZE=str(world_size), TEMP_DIR=temp,
                   PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
        try:
            done = subprocess.run([sys.executable, __file__, "--child", backend, *names], env=env, cwd=ROOT,
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"passed": [], "failed": ["(the run timed out)"], "skipped": [], "log": ""}
    match = re.search(r"^RESULT (.*)$", done.stdout, re.M)
    if not match:
        return {"passed": [], "failed": [f"(the run crashed: exit {done.returncode})"], "skipped": [],
                "log": done.stderr[-3000:]}
    return dict(json.loads(match.group(1)), log=done.stderr[-3000:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--all", action="store_true", help="every test of DistributedTest")
    parser.add_argument("-k", help="only tests whose name contains this")
    parser.add_argument("--backends", default="jacklring,gloo")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("names", nargs="*")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.names)
        return 0
    names = list(args.names) or list(SUBSET)
    if args.all:
        names = _every_test()
    if args.k:
        names = [n for n in (names if args.names or not args.all else _every_test()) if args.k in n]
    if args.list:
        print("\n".join(names))
        return 0
    backends = args.backends.split(",")
    table: dict[str, dict[str, list[int]]] = {b: {} for b in backends}
    passed_by: dict[str, set[str]] = {b: set() for b in backends}
    for run in range(args.runs):
        for backend in backends:
            start = time.monotonic()
            result = run_backend(backend, names, args.world_size, args.timeout)
            for key in ("passed", "failed", "skipped"):
                table[backend].setdefault(key, []).append(len(result[key]))
            passed_by[backend].update(result["passed"])
            print(f"run {run + 1} {backend}: {len(result['passed'])} passed, {len(result['failed'])} failed, "
                  f"{len(result['skipped'])} skipped in {time.monotonic() - start:.0f} s"
                  + (f"; failed: {', '.join(result['failed'])}" if result["failed"] else ""), flush=True)
            if result["failed"] and result.get("log"):
                print(result["log"][-1500:], flush=True)
    print(f"\n{len(names)} tests, world size {args.world_size}, {args.runs} run(s)")
    print("| backend | passed | failed | skipped |\n|---|---|---|---|")
    for backend in backends:
        cells = ["/".join(str(c) for c in table[backend][k]) for k in ("passed", "failed", "skipped")]
        print(f"| {backend} | " + " | ".join(cells) + " |")
    for backend in backends:
        others = set().union(*(passed_by[b] for b in backends if b != backend))
        missing = sorted(others - passed_by[backend])
        if missing:
            print(f"passed elsewhere but not on {backend} (failed or skipped there): {', '.join(missing)}")
    return 0


def _every_test() -> list[str]:
    out = subprocess.run([sys.executable, "-c",
                          "from torch.testing._internal.distributed.distributed_test import DistributedTest as D;"
                          "print('\\n'.join(n for n in dir(D._DistTestBase) if n.startswith('test_')))"],
                         env=dict(os.environ, BACKEND="gloo", WORLD_SIZE="2", TEMP_DIR=tempfile.gettempdir()),
                         capture_output=True, text=True, check=True)
    return out.stdout.split()


if __name__ == "__main__":
    sys.exit(main())
