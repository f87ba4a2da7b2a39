"""Run torch's own DistributedTest (shipped in the wheel:
torch.testing._internal.distributed.distributed_test) against jacklring and gloo and print the
counts side by side. tests/torch/test_torchsuite.py runs it in the normal suite against the
checked-in lists (torchsuite_expected.txt, torchsuite_excluded.txt).

    python tests/torch/torchsuite.py                     # the default subset, world size 2
    python tests/torch/torchsuite.py --world-size 3 --runs 5
    python tests/torch/torchsuite.py --all               # every test of the class
    python tests/torch/torchsuite.py -k send_recv        # tests whose name contains a word
    python tests/torch/torchsuite.py --list              # the subset, nothing run
    python tests/torch/torchsuite.py --gates own         # torch's skips as torch decides them
    python tests/torch/torchsuite.py --all --check       # the checked-in lists against a full run

torch's test class reads BACKEND / WORLD_SIZE / TEMP_DIR at import, so each backend runs in a
child process of this script (`--child BACKEND`); torch's harness then starts the ranks, forked
from that child (`--start fork`, the default: a spawned rank re-imports torch and the test module,
about 15 s a test on a loaded 2-core machine against about 1 s) or spawned (`--start spawn`, as
torch's CI does).

Gates: torch decides many skips when the class is defined, by the backend's name (`BACKEND !=
"gloo"`, `require_backend_is_available({"gloo"})`, feature sets without third-party backends).
With `--gates gloo` (the default) jacklring's class is defined as if for gloo and then runs on
jacklring, so it is held to every test gloo runs; `--gates own` leaves torch's decisions alone
(jacklring declared as a plugin backend with DDP). Needs the `expecttest` package (torch's test
utilities import it).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# The driver's default: what users lean on, about 30 s on jacklring here (the pytest test runs every
# expected test). torch's DDP uneven-inputs / join and comm-hook tests need 2 CUDA devices
# (tests/torch covers them on CPU).
SUBSET = [
    # collectives
    "test_all_reduce_sum", "test_all_reduce_sum_async", "test_all_reduce_max", "test_all_reduce_product",
    "test_all_reduce_sum_complex", "test_all_reduce_complex_unsupported_ops", "test_all_reduce_full_group_sum",
    "test_all_reduce_coalesced_sum", "test_all_reduce_coalesced_max", "test_sparse_all_reduce_sum",
    "test_reduce_sum", "test_reduce_sum_twice", "test_reduce_full_group_max",
    "test_broadcast", "test_broadcast_full_group", "test_all_gather", "test_all_gather_complex",
    "test_all_gather_coalesced_simple", "test_all_gather_coalesced_with_empty",
    "test_gather", "test_gather_checks", "test_scatter", "test_scatter_checks",
    "test_barrier", "test_barrier_timeout_full_group",
    # point to point
    "test_send_recv", "test_send_recv_with_tag", "test_send_recv_any_source", "test_irecv", "test_isend",
    "test_batch_isend_irecv_gloo", "test_batch_isend_irecv_gloo_tags",
    # object collectives
    "test_all_gather_object_default_pg", "test_all_gather_object_subgroup", "test_scatter_object_list",
    # DDP on CPU, futures
    "test_DistributedDataParallelCPU", "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad", "test_ddp_create_graph", "test_static_graph_api_cpu",
    "test_grads_same_across_ranks_with_no_sync", "test_get_future",
    # monitored barrier (adapter.torch_backend.monitored_barrier), groups
    "test_monitored_barrier_gloo", "test_monitored_barrier_gloo_rank_0_timeout",
    "test_monitored_barrier_gloo_subgroup", "test_destroy_group", "test_get_backend",
]


def define_suite() -> type:
    """torch's test class for $BACKEND. Defined at import in the child and in every rank torch
    spawns (they re-import this module and find the class by name)."""
    sys.path.insert(0, ROOT)
    import torch
    from torch.testing._internal.common_distributed import DistTestCases

    import adapter.torch_backend  # noqa: F401  registers "jacklring"

    backend = os.environ["BACKEND"]
    as_gloo = backend != "gloo" and os.environ.get("TORCHSUITE_GATES", "gloo") == "gloo"
    if backend == "jacklring":  # what torch's feature sets would say for a plugin with DDP on CPU
        DistTestCases.backend_feature["plugin"].add(backend)
        DistTestCases.backend_feature["ddp"].add(backend)
    if as_gloo:
        os.environ["BACKEND"] = "gloo"  # read by the decorators while the class is defined
    try:
        from torch.testing._internal.distributed import distributed_test
    finally:
        os.environ["BACKEND"] = backend
    distributed_test.BACKEND = backend  # read when a test runs: init_process_group, branches in tests
    if backend == "jacklring":
        # torch's monitored-barrier tests call dist.monitored_barrier, which the first jacklring
        # group routes to jacklring's barrier on its own (adapter/torch_backend/barrier_route.py).
        # Loaded once here, not in every forked rank: each process's first same-host group would
        # load the native engine again (a small extension, but still a load).
        from adapter.backends.local import engine

        engine.why_missing()
    DistributedTest, TestDistBackend = distributed_test.DistributedTest, distributed_test.TestDistBackend

    class TorchSuite(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            if os.environ.get("TORCHSUITE_START", "fork") == "fork":
                self._start_processes(torch.multiprocessing.get_context("fork").Process)
            else:
                self._spawn_processes()

    TorchSuite.__qualname__ = "TorchSuite"  # pickled by name: module attribute below
    return TorchSuite


if os.environ.get("BACKEND") and os.environ.get("TEMP_DIR"):
    TorchSuite = define_suite()


def child(backend: str, names: list[str]) -> None:
    """Runs in a child process: torch's test class with $BACKEND, results as one JSON line."""
    import unittest

    result = unittest.TestResult()
    seconds: dict[str, float] = {}
    TorchSuite.setUpClass()
    for name in names:
        if hasattr(TorchSuite, name):
            start = time.monotonic()
            TorchSuite(name).run(result)
            seconds[name] = round(time.monotonic() - start, 2)
            print(f"{name}: {seconds[name]} s", file=sys.stderr, flush=True)
    TorchSuite.tearDownClass()
    failed = {t.id().rsplit(".", 1)[-1]: _last_line(why) for t, why in result.failures + result.errors}
    skipped = {t.id().rsplit(".", 1)[-1]: why for t, why in result.skipped}
    passed = [n for n in names if hasattr(TorchSuite, n) and n not in failed and n not in skipped]
    missing = {n: "not a test of this torch's DistributedTest" for n in names if not hasattr(TorchSuite, n)}
    print("RESULT " + json.dumps({"passed": passed, "failed": {**failed, **missing}, "skipped": skipped,
                                  "seconds": seconds}), flush=True)


