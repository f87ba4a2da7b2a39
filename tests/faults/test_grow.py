"""Group.grow() with real processes: a rank dies, the survivors shrink, a replacement started with
JACKLRING_JOIN=1 at the dead rank's hostfile slot is taken in, and the next collectives of the
grown group are right on every rank. An outsider without the job key cannot get in that way."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from cluster import ATTACK, ROOT, again_and_again, finish_all, rank_envs, reports, seats_close_with, start, stop_all
from cluster import grow_back as body


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "auto"], ids=["tcp", "shared-memory"])
def test_shrink_then_grow_back_to_the_full_size(tmp_path, transport):
    envs = rank_envs("ring", 4, tmp_path)
    env = {"JACKLRING_LOCAL_TRANSPORT": transport}
    procs = start("ring", 4, body(), tmp_path, env=env, envs=envs)
    newcomer = None
    try:
        for p in procs:
            p.wait_line("READY", 30)
        procs[2].kill(signal.SIGKILL)
        for p in (procs[0], procs[1], procs[3]):
            p.wait_line("SHRUNK", 15)
        started = time.monotonic()
        [newcomer] = start("ring", 4, body(), tmp_path, env={**env, "JACKLRING_JOIN": "1"}, envs=envs, ranks=[2])
        sums = {}
        for p in (procs[0], procs[1], procs[3], newcomer):
            fields = p.wait_line("SUM", 20)
            _, t, new_rank, size, slots, got, expected, ok = fields
            assert ok == "True" and got == expected == "10.0", fields
            assert slots == "0,1,3,2" and size == "4", fields
            sums[p.rank if p is not newcomer else "new"] = (int(new_rank), float(t))
            if p is not newcomer:
                old = " ".join(p.wait_line("OLD", 5))
                assert "this group was grown into a group of 4" in old and "use the Group grow() returned" in old, old
        codes = finish_all(procs + [newcomer], 15)
    finally:
        stop_all(procs + ([newcomer] if newcomer else []))
    assert [sums[q][0] for q in (0, 1, 3, "new")] == [0, 1, 2, 3], sums
    assert [codes[i] for i in (0, 1, 3, 4)] == [0, 0, 0, 0], reports(procs + [newcomer])
    print(f"{transport}: replacement start to its first correct all_sum: {sums['new'][1] - started:.2f} s")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("outsider", ["wrong-secret", "uid-65534"])
def test_an_outsider_cannot_join_through_grow(tmp_path, outsider):
    """The slot of a dead rank is taken by a process without the job key: the members' grow()
    raises CollectiveTimeout saying the slot's listener failed the handshake, nobody is taken in,
    and the shrunk group goes on."""
    envs = rank_envs("ring", 4, tmp_path)
    go = tmp_path / "go"
    env = {"JACKLRING_SECRET": "6a61636b6c72696e672d746573742d6b65792d61", "JACKLRING_LOCAL_TRANSPORT": "tcp"}
    procs = start("ring", 4, body(grow_timeout=2.0), tmp_path, env={**env, "FAULT_GO": str(go)}, envs=envs)
    intruder = None
    try:
        for p in procs:
            p.wait_line("READY", 30)
        procs[2].kill(signal.SIGKILL)
        procs[2].finish(5)
        if outsider == "wrong-secret":
            wrong = {**env, "JACKLRING_SECRET": "77726f6e672d7365637265742d6f662d6f7468",
                     "JACKLRING_JOIN": "1", "JACKLRING_CONNECT_TIMEOUT": "6"}
            [intruder] = start("ring", 4, body(), tmp_path, env=wrong, envs=envs, ranks=[2])
            intruder.wait_line("START", 10)
            _wait_listening(_slot_address(envs, 2)[1], 15)  # it binds its slot after the imports
        else:
            host, port = _slot_address(envs, 2)
            intruder = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                         "/usr/bin/python3", "-c", ATTACK, host, str(port), "12"],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
            assert intruder.stdout.readline().split() == ["LISTENING"], intruder.stderr.read()
        go.write_text("")  # the members grow only now: under load the intruder may take seconds to listen
        for p in (procs[0], procs[1], procs[3]):
            p.wait_line("SHRUNK", 15)
        for p in (procs[0], procs[1], procs[3]):
            fields = p.wait_line("GROWERR", 20)
            assert fields[2] == "CollectiveTimeout", fields
            text = " ".join(fields[3:])
            assert "only 0 of 1 newcomer(s) joined" in text and "slot 2" in text, text
            assert "it was refused" in text, text  # a handshake was tried there and failed
            after = p.wait_line("AFTER", 10)
            assert after[2:] == [str([0, 1, 3].index(p.rank)), "3", "7.0"], after  # slots 0, 1, 3: 1 + 2 + 4
        codes = finish_all(procs, 15)
    finally:
        stop_all(procs)
        if intruder is not None:
            if isinstance(intruder, subprocess.Popen):
                intruder.kill()
                intruder.wait()
            else:
                stop_all([intruder])
    assert [codes[i] for i in (0, 1, 3)] == [0, 0, 0], reports(procs)
    if not isinstance(intruder, subprocess.Popen):
        assert not intruder.tagged("GROWN") and not intruder.tagged("SUM"), intruder.report()


def newcomer_listens(envs, slot: int, go) -> None:
    """Until the newcomer at `slot` listens there; then tell the members to grow (they wait for
    the file `go`, FAULT_GO): under load a newcomer's start-up can outlast a short grow timeout."""
    _wait_listening(_slot_address(envs, slot)[1], 20)
    go.write_text("")


