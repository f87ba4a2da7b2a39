"""Group.grow() of a JACCL group on the TCP mesh, with real processes: a rank dies, the survivors
shrink, a replacement started with JACKLRING_JOIN=1 at the dead rank's MLX_RANK knocks at
MLX_JACCL_COORDINATOR, where the process of the job's first rank 0 takes it in, and the grown
group sums right on every rank. Without that process nobody can recruit, and a knock without
the job key is turned away."""
from __future__ import annotations

import signal
import subprocess
import time

import pytest
from cluster import ATTACK, SECRETS, again_and_again, finish_all, grow_back, rank_envs, reports, start, stop_all

WRONG_SECRET = "77726f6e672d7365637265742d6f662d6f7468"
SECRET = "6a61636b6c72696e672d746573742d6b65792d61"


def shrunk_after_killing(victim: int, tmp_path, body: str, env: dict[str, str] | None = None):
    """3 JACCL ranks on the TCP mesh run `body` (grow_back's); `victim` is killed once all are
    ready and the other two have shrunk. Returns (envs, procs)."""
    envs = rank_envs("jaccl", 3, tmp_path)
    procs = start("jaccl", 3, body, tmp_path, env=env, envs=envs)
    for p in procs:
        p.wait_line("READY", 30)
    procs[victim].kill(signal.SIGKILL)
    for p in procs:
        if p.rank != victim:
            p.wait_line("SHRUNK", 15)
    return envs, procs


def still_sum(procs, members: list[int], total: str) -> None:
    """After their grow() failed, the members' shrunk group of two sums right (AFTER lines:
    new rank, size, sum of slot + 1) and they exit 0."""
    for new_rank, i in enumerate(members):
        after = procs[i].wait_line("AFTER", 10)
        assert after[2:] == [str(new_rank), "2", total], after
    codes = finish_all(procs, 15)
    assert [codes[i] for i in members] == [0, 0], reports(procs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "auto"], ids=["tcp", "shared-memory"])
def test_kill9_shrink_then_a_replacement_knocks_and_the_grown_group_sums_right(tmp_path, transport):
    env = {"JACKLRING_LOCAL_TRANSPORT": transport}
    procs = []
    try:
        envs, procs = shrunk_after_killing(2, tmp_path, grow_back(grow_timeout=10), env)
        started = time.monotonic()
        procs += start("jaccl", 3, grow_back(), tmp_path, env={**env, "JACKLRING_JOIN": "1"}, envs=envs, ranks=[2])
        sums = {}
        for i in (0, 1, 3):
            fields = procs[i].wait_line("SUM", 20)
            _, t, new_rank, size, slots, got, expected, ok = fields
            assert ok == "True" and got == expected == "6.0", fields
            assert slots == "0,1,2" and size == "3", fields
            sums[i] = (int(new_rank), float(t))
        for i in (0, 1):
            old = " ".join(procs[i].wait_line("OLD", 5))
            assert "this group was grown into a group of 3" in old and "use the Group grow() returned" in old, old
        codes = finish_all(procs, 15)
    finally:
        stop_all(procs)
    assert [sums[i][0] for i in (0, 1, 3)] == [0, 1, 2], sums
    assert [codes[i] for i in (0, 1, 3)] == [0, 0, 0], reports(procs)
    print(f"JACCL {transport}: replacement start to its first correct all_sum: {sums[3][1] - started:.2f} s")


@pytest.mark.timeout(60)
def test_two_deaths_two_replacements_in_turn(tmp_path):
    """Slot 2 dies and is replaced, then slot 1 dies and is replaced: the grown group (a newcomer
    among its members) shrinks and grows in turn, and the slots carry through."""
    envs = rank_envs("jaccl", 3, tmp_path)
    text = again_and_again(tmp_path / "stop")
    procs = start("jaccl", 3, text, tmp_path, envs=envs)
    try:
        for p in procs:
            p.wait_line("READY", 30)
        procs[2].kill(signal.SIGKILL)
        for i in (0, 1):
            procs[i].wait_line("SHRUNK", 15)
        procs += start("jaccl", 3, text, tmp_path, env={"JACKLRING_JOIN": "1"}, envs=envs, ranks=[2])
        firsts = {i: procs[i].wait_line("GROWN", 20)[2:] for i in (0, 1, 3)}
        procs[1].kill(signal.SIGKILL)
        for i in (0, 3):
            procs[i].wait_line("SHRUNK", 15)
        procs += start("jaccl", 3, text, tmp_path, env={"JACKLRING_JOIN": "1"}, envs=envs, ranks=[1])
        seconds = {i: procs[i].wait_line("GROWN", 20)[2:] for i in (0, 3, 4)}
        (tmp_path / "stop").write_text("")
        ends = {i: procs[i].wait_line("END", 20)[2:] for i in (0, 3, 4)}
        codes = finish_all(procs, 15)
    finally:
        stop_all(procs)
    assert firsts == {0: ["0", "3", "0,1,2"], 1: ["1", "3", "0,1,2"], 3: ["2", "3", "0,1,2"]}, firsts
    # after slot 1's death: slots 0 and 2 are ranks 0 and 1, the newcomer in slot 1 is rank 2
    assert seconds == {0: ["0", "3", "0,2,1"], 3: ["1", "3", "0,2,1"], 4: ["2", "3", "0,2,1"]}, seconds
    assert all(e[1:] == ["3", "0,2,1", "6.0"] for e in ends.values()), ends
    assert not any(p.tagged("BAD") for p in procs), reports(procs)
    assert [codes[i] for i in (0, 3, 4)] == [0, 0, 0], reports(procs)


