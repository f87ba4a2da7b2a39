"""The blame matrix: {never started, kill -9, SIGSTOP} x {init, split, collective, p2p} x
{2, 3, 4, 6 ranks} x {shared memory, TCP ring, JACCL TCP mesh}. In every trial one rank (the
victim, mid-ring) fails and every other rank must raise a DistributedError whose `.culprit` is
the victim and whose message names it, in time: within JACKLRING_TIMEOUT (= the connect
deadline here) + 0.5 s of the fault for a silent victim, within KILL_LIMIT_S for a dead one.

The suite runs the slice in SLICE (every fault kind, phase, transport and size at least once);
BLAME_MATRIX_FULL=1 runs every cell, BLAME_MATRIX_REPEATS=N each N times, and
BLAME_MATRIX_TABLE=FILE appends one line per trial (for the table in docs/faults.md).

What each fault means in each phase:
- never: init: the victim is not started; later phases: it is alive but never calls the phase's
  operation (it sleeps), so the others see silence, not a closed connection.
- kill / stop: init: the victim SIGKILLs / SIGSTOPs itself right after its first connection of
  the formation is acknowledged; split: as it connects its sub-group (after the parent
  exchanged addresses; over shared memory, which connects nothing, as it enters split());
  collective / p2p: the harness signals it 0.3 s into a loop of all_sums (1 MB) / of sends to
  the right neighbour and receives from the left one.
"""
from __future__ import annotations

import itertools
import os
import re
import signal
import time

import pytest
from cluster import reports, start, stop_all

DEADLINE_S = 3.0
SLACK_S = 0.5        # the error comes within deadline + SLACK_S
KILL_LIMIT_S = 1.5   # a death is seen at once; 1 s target, the rest is slack for a loaded host
FAULTS = ("never", "kill", "stop")
PHASES = ("init", "split", "collective", "p2p")
SIZES = (2, 3, 4, 6)
TRANSPORTS = ("shm", "tcp", "jaccl")

# (fault, phase, size, transport): every fault kind, phase and transport, sizes 3, 4 and 6
# (8 trials of a few seconds each: start-up plus the 3 s deadline; BLAME_MATRIX_FULL=1 runs
# all 144 cells, twice each unless BLAME_MATRIX_REPEATS says otherwise).
SLICE = [
    ("never", "init", 3, "jaccl"), ("kill", "init", 4, "tcp"), ("stop", "split", 3, "shm"),
    ("stop", "collective", 4, "tcp"), ("kill", "collective", 6, "jaccl"), ("never", "p2p", 3, "shm"),
    ("kill", "p2p", 3, "tcp"), ("stop", "p2p", 4, "jaccl"),
]
FULL = os.environ.get("BLAME_MATRIX_FULL") == "1"
REPEATS = int(os.environ.get("BLAME_MATRIX_REPEATS", "2" if FULL else "1"))
CELLS = list(itertools.product(FAULTS, PHASES, SIZES, TRANSPORTS)) if FULL else SLICE

# The backends' modules are imported before init() is timed: the deadlines bound waiting, and
# importing costs up to half a second on a loaded machine.
PRELUDE = """
import signal
import adapter.backends.jaccl.backend, adapter.backends.local.use, adapter.backends.ring.backend
V, KIND, PHASE, TRANSPORT = VICTIM_, "KIND_", "PHASE_", "TRANSPORT_"

def fault(where):
    say("FAULT", where)
    if KIND == "never":
        time.sleep(120)
    os.kill(os.getpid(), signal.SIGKILL if KIND == "kill" else signal.SIGSTOP)
    time.sleep(120)  # SIGCONT comes only from the harness's cleanup

if r == V and PHASE == "init" and KIND != "never":
    from adapter.backends.transport import tcp
    real_connect = tcp.connect_with_hello  # tcp.connect goes through it too

    def connect_then_fail(*args, **kwargs):
        done = real_connect(*args, **kwargs)
        fault("init")
        return done
    tcp.connect_with_hello = connect_then_fail
"""