def _wait_listening(port: int, timeout: float) -> None:
    """Until a socket listens on 127.0.0.1:port (read from /proc/net/tcp: connecting would be a
    handshake attempt the listener logs)."""
    deadline = time.monotonic() + timeout
    wanted = f"0100007F:{port:04X}"
    while time.monotonic() < deadline:
        with open("/proc/net/tcp") as table:
            if any(f[1] == wanted and f[3] == "0A" for f in (line.split() for line in table) if len(f) > 3):
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def _slot_address(envs, slot: int) -> tuple[str, int]:
    import json
    hostfile = json.loads(open(envs[slot]["MLX_HOSTFILE"]).read())
    host, port = hostfile[slot][0].rsplit(":", 1)
    return host, int(port)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-x", "-q", "-s", f"--rootdir={ROOT}"]))


@pytest.mark.timeout(90)
def test_two_deaths_two_replacements_in_turn(tmp_path):
    """Slot 2 dies and is replaced, then slot 0 (the first group's rank 0, the recruiter) dies
    and is replaced: the lineage of slots carries through shrink and grow."""
    envs = rank_envs("ring", 4, tmp_path)
    text = again_and_again(tmp_path / "stop")
    env = {"JACKLRING_LOCAL_TRANSPORT": "tcp"}
    procs = start("ring", 4, text, tmp_path, env=env, envs=envs)
    try:
        for p in procs:
            p.wait_line("READY", 30)
        procs[2].kill(signal.SIGKILL)
        for q in (0, 1, 3):
            procs[q].wait_line("SHRUNK", 15)
        procs += start("ring", 4, text, tmp_path, env={**env, "JACKLRING_JOIN": "1"}, envs=envs, ranks=[2])
        firsts = {q: procs[i].wait_line("GROWN", 20)[2:] for i, q in ((0, 0), (1, 1), (3, 3), (4, "new2"))}
        procs[0].kill(signal.SIGKILL)
        for i in (1, 3, 4):
            procs[i].wait_line("SHRUNK", 15)
        procs += start("ring", 4, text, tmp_path, env={**env, "JACKLRING_JOIN": "1"}, envs=envs, ranks=[0])
        seconds = {q: procs[i].wait_line("GROWN", 20)[2:] for i, q in ((1, 1), (3, 3), (4, "new2"), (5, "new0"))}
        (tmp_path / "stop").write_text("")
        ends = {i: procs[i].wait_line("END", 20)[2:] for i in (1, 3, 4, 5)}
        codes = finish_all(procs, 15)
    finally:
        stop_all(procs)
    assert all(f[1:] == ["4", "0,1,3,2"] for f in firsts.values()), firsts
    assert [firsts[q][0] for q in (0, 1, 3, "new2")] == ["0", "1", "2", "3"], firsts
    # after slot 0's death: old slots 1, 3, 2 are ranks 0, 1, 2, and the newcomer in slot 0 is rank 3
    assert all(f[1:] == ["4", "1,3,2,0"] for f in seconds.values()), seconds
    assert [seconds[q][0] for q in (1, 3, "new2", "new0")] == ["0", "1", "2", "3"], seconds
    assert all(e[1:] == ["4", "1,3,2,0", "10.0"] for e in ends.values()), ends
    assert not any(p.tagged("BAD") for p in procs), reports(procs)
    assert [codes[i] for i in (1, 3, 4, 5)] == [0, 0, 0, 0], reports(procs)