@pytest.mark.timeout(60)
def test_without_the_coordinators_process_grow_refuses_at_once(tmp_path):
    """Rank 0 (slot 0, the only process that can listen at MLX_JACCL_COORDINATOR) dies: the
    survivors' grow() raises DistributedError at once, saying why, and their group still works."""
    procs = []
    try:
        _, procs = shrunk_after_killing(0, tmp_path, grow_back(grow_timeout=10))
        for i in (1, 2):
            shrunk = float(procs[i].tagged("SHRUNK")[0][1])
            fields = procs[i].wait_line("GROWERR", 10)
            assert fields[2] == "DistributedError", fields
            text = " ".join(fields[3:])
            assert "nobody can recruit" in text and "MLX_JACCL_COORDINATOR=" in text and "slot 0" in text, text
            assert float(fields[1]) - shrunk < 2.0, (shrunk, fields)  # not after the grow timeout (10 s)
        still_sum(procs, [1, 2], "5.0")  # slots 1 and 2: 2 + 3
    finally:
        stop_all(procs)


@pytest.mark.timeout(60)
def test_a_knock_without_the_job_secret_is_turned_away(tmp_path):
    """A process with another secret knocks for the vacant slot: the members' grow() raises
    CollectiveTimeout naming the rejected connection, their group still works, and the outsider's
    init() gives up at its deadline naming the coordinator and the refusal."""
    go = tmp_path / "go"
    env = {"JACKLRING_SECRET": SECRET, "FAULT_GO": str(go)}
    procs = []
    try:
        envs, procs = shrunk_after_killing(2, tmp_path, grow_back(grow_timeout=3), env)
        procs += start("jaccl", 3, grow_back(), tmp_path, envs=envs, ranks=[2],
                       env={"JACKLRING_SECRET": WRONG_SECRET, "JACKLRING_JOIN": "1",
                            "JACKLRING_CONNECT_TIMEOUT": "6"})
        procs[3].wait_line("INIT", 15)
        go.write_text("")  # the members grow once the outsider knocks
        for i in (0, 1):
            fields = procs[i].wait_line("GROWERR", 20)
            assert fields[2] == "CollectiveTimeout", fields
            text = " ".join(fields[3:])
            assert "only 0 of 1 newcomer(s) joined" in text and "slot 2" in text, text
            assert "unauthenticated connection(s) were rejected" in text, text
        initerr = " ".join(procs[3].wait_line("INITERR", 15))
        still_sum(procs, [0, 1], "3.0")  # slots 0 and 1: 1 + 2
    finally:
        stop_all(procs)
    assert "CollectiveTimeout" in initerr and "MLX_JACCL_COORDINATOR=" in initerr, initerr
    assert "refused this rank's proof" in initerr, initerr
    assert not procs[3].tagged("GROWN") and not procs[3].tagged("SUM"), procs[3].report()


DIE_BEFORE_FORMING = """
from adapter.backends.transport import mesh_forming
def die(*args, **kwargs):  # told the decision, then gone before the grown mesh forms
    say("DYING")
    os._exit(3)
mesh_forming.connect_mesh = die
"""


