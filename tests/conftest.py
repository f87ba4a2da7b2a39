import compileall
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# tests import their helpers (ranks.py, sshd.py) as top-level modules
sys.path.insert(0, HERE)

# Every rank process a test spawns inherits this: a rank that crashes (SIGSEGV, SIGABRT) prints
# the Python stack of each of its threads, so a rare crash in CI says where it happened.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

# The suite runs four workers on two cores, each starting groups of two to four ranks: the host
# has more ranks than CPUs, and a rank cannot see the ranks of the tests beside it. Tell the
# ranks: a waiter spinning or yielding while the peer it waits for is descheduled only takes CPU
# from the tests beside it. The
# folders of the two transports whose waits these settings tune (tests/shm, tests/ring) run
# with the library's defaults (the library_wait_defaults fixture below).
OVERSUBSCRIBED_WAITS = {"JACKLRING_SPIN_US": "0", "JACKLRING_SHM_YIELD_US": "0"}
for _name, _value in OVERSUBSCRIBED_WAITS.items():
    os.environ.setdefault(_name, _value)
WAIT_DEFAULT_FOLDERS = ("tests/shm/", "tests/ring/")


def _compile_the_repository() -> None:
    """Byte-compile the repository's modules into their __pycache__ folders (gitignored) once per
    session. Under PYTHONDONTWRITEBYTECODE=1 no process writes them, so each of the thousands of
    rank processes the suite starts compiled every module it imported from source again: about a
    third of the CPU of a small launch (a 2-rank all_sum under the launcher: 1.5 -> 1.0 CPU-s).
    Reading cached bytecode is still allowed; stale files are never used (Python checks each
    source's size and mtime)."""
    if not sys.flags.dont_write_bytecode:
        return  # the processes cache what they compile themselves
    for folder in ("adapter", "launcher", "jacklring_shared", "tests", "examples"):
        compileall.compile_dir(os.path.join(ROOT, folder), quiet=2, workers=1)


_compile_the_repository()


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """Let pytest cache the test modules it rewrites (assert introspection) while it collects
    them. Under PYTHONDONTWRITEBYTECODE=1 it rewrote all of them at every start: about 12 of
    the 25 CPU-s a collection took here, paid again by each xdist worker. Its cache files
    (__pycache__/*-pytest-*.pyc, gitignored) are written atomically, so workers can share them;
    the rank processes the tests start still write no bytecode."""
    saved = sys.dont_write_bytecode
    sys.dont_write_bytecode = False
    try:
        return (yield)
    finally:
        sys.dont_write_bytecode = saved