DIE_BEFORE_FORMING = """
import adapter.backends.ring.backend as ring_backend
def die(self, *args, **kwargs):  # accepted the invitation, then gone before the ring forms
    say("DYING")
    os._exit(3)
ring_backend.RingBackend.__init__ = die
"""


@pytest.mark.timeout(60)
def test_a_newcomer_that_dies_after_accepting_leaves_the_members_group_usable(tmp_path):
    envs = rank_envs("ring", 4, tmp_path)
    go = tmp_path / "go"
    env = {"JACKLRING_LOCAL_TRANSPORT": "tcp", "FAULT_GO": str(go)}
    procs = start("ring", 4, body(grow_timeout=2.0), tmp_path, env=env, envs=envs)
    try:
        for p in procs:
            p.wait_line("READY", 30)
        procs[2].kill(signal.SIGKILL)
        for q in (0, 1, 3):
            procs[q].wait_line("SHRUNK", 15)
        procs += start("ring", 4, body(), tmp_path, env={**env, "JACKLRING_JOIN": "1",
                                                         "FAULT_BEFORE_INIT": DIE_BEFORE_FORMING},
                       envs=envs, ranks=[2])
        newcomer_listens(envs, 2, go)
        procs[4].wait_line("DYING", 20)
        for q in (0, 1, 3):
            fields = procs[q].wait_line("GROWERR", 20)
            assert fields[2] == "PeerError" and "did not form" in " ".join(fields), fields
            assert "this group stays as it was" in " ".join(fields), fields
            after = procs[q].wait_line("AFTER", 10)
            assert after[2:] == [str([0, 1, 3].index(q)), "3", "7.0"], after
        codes = finish_all(procs, 15)
    finally:
        stop_all(procs)
    assert [codes[i] for i in (0, 1, 3)] == [0, 0, 0], reports(procs)


@pytest.mark.timeout(60)
def test_a_group_of_one_keeps_itself_when_its_newcomer_dies_after_accepting(tmp_path):
    """The last survivor of two (min_size=1) grows, and the newcomer dies before the ring of two
    forms: the agreement after that failure finds that nobody formed it, so going back needs no
    quorum, and the survivor's group of one stays usable."""
    envs = rank_envs("ring", 2, tmp_path)
    go = tmp_path / "go"
    env = {"JACKLRING_LOCAL_TRANSPORT": "tcp", "FAULT_GO": str(go)}
    text = body(grow_timeout=2.0).replace("group.shrink(timeout=3)", "group.shrink(timeout=3, min_size=1)")
    procs = start("ring", 2, text, tmp_path, env=env, envs=envs)
    try:
        for p in procs:
            p.wait_line("READY", 30)
        procs[1].kill(signal.SIGKILL)
        procs[0].wait_line("SHRUNK", 15)
        procs += start("ring", 2, text, tmp_path, env={**env, "JACKLRING_JOIN": "1",
                                                       "FAULT_BEFORE_INIT": DIE_BEFORE_FORMING},
                       envs=envs, ranks=[1])
        newcomer_listens(envs, 1, go)
        procs[2].wait_line("DYING", 20)
        fields = procs[0].wait_line("GROWERR", 20)
        assert fields[2] == "PeerError" and "this group stays as it was" in " ".join(fields), fields
        assert procs[0].wait_line("AFTER", 10)[2:] == ["0", "1", "1.0"], reports(procs)
        codes = finish_all(procs, 15)
    finally:
        stop_all(procs)
    assert codes[0] == 0, reports(procs)


# A member runs all_sums until one fails (a rank was killed), shrinks, and waits for the
# harness's word that the process at the vacant slot listens; a newcomer skips all of it.
MEMBERS_SHRINK_AND_AWAIT_THE_NEWCOMER = """
import adapter
slot = int(os.environ["MLX_RANK"])
if os.environ.get("JACKLRING_JOIN") != "1":
    all_sum(np.ones(16, np.float32))
    say("READY")
    try:
        while True:
            all_sum(np.ones(16, np.float32))
    except ERRORS as e:
        pass
    group = group.shrink(timeout=3)
    say("SHRUNK", group.rank(), group.size())
    while os.environ.get("FAULT_GO") and not os.path.exists(os.environ["FAULT_GO"]):
        time.sleep(0.02)  # until the harness says the process at the vacant slot listens
"""