@pytest.mark.timeout(60)
def test_a_newcomer_that_dies_after_the_decision_leaves_the_members_group_usable(tmp_path):
    procs = []
    try:
        envs, procs = shrunk_after_killing(2, tmp_path, grow_back(grow_timeout=10))
        procs += start("jaccl", 3, grow_back(), tmp_path, envs=envs, ranks=[2],
                       env={"JACKLRING_JOIN": "1", "FAULT_BEFORE_INIT": DIE_BEFORE_FORMING})
        died = float(procs[3].wait_line("DYING", 20)[1])
        for i in (0, 1):
            fields = procs[i].wait_line("GROWERR", 10)
            text = " ".join(fields[3:])
            assert fields[2] == "PeerError" and "did not form" in text and "this group stays as it was" in text, fields
            assert "rank 2 (slot 2," in text and "died while the grown mesh formed" in text, text
            assert float(fields[1]) - died < 3.0, (died, fields)  # seen by the watch, not at a deadline
        still_sum(procs, [0, 1], "3.0")
    finally:
        stop_all(procs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("secret", list(SECRETS))
def test_another_user_cannot_take_the_coordinator_address_between_grows(tmp_path, secret):
    """The job's first rank 0 holds MLX_JACCL_COORDINATOR from init on (the side channel's
    listener, kept): a process of uid 65534 cannot listen there once the group shrank, and the
    grow takes the newcomer in (before, the squatter listened and grow() raised)."""
    go = tmp_path / "go"
    procs = []
    try:
        envs, procs = shrunk_after_killing(2, tmp_path, grow_back(grow_timeout=10),
                                           {"FAULT_GO": str(go), **SECRETS[secret]})
        host, port = envs[0]["MLX_JACCL_COORDINATOR"].rsplit(":", 1)
        squatter = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                   "/usr/bin/python3", "-c", ATTACK, host, port, "3"],
                                  capture_output=True, text=True, cwd="/", timeout=20)
        assert "Address already in use" in squatter.stderr, squatter.stdout + squatter.stderr
        procs += start("jaccl", 3, grow_back(), tmp_path, envs=envs, ranks=[2],
                       env={"JACKLRING_JOIN": "1", "JACKLRING_CONNECT_TIMEOUT": "20", **SECRETS[secret]})
        go.write_text("")
        for i in (0, 1, 3):
            fields = procs[i].wait_line("SUM", 20)
            assert fields[3:5] == ["3", "0,1,2"] and fields[5] == fields[6] == "6.0", fields
        codes = finish_all(procs, 15)
    finally:
        stop_all(procs)
    assert [codes[i] for i in (0, 1, 3)] == [0, 0, 0], reports(procs)


RECRUITER_DIES_AFTER_TELLING = """
if r == 0 and os.environ.get("JACKLRING_JOIN") != "1":
    import signal
    from adapter.backends.elastic import enrolment
    real_tell = enrolment.tell
    def tell(channel, message, deadline):  # the newcomer is told the decision, the members are not
        failed = real_tell(channel, message, deadline)
        if message.get("kind") == "decision":
            say("DYING")
            os.kill(os.getpid(), signal.SIGKILL)
        return failed
    enrolment.tell = tell
"""


@pytest.mark.timeout(60)
def test_the_recruiter_dies_after_telling_the_newcomer(tmp_path):
    """Rank 0 dies between telling the newcomer the decision and broadcasting it: nobody hangs.
    The other member's grow() raises PeerError blaming rank 0 (its broadcast connection broke)
    and the newcomer's init() raises PeerError: the grown mesh did not form, rank 0 is gone."""
    procs = []
    try:
        envs, procs = shrunk_after_killing(2, tmp_path, grow_back(grow_timeout=10),
                                           {"FAULT_BEFORE_INIT": RECRUITER_DIES_AFTER_TELLING})
        procs += start("jaccl", 3, grow_back(), tmp_path, env={"JACKLRING_JOIN": "1"}, envs=envs, ranks=[2])
        died = float(procs[0].wait_line("DYING", 20)[1])
        member = procs[1].wait_line("GROWERR", 10)
        newcomer = procs[3].wait_line("INITERR", 10)
        culprit = procs[3].tagged("CULPRIT")
        finish_all(procs, 15)  # the lone member's next all_sum fails too: it has nobody left
    finally:
        stop_all(procs)
    assert member[2] == "PeerError" and float(member[1]) - died < 3.0, member
    assert "rank 0" in " ".join(member[3:]), member  # its broadcast from rank 0 broke
    text = " ".join(newcomer[2:])
    assert text.startswith("PeerError") and "did not form" in text and "this process was not taken in" in text, text
    assert "rank 0 (slot 0," in text and float(newcomer[1]) - died < 3.0, (died, newcomer)
    assert culprit and culprit[0][2] == "0", culprit
