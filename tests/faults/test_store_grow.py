"""Group.grow() of a ring formed through torch's env:// store (rendezvous/store_grow.py), with real
processes: 3 ranks formed from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, slot 2 killed, the
survivors shrink; an outsider (another uid, no job key) squats a dead newcomer's knock address
and then forges a knock record, and both are refused with the group unchanged; a real newcomer
(JACKLRING_JOIN=1, RANK=2) is taken in as rank 2 and the grown group sums right; its knock record
replayed after it died is passed over as used; a newcomer for slot 0 refuses at once."""
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
from cluster import FAULTS, base_env, finish_all, rank_envs, reports, start, stop_all
from test_grow import ATTACK

# Members: form, loop all_sum until slot 2 dies, shrink, then one grow per stage the harness
# opens (a file in FAULT_DIR): "squat" and "forged" must be refused, "newcomer" grows. After
# every grow attempt the group's all_sum is checked; the grown group (the newcomer too) then
# loops until the newcomer is killed, shrinks, and tries once more ("stale").
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

def until_a_death(group):
    x, failed = np.ones(1024, np.float32), None
    while failed is None:
        try:
            all_sum(x)
        except ERRORS as e:
            failed = e
    say("ERR", type(failed).__name__)
    group = group.shrink(timeout=3)
    say("SHRUNK", group.rank(), group.size())
    return group

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


# How most users start (no secret: the key comes from the host's 0600 file), and a passphrase
# (stretched): the outsider knows neither.
SECRETS = {"no-secret": {}, "passphrase": {"JACKLRING_SECRET": "velvet-quarry-lantern-mosaic-thimble-orchard-gazebo"}}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("secret", list(SECRETS))
def test_a_store_group_grows_through_the_store_and_refuses_outsiders(tmp_path, secret):
    envs = rank_envs("torch", 3, tmp_path)
    port = int(envs[0]["MASTER_PORT"])
    env = {"FAULT_DIR": str(tmp_path), "JACKLRING_LOCAL_TRANSPORT": "tcp", "JACKLRING_CONNECT_TIMEOUT": "40",
           **SECRETS[secret]}
    procs = start("any", 3, BODY, tmp_path, env=env, envs=envs)
    joining = {**env, "JACKLRING_JOIN": "1"}
    # A newcomer that knocks and dies before anyone took it in: its record stays, with its address.
    [dead] = start("any", 3, BODY, tmp_path, env=joining, envs=envs, ranks=[2])
    # A newcomer for slot 0: the store lived in rank 0's process, so it refuses at once.
    slot0 = start("any", 3, BODY, tmp_path, env=joining, envs=[{**envs[0], "MASTER_PORT": "9"}], ranks=[0])[0]
    outsider = Outsider(port, tmp_path)
    newcomer = squatter = None
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

        init_error = " ".join(slot0.wait_line("INITERR", 30))
        assert "ConfigError" in init_error and "died with it" in init_error, init_error
        codes = finish_all(procs[:2] + [slot0], 15)
    finally:
        outsider.stop()
        if squatter is not None and squatter.poll() is None:
            squatter.kill()
            squatter.wait()
        stop_all(procs + [dead, slot0] + ([newcomer] if newcomer else []))
    assert codes == [0, 0, 4], reports(procs + [slot0])


def refused_text(proc, stage: str) -> list[str]:
    return next(fields for fields in proc.tagged("REFUSED") if fields[2] == stage)