BODY = """
def report(exc):
    say("ERR", getattr(exc, "culprit", None), one_line(exc))
    sys.exit(3)

barrier()
try:
    if PHASE == "split":
        if r == V:
            alone = sum(q % 2 == V % 2 for q in range(n)) == 1  # a sub-group of one connects nothing,
            if KIND == "never" or TRANSPORT == "shm" or alone:  # nor does a split over shared memory
                fault("split")
            from adapter.backends.transport import tcp
            tcp.connect = tcp.connect_with_hello = lambda *a, **k: fault("split")
        say("PHASE")
        group.split(r % 2)
        say("NOERR")
    elif PHASE == "collective":
        x = np.ones(250_000, np.float32)
        say("READY")
        say("PHASE")
        if r == V and KIND == "never":
            fault("collective")
        until = time.monotonic() + 60
        while time.monotonic() < until:
            all_sum(x)
    elif PHASE == "p2p":
        x = np.ones(25_000, np.float32)
        say("READY")
        say("PHASE")
        if r == V and KIND == "never":
            fault("p2p")
        until = time.monotonic() + 60
        while time.monotonic() < until:
            send(x, (r + 1) % n)
            recv(x.shape, x.dtype, (r - 1) % n)
    else:
        say("NOERR")
except ERRORS as exc:
    report(exc)
"""


def transport_setup(transport: str) -> tuple[str, dict[str, str]]:
    if transport == "shm":
        return "ring", {}
    if transport == "tcp":
        return "ring", {"JACKLRING_LOCAL_TRANSPORT": "tcp"}
    return "jaccl", {}  # the harness puts JACCL on its TCP mesh


def names(text: str, rank: int) -> bool:
    """Whether the message names `rank` as the one at fault (`rank 2`, `ranks [2]`)."""
    return bool(re.search(rf"\brank {rank}\b|\branks \[[0-9, ]*\b{rank}\b", text))


def run_trial(tmp_path, fault: str, phase: str, n: int, transport: str, deadline: float = DEADLINE_S,
              prelude: str = "") -> dict:
    """One trial: {survivor: (seconds from the fault to its error, culprit, message)}, and
    problems (a list of strings; empty when every survivor blamed the victim in time).
    deadline: JACKLRING_TIMEOUT (the connect deadline stays DEADLINE_S); prelude: more code
    each rank runs before init()."""
    victim = n // 2
    backend, env = transport_setup(transport)
    env.update(JACKLRING_TIMEOUT=str(deadline), JACKLRING_CONNECT_TIMEOUT=str(DEADLINE_S),
               JACKLRING_STALL_REPORT="0",
               FAULT_BEFORE_INIT=PRELUDE.replace("VICTIM_", str(victim)).replace("KIND_", fault)
               .replace("PHASE_", phase).replace("TRANSPORT_", transport) + prelude)
    body = BODY  # it sees V, KIND, PHASE and fault() from the prelude (one namespace)
    ranks = [r for r in range(n) if not (phase == "init" and fault == "never" and r == victim)]
    procs = start(backend, n, body, tmp_path, env=env, ranks=ranks)
    by_rank = {p.rank: p for p in procs}
    survivors = [p for p in procs if p.rank != victim]
    results, problems = {}, []
    try:
        if phase == "init" and fault == "never":
            # From the last survivor's init(): a verdict on the missing rank comes from a peer's
            # deadline, which runs from that peer's start (up to a second apart on a loaded host).
            started = max(float(p.wait_line("INIT", 30)[1]) for p in survivors)
            starts = {p.rank: started for p in survivors}
        elif phase in ("collective", "p2p") and fault != "never":
            for p in procs:
                p.wait_line("READY", 30)
            time.sleep(0.3)
            sig = signal.SIGKILL if fault == "kill" else signal.SIGSTOP
            at = by_rank[victim].kill(sig)
            starts = {p.rank: at for p in survivors}
        else:
            at = float(by_rank[victim].wait_line("FAULT", 30)[1])
            if fault == "never":  # the silence starts when each survivor begins the phase
                starts = {p.rank: max(at, float(p.wait_line("PHASE", 30)[1])) for p in survivors}
            else:
                starts = {p.rank: at for p in survivors}
        limit = KILL_LIMIT_S if fault == "kill" else (DEADLINE_S if phase == "init" else deadline) + SLACK_S
        for p in survivors:
            try:
                tag = "INITERR" if phase == "init" else "ERR"
                fields = p.wait_line(tag, limit + 5)
            except AssertionError as exc:
                problems.append(f"rank {p.rank}: no error: {str(exc)[:300]}")
                continue
            if tag == "INITERR":  # INITERR <r> <t> <message>, after CULPRIT <r> <t> <culprit>
                when, text = float(fields[1]), " ".join(fields[2:])
                culprit = p.tagged("CULPRIT")[0][2] if p.tagged("CULPRIT") else None
            else:
                when, culprit, text = float(fields[1]), fields[2], " ".join(fields[3:])
            took = when - starts[p.rank]
            results[p.rank] = (took, culprit, text)
            if took > limit:
                problems.append(f"rank {p.rank}: raised {took:.2f} s after the fault (limit {limit} s)")
            if str(culprit) != str(victim):
                problems.append(f"rank {p.rank}: culprit {culprit}, not {victim}: {text[:400]}")
            if not names(text, victim):
                problems.append(f"rank {p.rank}: the message does not name rank {victim}: {text[:400]}")
    finally:
        if victim in by_rank:
            by_rank[victim].popen.send_signal(signal.SIGCONT)
        stop_all(procs)
    if problems:
        problems.append(reports(procs)[-6000:])
    return {"results": results, "problems": problems}