# ---- running in parallel (pytest-xdist: `-n auto --dist loadgroup` in pyproject's addopts) ----
#
# Most of the suite's wall time is rank processes waiting (on sockets, on deadlines, on start-up)
# rather than computing, so two or three test processes at once fill the cores that one leaves
# idle. Tests are handed out one at a time, except those that share something costly or
# singular: each file (or folder) below runs whole on one worker.
XDIST_GROUPS = {
    # a session fixture launches every (variant, size) the worker's contract tests need, once:
    # split over workers, each would launch them all
    "tests/contract/": "contract",
    # module fixtures that launch ranks (or a reference run) once for many tests
    "tests/api/test_gradients.py": "gradients",
    "tests/api/test_parallel.py": "parallel",
    "tests/repository/test_examples.py": "examples",
    "tests/torch/test_compile.py": "compile",
    "tests/torch/test_three_rank_launch.py": "three_rank_launch",
    "tests/torch/test_two_rank_launch.py": "two_rank_launch",
    # a one-node Slurm (munged, slurmctld, slurmd) started for the module
    "tests/engines/test_slurm.py": "slurm",
}


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: PYTEST_XDIST_AUTO_NUM_WORKERS if set; no workers for a run of named tests
    (`pytest tests/x/test_y.py::name`: starting workers would cost more than it saves);
    otherwise as many as the machine has cores, at least 4: the tests mostly wait; on 2 cores a
    third worker ran the suite in 475 s instead of 557 s with the same CPU time, and once the
    suite had grown, a fourth in 431 s instead of 487-508 s (fresh clones, quiet host)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    args = [a for a in config.args if not a.startswith("-")]
    if args and all("::" in a for a in args):
        return 0
    return max(4, len(os.sched_getaffinity(0)))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Mark the grouped files, and on an xdist worker append "@group" to their test ids: what
    --dist loadgroup's scheduler groups by. xdist 3.8 appends it itself, in a hook that runs
    before this one, into Node._nodeid, which pytest 9 no longer reads (Node._id): the groups
    were silently dropped, every worker ran its share of a group and set up the group's costly
    launches again (the contract's 25 launches, a one-node Slurm, the module fixtures)."""
    grouping = getattr(config.option, "loadgroup", False)  # set on xdist workers under --dist loadgroup
    if grouping:
        items[:] = _interleaved_by_folder(items)
    for item in items:
        path = os.path.relpath(str(item.path), ROOT).replace(os.sep, "/")
        for prefix, group in XDIST_GROUPS.items():
            if path.startswith(prefix):
                item.add_marker(pytest.mark.xdist_group(group))
                if grouping and "@" not in item.nodeid:
                    _set_nodeid(item, f"{item.nodeid}@{group}")
                break


def _interleaved_by_folder(items: list[pytest.Item]) -> list[pytest.Item]:
    """The tests in an order that spreads each folder of tests/ evenly over the run, keeping the
    order within a folder. The scheduler hands out tests in collection order (the groups first,
    largest first), and in alphabetical order the folders came in blocks: the torch, engine and
    example tests, which compute, all in the first half, and the fault and security tests, which
    mostly wait on deadlines, all together later, when the cores sat partly idle. Mixed, one
    worker's waits overlap the others' computing. Every worker sorts the same collection the
    same way, as the scheduler requires."""
    by_folder: dict[str, list[pytest.Item]] = {}
    for item in items:
        path = os.path.relpath(str(item.path), HERE).replace(os.sep, "/")
        by_folder.setdefault(path.split("/")[0], []).append(item)
    keyed = [((i + 0.5) / len(folder), name, i, item)
             for name, folder in by_folder.items() for i, item in enumerate(folder)]
    return [item for *_, item in sorted(keyed, key=lambda k: k[:3])]


def _set_nodeid(item: pytest.Item, nodeid: str) -> None:
    if hasattr(item, "_id"):  # pytest >= 9: a structured NodeId that keeps the string it was parsed from
        from _pytest.nodeid import NodeId
        item._id = NodeId.parse(nodeid)
    else:
        item._nodeid = nodeid


@pytest.fixture(autouse=True)
def library_wait_defaults(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """In WAIT_DEFAULT_FOLDERS the ranks a test starts wait as the library decides by itself,
    not as in the oversubscribed suite: the suite's settings are removed, a user's own kept."""
    path = os.path.relpath(str(request.node.path), ROOT).replace(os.sep, "/")
    if not path.startswith(WAIT_DEFAULT_FOLDERS):
        return
    for name, value in OVERSUBSCRIBED_WAITS.items():
        if os.environ.get(name) == value:
            monkeypatch.delenv(name)


def pytest_sessionfinish(session):
    """Stop this worker's zygote (tests/zygote.py), if a test started one."""
    if "zygote" in sys.modules:
        sys.modules["zygote"].stop()


def pytest_configure(config):
    """Each xdist worker draws free ports from its own slice of the range below the ephemeral
    one (JACKLRING_LOCAL_PORTS, inherited by the launchers and ranks its tests start): a test
    binds the port it drew seconds later, after a rank's imports, so two workers drawing from
    one range could pick the same port for tests running side by side."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker.startswith("gw") and count > 1 and not os.environ.get("JACKLRING_LOCAL_PORTS"):
        from jacklring_shared import ports
        low, high = ports.LOWEST, ports.ephemeral_range()[0]
        span = (high - low) // count
        first = low + int(worker[2:]) * span
        os.environ["JACKLRING_LOCAL_PORTS"] = f"{first}-{first + span - 1}"
