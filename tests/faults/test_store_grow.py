"""Group.grow() of a ring formed through torch's env:// store (rendezvous/store_grow.py), with real
processes: 3 ranks formed from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, slot 2 killed, the
survivors shrink; an outsider (another uid, no job key) squats a dead newcomer's knock address
and then forges a knock record, and both are refused with the group unchanged; a real newcomer
(JACKLRING_JOIN=1, RANK=2) is taken in as rank 2 and the grown group sums right; its knock record
replayed after it died is passed over as used; a newcomer for slot 0 refuses at once. Without a
secret, it goes on: a recruiter that stops before its decision is named by the newcomer and by
the other member, and once rank 0 (the store's server) is dead the survivor's grow() refuses at
once."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster import FAULTS, SECRETS, base_env, finish_all, rank_envs, reports, start, stop_all
from test_grow import ATTACK

# Members: form, loop all_sum until slot 2 dies, shrink, then one grow per stage the harness
# opens (a file in FAULT_DIR): "squat" and "forged" must be refused, "newcomer" grows. After
# every grow attempt the group's all_sum is checked; the grown group (the newcomer too) then
# loops until the newcomer is killed, shrinks, and tries once more ("stale"). With FAULT_STALL=1
# the members then grow with a second newcomer ("stall": rank 0 stops itself) and, after rank 0
# is killed and rank 1 shrinks alone, once more ("slot0").
BODY = r"""
slot = int(os.environ["RANK"])

def go(stage):
    end = time.monotonic() + 40
    while not os.path.exists(os.path.join(os.environ["FAULT_DIR"], stage)):
        if time.monotonic() > end:
            say("NOGO", stage)
            sys.exit(3)
        time.sleep(0.02)

def check(group, tag):
    slots = all_gather(np.array([slot], np.int64))
    y = all_sum(np.full(4096, float(slot + 1), np.float32))
    expected = float(sum(int(s) + 1 for s in slots))
    say(tag, group.rank(), group.size(), ",".join(str(int(s)) for s in slots), bool(np.all(y == expected)))

def attempt(group, stage, timeout):
    go(stage)
    t = time.monotonic()
    try:
        group.grow(timeout=timeout)
        say("GREW", stage)
    except ERRORS as e:
        say("REFUSED", stage, f"{time.monotonic() - t:.2f}", type(e).__name__, str(e).replace("\n", " "))
    check(group, "KEPT")

def until_a_death(group, min_size=None):
    x, failed = np.ones(1024, np.float32), None
    while failed is None:
        try:
            all_sum(x)
        except ERRORS as e:
            failed = e
    say("ERR", type(failed).__name__)
    group = group.shrink(timeout=3, min_size=min_size)
    say("SHRUNK", group.rank(), group.size())
    return group

def stall_then_lose_slot_0(group):
    # Rank 0 (the recruiter) stops itself once the newcomer accepted, before it sends the decision.
    if group.rank() == 0:
        import signal
        from adapter.backends.elastic import enrolment
        recruit = enrolment.recruit
        def recruit_then_stop(*args, **kwargs):
            got = recruit(*args, **kwargs)
            if not isinstance(got, str):
                say("RECRUITED")
                os.kill(os.getpid(), signal.SIGSTOP)
            return got
        enrolment.recruit = recruit_then_stop
    group.backend.set_timeout(1.0)  # so the broadcast's deadline is grow's timeout + 10 s
    go("stall")
    t = time.monotonic()
    try:
        group.grow(timeout=1)
        say("GREW", "stall")
    except ERRORS as e:
        say("REFUSED", "stall", f"{time.monotonic() - t:.2f}", type(e).__name__, getattr(e, "culprit", None),
            str(e).replace("\n", " "))
    group = until_a_death(group, min_size=1)  # the harness kills rank 0: the store dies with it
    attempt(group, "slot0", 15)

if os.environ.get("JACKLRING_JOIN") != "1":
    say("READY")
    group = until_a_death(group)
    attempt(group, "squat", 1.5)
    attempt(group, "forged", 1.5)
    go("newcomer")
    t = time.monotonic()
    group = group.grow(timeout=15)
    say("GROWN", f"{time.monotonic() - t:.2f}")
check(group, "SUM")
if os.environ.get("JACKLRING_JOIN") != "1":
    group = until_a_death(group)
    attempt(group, "stale", 1.0)
    if os.environ.get("FAULT_STALL") == "1":
        stall_then_lose_slot_0(group)
else:
    x = np.ones(1024, np.float32)
    while True:
        all_sum(x)