def record(fault, phase, n, transport, outcome) -> None:
    table = os.environ.get("BLAME_MATRIX_TABLE")
    if not table:
        return
    times = [t for t, _, _ in outcome["results"].values()]
    worst = f"{max(times):.2f}" if times else "-"
    verdict = "pass" if not outcome["problems"] else "FAIL: " + outcome["problems"][0][:160].replace("\n", " ")
    with open(table, "a") as f:
        f.write(f"{fault}\t{phase}\t{n}\t{transport}\t{worst}\t{verdict}\n")


@pytest.mark.timeout(60 * REPEATS)
@pytest.mark.parametrize("fault, phase, n, transport", CELLS)
def test_every_survivor_names_the_failed_rank_in_time(tmp_path, fault, phase, n, transport):
    problems = []
    for attempt in range(REPEATS):
        trial = tmp_path / str(attempt)
        trial.mkdir()
        outcome = run_trial(trial, fault, phase, n, transport)
        record(fault, phase, n, transport, outcome)
        print(f"{fault} {phase} n={n} {transport}: " + "; ".join(
            f"rank {r}: {t:.2f} s, culprit {c}: {m}" for r, (t, c, m) in sorted(outcome["results"].items())))
        problems += outcome["problems"]
    assert not problems, "\n".join(problems)


STOP_REPEATS = 3


@pytest.mark.timeout(90)
def test_a_stopped_rank_over_tcp_is_named_in_time_trial_after_trial(tmp_path):
    """The racy cell, stop / collective / 4 ranks / TCP, several times in a row with a 1.5 s
    deadline: all three survivors' deadlines fire within moments of each other, and each must
    name the stopped rank within the deadline + SLACK_S. Under load it used to miss often: the
    survivors held their errors 0.3 s for verdict notices to ranks that had already decided
    and were exiting (deadline + 0.46 s even unloaded), and a "stuck too" notice still in its
    handshake when the window closed got a live rank named."""
    problems = []
    for attempt in range(STOP_REPEATS):
        trial = tmp_path / str(attempt)
        trial.mkdir()
        outcome = run_trial(trial, "stop", "collective", 4, "tcp", deadline=1.5)
        print(f"trial {attempt}: " + "; ".join(f"rank {r}: {t:.2f} s, culprit {c}"
                                               for r, (t, c, _) in sorted(outcome["results"].items())))
        problems += outcome["problems"]
    assert not problems, "\n".join(problems)


# Every notice that needs a handshake at the deadline arrives a second late, as on a host so
# loaded that the connection's handshake misses the windows (0.15 s, 0.35 s) of the silence rule.
SLOW_NOTICES = """
from adapter.backends.ring import origin
real_send_notice = origin._send_notice

def late_notice(*args, **kwargs):
    time.sleep(1.0)
    return real_send_notice(*args, **kwargs)
origin._send_notice = late_notice
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("phase", ["collective", "p2p"])
def test_the_words_after_a_deadline_need_no_handshake(tmp_path, phase):
    """stop / collective and p2p / 4 ranks / TCP with every handshake notice a second late: the
    survivors still name the stopped rank within the deadline + SLACK_S, from the words written
    on the standby connections made long before (ring/standby.py). Without them a live rank
    waiting behind the stopped one is named."""
    outcome = run_trial(tmp_path, "stop", phase, 4, "tcp", prelude=SLOW_NOTICES)
    print("; ".join(f"rank {r}: {t:.2f} s, culprit {c}: {m[-160:]}"
                    for r, (t, c, m) in sorted(outcome["results"].items())))
    assert not outcome["problems"], "\n".join(outcome["problems"])



# Ordered so that rank 1 gives up (rank 2 died on its link) while its listener has acknowledged
# rank 0's ring connection but its acceptor has not queued it yet (0.6 s late here), so rank 1's
# formation never takes it: rank 2 dies only once rank 0 and rank 1 have connected to their right
# neighbours. Rank 0 hears of nothing else in time (it takes no arrival before its deadline and
# does not probe its left neighbour, nor tell it), so its right connection to rank 1 must carry
# the verdict.
LATE_TAKE = """
from adapter.backends.transport import acceptor, handshake, tcp as tcp_
from adapter.backends.ring import forming
from adapter.backends.ring.header import PURPOSE_RING
MARKS = "MARKS_"
connect_before_marks = tcp_.connect_with_hello