# After grow (or, on a newcomer, init), every rank checks an all_gather of the slots and an
# all_sum; when that fails (a rank died as the grown group formed) it shrinks and tries again.
# A member whose grow() raised carries on with the group it still has, as a program would.
GROW_THEN_CHECK = MEMBERS_SHRINK_AND_AWAIT_THE_NEWCOMER + """    try:
        group = group.grow(timeout=3)
    except ERRORS as e:
        say("GROWERR", type(e).__name__, str(e).replace("\\n", " "))
say("GROWN", group.rank(), group.size())
for attempt in range(3):
    try:
        slots = [int(s) for s in all_gather(np.array([slot], np.int64))]
        y = all_sum(np.full(64, float(slot + 1), np.float32))
        break
    except ERRORS as e:
        say("AGAIN", type(e).__name__, str(e).replace("\\n", " ")[:300])
        try:
            group = group.shrink(timeout=3)
        except ERRORS as e:
            say("SHRINKERR", type(e).__name__, str(e).replace("\\n", " "))
            sys.exit(5)
expected = float(sum(q + 1 for q in slots))
say("SUM", group.rank(), group.size(), ",".join(map(str, slots)), float(y[0]), expected, bool(np.all(y == expected)))
""" + seats_close_with("group")

# The member at slot VICTIM dies inside the last step of forming the grown ring (its all-gather
# of shared-memory placements, after the closing barrier; shared memory is "not wanted" over
# TCP): it sends its own part on, drops the relay of its left neighbour's part and is killed
# 0.3 s later. The ranks after it in the ring miss a part and fail; the last one has them all
# and finishes forming (the same hooks as test_shrink.py's closing-barrier test).
DIE_IN_THE_GROWN_RINGS_CLOSING_BARRIER = """
if r == VICTIM:
    import signal
    import threading
    from adapter.backends.ring import shared
    from adapter.backends.elastic import enrolment
    from adapter.backends.transport import stream_engine
    decided, armed, dying = [], [], []
    if os.environ.get("JACKLRING_JOIN") == "1":
        decided.append([0, 1, 3, 2])  # a newcomer forms one ring: the grown one
    real_broadcast = enrolment.broadcast_decision
    def broadcast(old, decision):
        decision = real_broadcast(old, decision)
        if decision.get("ok"):
            decided.append(decision["slots"])
        return decision
    enrolment.broadcast_decision = broadcast
    real_attach = shared.attach
    def attach(state, gather):
        def last_gather(record):
            armed.extend(decided)
            return gather(record)
        return real_attach(state, last_gather)
    shared.attach = attach
    real_forward, real_post = stream_engine.Stream.post_forward, stream_engine.Stream.post_send
    def post_forward(self, view, source):
        if armed:
            if not dying:
                dying.append(True)
                say("DYING", decided[-1])
                threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
            return
        real_forward(self, view, source)
    def post_send(self, view):
        if dying:
            os.kill(os.getpid(), signal.SIGKILL)
        real_post(self, view)
    stream_engine.Stream.post_forward, stream_engine.Stream.post_send = post_forward, post_send
"""