"""

OUTSIDER = FAULTS / "scripts" / "store_outsider.py"


def outsider_prefix() -> list[str]:
    """Run as uid 65534 (nobody) when setpriv can, else as this uid."""
    if os.geteuid() == 0 and shutil.which("setpriv"):
        return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    return []


class Outsider:
    def __init__(self, port: int, tmp: Path) -> None:
        env = base_env(PYTHONPATH="")
        cmd = [sys.executable, str(OUTSIDER), "127.0.0.1", str(port), "jacklring/addr/f0/"]
        self.popen = subprocess.Popen(outsider_prefix() + cmd, env=env, cwd="/", stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def ask(self, command: str, answer: str, timeout: float = 25) -> str:
        self.popen.stdin.write(command + "\n")
        self.popen.stdin.flush()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.popen.stdout.readline()
            if not line:
                break
            if line.split()[:1] == [answer]:
                return line.strip()
        raise AssertionError(f"the outsider said no {answer!r} to {command!r}: exit {self.popen.poll()}, "
                             f"stderr {self.popen.stderr.read() if self.popen.poll() is not None else ''}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()


def refused(proc, stage: str) -> list[str]:
    fields = proc.wait_line("REFUSED", 15)
    assert fields[2] == stage, fields
    kept = proc.wait_line("KEPT", 10)
    assert kept[2:] == [str(proc.rank), "2", "0,1", "True"], kept
    return fields


@pytest.mark.timeout(90)
@pytest.mark.parametrize("secret", list(SECRETS))
def test_a_store_group_grows_through_the_store_and_refuses_outsiders(tmp_path, secret):
    envs = rank_envs("torch", 3, tmp_path)
    port = int(envs[0]["MASTER_PORT"])
    stalls = secret == "no-secret"  # the stalled recruiter and the lost slot 0: once is enough
    env = {"FAULT_DIR": str(tmp_path), "JACKLRING_LOCAL_TRANSPORT": "tcp", "JACKLRING_CONNECT_TIMEOUT": "40",
           "FAULT_STALL": "1" if stalls else "0", **SECRETS[secret]}
    procs = start("any", 3, BODY, tmp_path, env=env, envs=envs)
    joining = {**env, "JACKLRING_JOIN": "1"}
    # A newcomer that knocks and dies before anyone took it in: its record stays, with its address.
    [dead] = start("any", 3, BODY, tmp_path, env=joining, envs=envs, ranks=[2])
    # A newcomer for slot 0: the store lived in rank 0's process, so it refuses at once.
    slot0 = start("any", 3, BODY, tmp_path, env=joining, envs=[{**envs[0], "MASTER_PORT": "9"}], ranks=[0])[0]
    outsider = Outsider(port, tmp_path)
    newcomer = squatter = stalled = None
    try:
        for p in procs:
            p.wait_line("READY", 40)
        record = outsider.ask("read 2", "RECORD").split(" ", 1)[1]
        host, _, knocked = json.loads(json.loads(record.split(" ", 2)[2])["knock"])["address"].rpartition(":")
        dead.kill(signal.SIGKILL)
        dead.finish(5)
        procs[2].kill(signal.SIGKILL)
        for p in procs[:2]:
            p.wait_line("SHRUNK", 15)

        # 1. An outsider listens at the dead newcomer's knock address: it fails the handshake.
        squatter = subprocess.Popen(outsider_prefix() + ["/usr/bin/python3", "-c", ATTACK, host, knocked, "4"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
        assert squatter.stdout.readline().split() == ["LISTENING"], squatter.stderr.read()
        (tmp_path / "squat").touch()
        for p in procs[:2]:
            fields = refused(p, "squat")
            assert float(fields[3]) < 6 and fields[4] == "CollectiveTimeout", fields
        assert "did not prove the job secret" in " ".join(refused_text(procs[0], "squat")), procs[0].stdout
        seen = squatter.communicate(timeout=10)[0].split()
        assert seen[:1] == ["SEEN"] and int(seen[1]) >= 1, seen

        # 2. It overwrites slot 2's knock record with one whose MAC it guessed: tampering.
        outsider.ask("forge 2", "FORGED")
        (tmp_path / "forged").touch()
        for p in procs[:2]:
            fields = refused(p, "forged")
            assert float(fields[3]) < 6 and fields[4] == "IntegrityError", fields
        text = " ".join(refused_text(procs[0], "forged"))
        assert "knock record of the newcomer at slot 2" in text and "tampered" in text, text

        # 3. The real newcomer knocks (its record replaces the forged one) and is taken in as rank 2.
        started = time.monotonic()
        [newcomer] = start("any", 3, BODY, tmp_path, env=joining, envs=envs, ranks=[2])
        outsider.ask("read 2", "RECORD")  # kept, to replay later
        (tmp_path / "newcomer").touch()
        for p in procs[:2] + [newcomer]:
            fields = p.wait_line("SUM", 30)
            assert fields[2:] == [str(2 if p is newcomer else p.rank), "3", "0,1,2", "True"], fields
        print(f"store newcomer: start to its first correct sum {float(fields[1]) - started:.2f} s")

        # 4. The newcomer dies; its record, replayed, was used by the grow that took it in.
        newcomer.kill(signal.SIGKILL)
        for p in procs[:2]:
            p.wait_line("SHRUNK", 15)
        outsider.ask("replay 2", "REPLAYED")
        (tmp_path / "stale").touch()
        for p in procs[:2]:
            fields = refused(p, "stale")
            assert fields[4] == "CollectiveTimeout", fields
        text = " ".join(refused_text(procs[0], "stale"))
        assert "was used by an earlier grow" in text, text

        if stalls:
            stalled = stall_then_lose_slot_0(procs, tmp_path, envs, joining)
        init_error = " ".join(slot0.wait_line("INITERR", 30))
        assert "ConfigError" in init_error and "died with it" in init_error, init_error
        codes = finish_all(procs[:2] + [slot0], 15)
    finally:
        outsider.stop()
        if squatter is not None and squatter.poll() is None:
            squatter.kill()
            squatter.wait()
        stop_all(procs + [dead, slot0] + [p for p in (newcomer, stalled) if p])
    assert codes == [-9 if stalls else 0, 0, 4], reports(procs + [slot0])


def stall_then_lose_slot_0(procs, tmp_path, envs, joining):
    """5. A newcomer knocks; rank 0 recruits it and stops (SIGSTOP) before the decision. The
    newcomer warns after grow's timeout + 5 s and ends at its own deadline saying so; rank 1
    raises naming rank 0 at its broadcast deadline (timeout + 10 s). 6. Rank 0 is killed, and
    the store with it: rank 1 shrinks to a group of one, whose grow() refuses at once."""
    [stalled] = start("any", 3, BODY, tmp_path, envs=envs, ranks=[2],
                      env={**joining, "JACKLRING_CONNECT_TIMEOUT": "10", "MLX_RING_VERBOSE": "1"})
    wait_stderr(stalled, "slot 2: knocked at store key", 30)
    (tmp_path / "stall").touch()
    stopped = float(procs[0].wait_line("RECRUITED", 15)[1])
    fields = procs[1].wait_line("REFUSED", 25)
    assert fields[2] == "stall" and fields[5] == "0" and "rank 0" in " ".join(fields[6:]), fields  # culprit 0
    assert 10.5 < float(fields[3]) < 14, fields  # grow(timeout=1): the broadcast's deadline is 11 s
    member_s = float(fields[1]) - stopped
    error = stalled.wait_line("INITERR", 15)
    # At its deadline (10 s from its knock), and late by what its last store calls wait on the
    # stopped store server (rank 0's process): 1-3 s, at most the store's timeout (10 s) more.
    newcomer_s = float(error[1]) - stopped
    assert 6 < newcomer_s < 22, (newcomer_s, stalled.report())
    assert error[2] == "CollectiveTimeout" and "rank 0 (the recruiter) invited it, then sent no decision within " \
        "1 s + 5 s: it stopped or stalled" in " ".join(error), error
    warned = stalled.stderr
    assert "slot 2: rank 0 (the recruiter of a grow) invited this process, then sent no decision within 6 s" \
        in warned, warned
    procs[0].kill(signal.SIGKILL)
    assert procs[1].wait_line("SHRUNK", 15)[2:] == ["0", "1"], procs[1].report()
    (tmp_path / "slot0").touch()
    fields = procs[1].wait_line("REFUSED", 15)
    text = " ".join(fields[5:])
    assert fields[2] == "slot0" and fields[4] == "DistributedError" and float(fields[3]) < 1.0, fields  # of 15 s
    assert "was served by rank 0's process (slot 0), which is gone" in text, text
    assert procs[1].wait_line("KEPT", 10)[2:] == ["0", "1", "1", "True"], procs[1].report()
    print(f"stalled recruiter: after rank 0 stopped, the newcomer ended {newcomer_s:.2f} s and rank 1 raised "
          f"{member_s:.2f} s later; slot 0 vacant: grow refused in {fields[3]} s; the newcomer exits "
          f"{stalled.finish(15)}")
    return stalled


def wait_stderr(proc, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in proc.stderr:
        if time.monotonic() > deadline or (proc.popen.poll() is not None and proc.readers_done.is_set()):
            raise AssertionError(f"rank {proc.rank} wrote no {text!r} within {timeout} s\n{proc.report()}")
        time.sleep(0.02)


def refused_text(proc, stage: str) -> list[str]:
    return next(fields for fields in proc.tagged("REFUSED") if fields[2] == stage)