def connect_in_order(addr, hello, *args, **kwargs):
    if r == 2:
        until = time.monotonic() + 20
        while not all(os.path.exists(os.path.join(MARKS, f"r{q}")) for q in (0, 1)) and time.monotonic() < until:
            time.sleep(0.01)
    done = connect_before_marks(addr, hello, *args, **kwargs)
    if hello.purpose == PURPOSE_RING:
        open(os.path.join(MARKS, f"r{r}"), "w").close()
    return done
tcp_.connect_with_hello = connect_in_order

if r == 1:
    real_acceptor_send = acceptor.Acceptor._send

    def late_queue(item, frame):
        sent = real_acceptor_send(item, frame)
        if frame[:4] == handshake.ACK_MAGIC and item.hello is not None and item.hello.purpose == PURPOSE_RING:
            time.sleep(0.6)
        return sent
    acceptor.Acceptor._send = staticmethod(late_queue)
if r == 0:
    forming.LEFT_PROBE_S = 100.0
    forming.Forming._notify = lambda self, *args: None  # rank 3, never taken, has left: no 1 s of retries
    real_take = tcp_.Listener.take

    def take_at_the_deadline_only(self, match, deadline, who):
        return None if who is None else real_take(self, match, deadline, who)
    tcp_.Listener.take = take_at_the_deadline_only
"""


@pytest.mark.timeout(60)
def test_a_connection_acknowledged_but_not_yet_taken_hears_the_verdict(tmp_path):
    """kill / init / 4 ranks / TCP: rank 1 gives up while rank 0's ring connection is
    acknowledged but not yet taken by its formation. That connection must end with the abort
    naming rank 2 (the listener's farewell), not bare: rank 0 then named the live rank 1."""
    marks = tmp_path / "marks"
    marks.mkdir()
    outcome = run_trial(tmp_path, "kill", "init", 4, "tcp", prelude=LATE_TAKE.replace("MARKS_", str(marks)))
    print("; ".join(f"rank {r}: {t:.2f} s, culprit {c}: {m[-200:]}"
                    for r, (t, c, m) in sorted(outcome["results"].items())))
    assert not outcome["problems"], "\n".join(outcome["problems"])


# The split cells over shared memory, repeated: kill / split / 4 ranks / shm named a live rank in
# about 2% of trials (1 in 25 to 1 in 80 here; 4 in 41 in the review): a neighbour's abort notice
# was acknowledged before its listener queued it, the neighbour left, and the reader found no
# notice and nothing arriving (transport/handshake.py, Acceptor._acking). The default run repeats
# the kill cell 3 times; BLAME_MATRIX_SPLIT_REPEATS=N runs every split cell over
# shared memory N times (N=100 sees a 1-in-100 race with 63% odds per cell, N=300 with 95%).
SPLIT_REPEATS = int(os.environ.get("BLAME_MATRIX_SPLIT_REPEATS", "0"))
SPLIT_CELLS = ([(fault, "split", n, "shm") for fault in FAULTS for n in SIZES] if SPLIT_REPEATS
               else [("kill", "split", 4, "shm")])


@pytest.mark.timeout(60 + 15 * max(SPLIT_REPEATS, 5))
@pytest.mark.parametrize("fault, phase, n, transport", SPLIT_CELLS)
def test_the_split_cells_over_shared_memory_trial_after_trial(tmp_path, fault, phase, n, transport):
    problems = []
    for attempt in range(SPLIT_REPEATS or 3):
        trial = tmp_path / str(attempt)
        trial.mkdir()
        outcome = run_trial(trial, fault, phase, n, transport)
        record(fault, phase, n, transport, outcome)
        problems += [f"trial {attempt}: {p}" for p in outcome["problems"]]
    assert not problems, "\n".join(problems)