SLOT_OF = {0: 0, 1: 1, 4: 2}  # the slot of each process the test may kill (process 4: the newcomer)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("victim", [0, 1, 4], ids=["the-newcomer-forms", "a-member-forms", "the-newcomer-dies"])
def test_a_death_inside_the_grown_rings_closing_barrier(tmp_path, victim):
    """Slot 2 dies, the others shrink and grow back (slots 0, 1, 3 and a newcomer at slot 2 as
    ranks 0-3); the rank at slot 0, slot 1 or the newcomer (process `victim`) dies inside the
    grown ring's last formation step, so the grown group forms on some ranks and not on others
    (slot 0 dies: it forms on the newcomer alone; slot 1: on slot 0 alone; the newcomer: on slot
    3 alone). Every survivor must end in the same group of the three that are left, with the
    right sums, and none may keep the group it grew from."""
    envs = rank_envs("ring", 4, tmp_path)
    go = tmp_path / "go"
    env = {"JACKLRING_LOCAL_TRANSPORT": "tcp", "MLX_RING_VERBOSE": "1", "FAULT_GO": str(go),
           "FAULT_BEFORE_INIT": DIE_IN_THE_GROWN_RINGS_CLOSING_BARRIER.replace("VICTIM", str(SLOT_OF[victim]))}
    procs = start("ring", 4, GROW_THEN_CHECK, tmp_path, env=env, envs=envs)
    try:
        for p in procs:
            p.wait_line("READY", 30)
        procs[2].kill(signal.SIGKILL)
        for q in (0, 1, 3):
            procs[q].wait_line("SHRUNK", 15)
        procs += start("ring", 4, GROW_THEN_CHECK, tmp_path, env={**env, "JACKLRING_JOIN": "1"}, envs=envs,
                       ranks=[2])
        newcomer_listens(envs, 2, go)
        dying = procs[victim].wait_line("DYING", 20)
        assert " ".join(dying[2:]) == "[0, 1, 3, 2]", dying
        survivors = [i for i in (0, 1, 3, 4) if i != victim]
        outcomes = {}
        for i in survivors:
            p = procs[i]
            deadline = time.monotonic() + 40
            while i not in outcomes and time.monotonic() < deadline:
                for tag in ("SUM", "SHRINKERR"):
                    if p.tagged(tag):
                        outcomes[i] = [tag] + p.tagged(tag)[0]
                        break
                else:
                    if p.popen.poll() is not None and p.readers_done.is_set():
                        outcomes[i] = ["EXITED", str(p.popen.returncode)]
                    time.sleep(0.05)
        finish_all(procs, 15)
    finally:
        stop_all(procs)
    left = [q for q in (0, 1, 3, 2) if q != SLOT_OF[victim]]  # slots, in the grown group's order
    expected = float(sum(q + 1 for q in left))
    ok = all(o[:1] == ["SUM"] and o[4:] == ["3", ",".join(map(str, left)), str(expected), str(expected), "True"]
             for o in outcomes.values())
    assert sorted(outcomes) == survivors and ok, f"{outcomes}\n\nevery rank's report:\n{reports(procs)}"
    assert not any(p.tagged("GROWERR") for p in procs), reports(procs)
    # The ranks on which the grown group did not form kept a seat in it, closed with their group.
    seats = {i: procs[i].tagged("SEATS")[0][2:] for i in survivors}
    assert all(f[1] == "-" for f in seats.values()) and sum(int(f[0]) for f in seats.values()) == 2, seats


# The members lose slot 2, shrink to slots 0, 1, 3 and grow; the recruiter (slot 0, rank 0) dies
# in the middle of it (RECRUITER_DIES says where). The two members left report grow()'s error,
# shrink to slots 1, 3 and grow again by one: the newcomer at slot 2 (the first one if it still
# waits, else a second one the harness starts) joins that group, and every rank checks an
# all_gather of the slots and an all_sum.
RECRUITER_DIES_BODY = MEMBERS_SHRINK_AND_AWAIT_THE_NEWCOMER + """    try:
        group = group.grow(timeout={grow_timeout})
        say("GROWN?", group.rank(), group.size())
    except ERRORS as e:
        say("GROWERR", type(e).__name__, getattr(e, "culprit", None), str(e).replace("\\n", " "))
    group = group.shrink(timeout=3)
    say("SHRUNK2", group.rank(), group.size())
    group = group.grow(count=1, timeout=20)
say("GROWN", group.rank(), group.size())
slots = [int(s) for s in all_gather(np.array([slot], np.int64))]
y = all_sum(np.full(64, float(slot + 1), np.float32))
expected = float(sum(q + 1 for q in slots))
say("SUM", group.rank(), group.size(), ",".join(map(str, slots)), float(y[0]), expected, bool(np.all(y == expected)))
"""