def _last_line(trace: str) -> str:
    """The exception line of a unittest traceback: the last "SomeError: ..." line, which torch's
    harness makes the failing rank's own error."""
    errors = [line.strip() for line in trace.splitlines() if re.match(r"^[\w.]*(Error|Exception|Timeout)\b", line.strip())]
    return (errors or [line for line in trace.strip().splitlines() if line.strip()] or ["(no traceback)"])[-1][:300]


def run_backend(backend: str, names: list[str], world_size: int, timeout: float, start: str = "fork",
                gates: str = "gloo", test_timeout: int = 120, log_file: str | None = None, shards: int = 1,
                popen: Callable[..., Any] = subprocess.Popen) -> dict:
    """Runs `names` of torch's DistributedTest on `backend` in a child process: {"passed": [names],
    "failed": {name: error}, "skipped": {name: reason}, "log": the child's last output}. A test
    that hangs fails after `test_timeout` seconds (torch's harness kills its ranks, logging their
stacks). log_file: the child's whole output is appended there. shards > 1: that many children at
once, each with every shards-th name (one child keeps about one core busy: its ranks mostly take
turns), the results merged. popen starts the child (subprocess.Popen's arguments); the test suite
passes its zygote's, which forks it with torch already imported."""
    if shards > 1:
        parts = [names[i::shards] for i in range(shards) if names[i::shards]]
        with concurrent.futures.ThreadPoolExecutor(len(parts)) as pool:
            results = list(pool.map(lambda part: _run_child(backend, part, world_size, timeout, start, gates,
                                                            test_timeout, log_file, popen), parts))
        return _merged(results)
    return _run_child(backend, names, world_size, timeout, start, gates, test_timeout, log_file, popen)


def _merged(results: list[dict]) -> dict:
    merged: dict = {"passed": [], "failed": {}, "skipped": {}, "seconds": {}, "log": ""}
    for result in results:
        merged["passed"] += result["passed"]
        merged["skipped"].update(result["skipped"])
        merged["seconds"].update(result.get("seconds", {}))
        for name, why in result["failed"].items():  # "(the run)" may come from several children
            merged["failed"][name] = f"{merged['failed'][name]}; {why}" if name in merged["failed"] else why
        if result.get("log") and (result["failed"] or not merged["log"]):
            merged["log"] = result["log"]
    return merged


