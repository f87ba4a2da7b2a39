"""The Work / Future contract of c10d's own backends (docs/torch.md), from Python and from C++
(DDP's reducer), for success and for every error kind. (The gloo features a torch user expects,
recv from any source, monitored_barrier, batch_isend_irecv and DDP join, share a launch in
test_three_rank_launch.py.)

Ranks are spawned here (tests/torch/torch_harness.py), never by our launcher, so nothing
stops a survivor before it has shown how it ends."""
from __future__ import annotations

import re
import signal

import pytest
import torch_harness as harness

pytest.importorskip("torch")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["mismatch", "deadline", "death"])
def test_failed_work_keeps_the_contract(kind):
    """wait() raises on the caller's thread; the future is done and failed for Python and C++;
    is_completed / is_success / exception / result and then() callbacks agree with it."""
    results = harness.run(2, "futures.py", kind, timeout=50)
    checked = [0, 1] if kind == "mismatch" else [0]
    for rank in checked:
        r = results[rank]
        assert r.returncode == 0 and f"ERROR CONTRACT OK {kind}" in r.stdout, "\n".join(x.report() for x in results)
    if kind == "deadline":
        assert "Timed out waiting 2000ms" in results[0].stdout, results[0].report()
    if kind == "death":
        assert results[1].returncode == -signal.SIGKILL, results[1].report()


def _train_and_lose_a_peer(event: str, case: str, n: int = 2, timeout: float = 60,
                           env: dict[str, str] | None = None) -> list[harness.Result]:
    """The last rank SIGKILLs or SIGSTOPs itself at step 3; a stopped one is killed at the end."""
    procs = harness.spawn(n, "training_failures.py", event, case, env=env)
    try:
        survivors = harness.collect(procs[:-1], timeout)
    finally:
        victim = procs[-1]
        victim.kill()
        out, err = victim.communicate()
    return survivors + [harness.Result(n - 1, victim.returncode, out, err)]


def _raised_within(results: list[harness.Result], low: float, high: float) -> None:
    died = re.search(r"VICTIM ([0-9.]+)", results[-1].stdout)
    assert died, results[-1].report()
    for r in results[:-1]:
        match = re.search(r"RAISED ([0-9.]+) (\w+): (.*)", r.stdout)
        assert r.returncode == 0 and match, "\n".join(x.report() for x in results)
        elapsed = float(match.group(1)) - float(died.group(1))
        assert low <= elapsed < high, f"rank {r.rank} raised {elapsed:.2f} s after the peer's end: {match.group(0)}"
        assert f"rank {r.rank}" in match.group(3) and f"rank {len(results) - 1}" in match.group(3), match.group(0)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", ["ddp", "ddp_hook", "fsdp2", "zero"])
def test_training_survivor_raises_within_a_second_of_a_peer_death(case):
    """Before the fix DDP's reducer read our failed future as a success and every survivor died
    with SIGSEGV; gloo raises RuntimeError in about 0.05 s in this harness."""
    results = _train_and_lose_a_peer("kill", case)
    assert results[-1].returncode == -signal.SIGKILL, results[-1].report()
    _raised_within(results, 0.0, 1.0)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", ["ddp", "zero"])
def test_training_survivor_raises_at_the_deadline_when_a_peer_stalls(case):
    results = _train_and_lose_a_peer("stall", case)
    _raised_within(results, 2.9, 5.0)
    assert "Timed out waiting 3000ms" in results[0].stdout, results[0].report()


@pytest.mark.timeout(90)
def test_ddp_survivors_of_a_three_rank_ring_raise_without_crashing():
    results = _train_and_lose_a_peer("kill", "ddp", n=3)
    for r in results[:-1]:
        assert r.returncode == 0 and "RAISED" in r.stdout and "Segmentation" not in r.stderr, r.report()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n, transport", [(3, "shm"), (3, "tcp"), (4, "tcp")])
def test_every_survivor_names_the_killed_rank(n, transport):
    """The victim (the last rank) is SIGKILLed during DDP training and rank 1 starts that step
    late, so it hears of the death from a survivor first (with 4 ranks over sockets rank 1 is
    not even the victim's neighbour). Every survivor's error must name the victim, never the
    survivor that passed the failure on (before the fix rank 1 named rank 0 or rank 2)."""
    results = _train_and_lose_a_peer("kill_late", "ddp", n=n, env=harness.clean_env(JACKLRING_LOCAL_TRANSPORT=transport))
    victim = n - 1
    assert results[-1].returncode == -signal.SIGKILL, results[-1].report()
    for r in results[:-1]:
        match = re.search(r"RAISED [0-9.]+ \w+: (.*)", r.stdout)
        assert r.returncode == 0 and match, "\n".join(x.report() for x in results)
        named = {int(q) for q in re.findall(r"\brank (\d+)\b", match.group(1))} - {r.rank}
        assert f"rank {victim} " in match.group(1) + " " and named <= {victim} | _reporters(match.group(1)), \
            f"rank {r.rank} does not name the killed rank {victim}: {match.group(1)}"
        # torch re-raises DDP's error as a RuntimeError of text only: the culprit rides in it
        assert f"CULPRIT {victim}\n" in r.stdout, f"rank {r.rank}: adapter.culprit_of() is not {victim}\n{r.stdout}"


def _reporters(message: str) -> set[int]:
    """Ranks a message names only as the ones that reported the death."""
    return {int(q) for q in re.findall(r"reported by rank (\d+)", message)}