# Test hook (in the recruiter's process only, slot 0): SIGKILL at one point of grow's recruiting.
#   recruited: the newcomer has accepted the invitation and was told nothing;
#   told:      the newcomer was told the decision, no member was (before the broadcast);
#   broadcast: the members got the decision's length, not the decision.
RECRUITER_DIES = """
if r == 0 and os.environ.get("JACKLRING_JOIN") != "1":
    import json, signal
    from adapter.backends.elastic import enrolment
    WHERE = "POINT"
    def die(where):
        say("DYING", where)
        os.kill(os.getpid(), signal.SIGKILL)
    real_recruit, real_tell = enrolment.recruit, enrolment.tell
    def recruit(*args, **kwargs):
        got = real_recruit(*args, **kwargs)
        if WHERE == "recruited" and not isinstance(got, str):
            die(WHERE)
        return got
    def tell(channel, message, deadline):
        failed = real_tell(channel, message, deadline)
        if WHERE == "told" and message.get("kind") == "decision":
            die(WHERE)
        return failed
    def broadcast(old, decision):
        if WHERE == "broadcast" and decision.get("ok"):
            old.broadcast(np.array([len(json.dumps(decision).encode())], np.int64), 0)
            die(WHERE)
        return real_broadcast(old, decision)
    real_broadcast = enrolment.broadcast_decision
    enrolment.recruit, enrolment.tell, enrolment.broadcast_decision = recruit, tell, broadcast
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", ["recruited", "told", "broadcast"])
def test_the_recruiter_dies_in_the_middle_of_grow(tmp_path, point):
    """Rank 0 (slot 0) dies while it recruits the newcomer at slot 2 (`point`: see RECRUITER_DIES).
    The members left and the newcomer never hang: each member's grow() raises PeerError or
    CollectiveTimeout blaming rank 0 within the grow timeout and a margin; the newcomer either
    still waits (and is taken in by the next grow) or its init() raises, blaming rank 0, and a
    new one is started. The members shrink and grow again by one, and all three end in the same
    group of slots 1, 3, 2 with the right sums."""
    grow_timeout = 4.0
    envs = rank_envs("ring", 4, tmp_path)
    text = RECRUITER_DIES_BODY.replace("{grow_timeout}", str(grow_timeout))
    go = tmp_path / "go"
    env = {"JACKLRING_LOCAL_TRANSPORT": "tcp", "MLX_RING_VERBOSE": "1", "FAULT_GO": str(go),
           "FAULT_BEFORE_INIT": RECRUITER_DIES.replace("POINT", point)}
    procs = start("ring", 4, text, tmp_path, env=env, envs=envs)
    try:
        for p in procs:
            p.wait_line("READY", 30)
        procs[2].kill(signal.SIGKILL)
        for q in (0, 1, 3):
            procs[q].wait_line("SHRUNK", 15)
        procs += start("ring", 4, text, tmp_path, env={**env, "JACKLRING_JOIN": "1"}, envs=envs, ranks=[2])
        newcomer_listens(envs, 2, go)
        died = float(procs[0].wait_line("DYING", 20)[1])
        errors = {q: procs[q].wait_line("GROWERR", grow_timeout + 15) for q in (1, 3)}
        for q in (1, 3):
            procs[q].wait_line("SHRUNK2", 15)
        newcomer = procs[4]
        deadline = time.monotonic() + grow_timeout + 15
        while not newcomer.tagged("GROWN") and not newcomer.tagged("INITERR") and time.monotonic() < deadline:
            time.sleep(0.05)
        initerr = newcomer.tagged("INITERR")
        if initerr:  # not taken in: it tries again, as a new process
            procs += start("ring", 4, text, tmp_path, env={**env, "JACKLRING_JOIN": "1"}, envs=envs, ranks=[2])
        sums = {q: procs[q].wait_line("SUM", 30)[2:] for q in (1, 3, len(procs) - 1)}
        codes = finish_all(procs, 15)
    finally:
        stop_all(procs)
    everything = reports(procs)
    tooks = {}
    for q, fields in errors.items():
        took = tooks[q] = float(fields[1]) - died
        assert fields[2] in ("PeerError", "CollectiveTimeout") and fields[3] == "0", (q, fields, everything)
        assert took < grow_timeout + 3.0, (q, took, fields, everything)
    if initerr:
        culprit = newcomer.tagged("CULPRIT")[0]
        took = float(initerr[0][1]) - died
        assert culprit[2] == "0", (initerr, culprit, everything)
        assert took < grow_timeout + 3.0, (took, initerr, everything)
    assert not any(p.tagged("GROWN?") for p in procs), everything
    assert all(f[1:] == ["3", "1,3,2", "9.0", "9.0", "True"] for f in sums.values()), (sums, everything)
    assert [codes[q] for q in (1, 3, len(procs) - 1)] == [0, 0, 0], everything
    newcomer_took = f"raised {float(initerr[0][1]) - died:.2f} s after it" if initerr else "was taken in next"
    print(f"{point}: members raised {min(tooks.values()):.3f}-{max(tooks.values()):.3f} s after the death; "
          f"the newcomer {newcomer_took}")