def _run_child(backend: str, names: list[str], world_size: int, timeout: float, start: str, gates: str,
               test_timeout: int, log_file: str | None, popen: Callable[..., Any]) -> dict:
    with tempfile.TemporaryDirectory() as temp:
        env = dict(os.environ, BACKEND=backend, WORLD_SIZE=str(world_size), TEMP_DIR=temp,
                   PYTHONPATH=ROOT, OMP_NUM_THREADS="1", TORCHSUITE_START=start, TORCHSUITE_GATES=gates,
                   DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(test_timeout),
                   # tests that destroy and re-form the default group do so on file:// only (as in torch's CI)
                   INIT_METHOD=f"file://{os.path.join(temp, 'reinit')}")
        child = popen([sys.executable, __file__, "--child", backend, *names], env=env, cwd=ROOT,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            return {"passed": [], "failed": {"(the run)": f"timed out after {timeout:g} s"}, "skipped": {}, "log": ""}
    if log_file:
        with open(log_file, "a") as f:
            f.write(stderr)
    match = re.search(r"^RESULT (.*)$", stdout, re.M)
    if not match:
        return {"passed": [], "failed": {"(the run)": f"crashed: exit {child.returncode}"}, "skipped": {},
                "log": stderr[-3000:]}
    return dict(json.loads(match.group(1)), log=stderr[-3000:])


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
    parser.add_argument("--start", choices=("fork", "spawn"), default="fork", help="how torch's harness starts ranks")
    parser.add_argument("--gates", choices=("gloo", "own"), default="gloo",
                        help="define jacklring's class as for gloo (default) or with torch's own skips")
    parser.add_argument("--test-timeout", type=int, default=120, help="seconds before torch's harness kills a test")
    parser.add_argument("--json", help="write every run's results to this file")
    parser.add_argument("--log", help="append the whole output of every run (torch's logs, stacks of hung ranks) here")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 unless the run agrees with torchsuite_expected.txt / torchsuite_excluded.txt")
    parser.add_argument("names", nargs="*")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.names)
        return 0
    names = list(args.names) or (every_test() if args.all or args.k else list(SUBSET))
    if args.k:
        names = [n for n in names if args.k in n]
    if args.list:
        print("\n".join(names))
        return 0
    backends = args.backends.split(",")
    table: dict[str, dict[str, list[int]]] = {b: {} for b in backends}
    passed_by: dict[str, set[str]] = {b: set() for b in backends}
    runs: list[dict] = []
    for run in range(args.runs):
        for backend in backends:
            start = time.monotonic()
            result = run_backend(backend, names, args.world_size, args.timeout, args.start, args.gates,
                                 args.test_timeout, args.log)
            runs.append(dict(result, backend=backend, run=run + 1, wall_s=round(time.monotonic() - start, 1)))
            for key in ("passed", "failed", "skipped"):
                table[backend].setdefault(key, []).append(len(result[key]))
            passed_by[backend].update(result["passed"])
            print(f"run {run + 1} {backend}: {len(result['passed'])} passed, {len(result['failed'])} failed, "
                  f"{len(result['skipped'])} skipped in {time.monotonic() - start:.0f} s", flush=True)
            for name, why in result["failed"].items():
                print(f"  FAILED {name}: {why}", flush=True)
            if result["failed"] and result.get("log"):
                print(result["log"][-1500:], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world_size": args.world_size, "gates": args.gates, "start": args.start, "runs": runs}, f,
                      indent=1)
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
    if args.check:
        always = {b: set.intersection(*[set(r["passed"]) for r in runs if r["backend"] == b]) for b in backends}
        problems = check_lists(names, always.get("jacklring", set()), passed_by.get("gloo", set()))
        print("\n".join(problems) if problems else "the lists agree with this run")
        return 1 if problems else 0
    return 0


def check_lists(names: list[str], jacklring: set[str], gloo: set[str]) -> list[str]:
    """The checked-in lists against a run of `names`: every expected test passed on jacklring
    (in every run), every test gloo passed is expected or excluded, no exclusion is stale."""
    expected, excluded = set(expected_tests()), excluded_tests()
    problems = [f"expected to pass on jacklring, did not: {n}" for n in sorted(expected & set(names) - jacklring)]
    problems += [f"gloo passes it, jacklring does not, and torchsuite_excluded.txt gives no reason: {n}"
                 for n in sorted(gloo - jacklring - set(excluded))]
    problems += [f"passes on jacklring now: move it from torchsuite_excluded.txt to torchsuite_expected.txt: {n}"
                 for n in sorted(set(excluded) & jacklring)]
    problems += [f"passes on jacklring and gloo but is not in torchsuite_expected.txt: {n}"
                 for n in sorted((jacklring & gloo) - expected)]
    return problems


def expected_tests() -> list[str]:
    """tests/torch/torchsuite_expected.txt: the tests that must pass on jacklring."""
    with open(os.path.join(HERE, "torchsuite_expected.txt")) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def excluded_tests() -> dict[str, str]:
    """tests/torch/torchsuite_excluded.txt: test name -> why jacklring does not pass it."""
    with open(os.path.join(HERE, "torchsuite_excluded.txt")) as f:
        rows = [line.strip().split(None, 1) for line in f if line.strip() and not line.startswith("#")]
    return {row[0]: row[1] if len(row) > 1 else "" for row in rows}


def every_test() -> list[str]:
    out = subprocess.run([sys.executable, "-c",
                          "from torch.testing._internal.distributed.distributed_test import DistributedTest as D;"
                          "print('\\n'.join(n for n in dir(D._DistTestBase) if n.startswith('test_')))"],
                         env=dict(os.environ, BACKEND="gloo", WORLD_SIZE="2", TEMP_DIR=tempfile.gettempdir()),
                         capture_output=True, text=True, check=True)
    return out.stdout.split()


if __name__ == "__main__":
    sys.exit(main())
