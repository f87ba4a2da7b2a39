"""dist.shrink_group on the jacklring process group: kill -9 of a rank, the survivors shrink the
default group and the next all_reduce on it is right. The group runs on a store ring, and in
two tests also on JACCL's TCP mesh (JACKLRING_TORCH_BACKEND=jaccl)."""
from __future__ import annotations

import signal
import time

import pytest
from cluster import finish_all, rank_envs, reports, start, stop_all


def envs(under: str, n: int, tmp_path) -> list[dict[str, str]] | None:
    """The ranks' variables: torch's alone (a store ring), or with JACCL's for the default group."""
    if under == "store-ring":
        return None
    return [{**t, **j, "JACKLRING_TORCH_BACKEND": "jaccl"}
            for t, j in zip(rank_envs("torch", n, tmp_path), rank_envs("jaccl", n, tmp_path))]

BODY = """
x = np.full(4096, float(r + 1), np.float32)
all_sum(x)
say("READY")
try:
    while True:
        all_sum(x)
except ERRORS as e:
    say("ERR", type(e).__name__)
pg = dist.shrink_group([2])
assert pg is dist.group.WORLD or dist.get_world_size() == 2
y = all_sum(np.full(4096, float(r + 1), np.float32))
say("SUM", dist.get_rank(), dist.get_world_size(), float(y[0]), pg.supports_shrinking)
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("under", ["store-ring", "jaccl"])
def test_shrink_group_after_kill9_and_the_next_all_reduce_is_right(tmp_path, under):
    pytest.importorskip("torch")
    procs = start("torch", 3, BODY, tmp_path, envs=envs(under, 3, tmp_path))
    try:
        for p in procs:
            p.wait_line("READY", 80)
        time.sleep(0.3)
        procs[2].kill(signal.SIGKILL)
        sums = [procs[q].wait_line("SUM", 40) for q in (0, 1)]
        codes = finish_all(procs, 20)
    finally:
        stop_all(procs)
    assert [s[2:] for s in sums] == [["0", "2", "3.0", "True"], ["1", "2", "3.0", "True"]], reports(procs)
    assert codes[:2] == [0, 0], reports(procs)


# DDP over 3 ranks, each on its shard (data[rank::world]); rank 2 SIGKILLs itself at step 4. The
# survivors' backward fails, they shrink the default group, rebuild DDP on it (its constructor
# broadcasts rank 0's parameters) and re-shard. Rank 0 then replays the same training without
# DDP (3 shards for steps 0-3, 2 from step 4) and compares the parameters.

# What every rebuilt model is compared with: one process replaying the 12 steps on all the
# data, split over 3 ranks for the first 4 steps and over the 2 survivors after.
REPLAY = """
for s in range(STEPS):
    world = 3 if s < 4 else 2
    ref_opt.zero_grad()
    grads = []
    for q in range(world):
        replay.zero_grad()
        ((replay(data[q::world]) - target[q::world]) ** 2).mean().backward()
        grads.append([p.grad.clone() for p in replay.parameters()])
    for i, p in enumerate(replay.parameters()):
        p.grad = sum(g[i] for g in grads) / world
    ref_opt.step()
"""


def survivors_train_on_like_a_replay(body: str, tmp_path, first_error_s: float) -> None:
    """Rank 2 of 3 is killed at step 4: ranks 0 and 1 name it, shrink, rebuild and finish the
    12 steps on 2 ranks with parameters equal on both and close to REPLAY's."""
    procs = start("torch", 3, body, tmp_path)
    try:
        errs = [procs[q].wait_line("ERR", first_error_s) for q in (0, 1)]
        done = [procs[q].wait_line("DONE", 40) for q in (0, 1)]
        codes = finish_all(procs, 20)
    finally:
        stop_all(procs)
    assert [e[2:4] for e in errs] == [["4", "2"], ["4", "2"]], reports(procs)  # step 4, culprit rank 2
    assert [d[2:7] for d in done] == [["0", "2", "12", "True", "True"], ["1", "2", "12", "True", "True"]], \
        (done, reports(procs))
    assert codes[:2] == [0, 0], reports(procs)


DDP_BODY = """
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
import adapter

def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

data = torch.randn(96, 8, generator=torch.Generator().manual_seed(1))
target = data.sum(1, keepdim=True)
model = make()
ddp = DDP(model)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
say("READY")
step, STEPS = 0, 12
while step < STEPS:
    if r == 2 and step == 4:
        os.kill(os.getpid(), 9)
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = data[rank::world], target[rank::world]
    opt.zero_grad()
    try:
        loss = ((ddp(x) - y) ** 2).mean()
        loss.backward()
    except Exception as e:
        dead = adapter.culprit_of(e)
        say("ERR", step, dead, type(e).__name__)
        dist.shrink_group([dead])
        ddp = DDP(model)
        say("REBUILT", dist.get_rank(), dist.get_world_size())
        continue
    opt.step()
    step += 1
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, flat)
same = all(torch.equal(g, flat) for g in gathered)
replay = make()
ref_opt = torch.optim.SGD(replay.parameters(), lr=0.05)
""" + REPLAY + """ref = torch.cat([p.detach().flatten() for p in replay.parameters()])
say("DONE", dist.get_rank(), dist.get_world_size(), step, same, torch.allclose(flat, ref, atol=1e-5),
    float((flat - ref).abs().max()))
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_ddp_rebuilt_on_the_shrunk_group_trains_on_with_resharded_data(tmp_path):
    pytest.importorskip("torch")
    survivors_train_on_like_a_replay(DDP_BODY, tmp_path, 80)


# Rank 0 starts an all_reduce that rank 1 never joins (rank 1 calls shrink_group 1.5 s later,
# rank 2 is excluded and stays out), then shrinks: its Work must complete with an error, not hang.
ABORT_BODY = """
FLAGS = {flags}
x = torch.ones(1024)
dist.all_reduce(x)
say("READY")
if r == 2:
    time.sleep(8)  # excluded: alive, but outside the shrink (torch's rule: it must not call it)
    sys.exit(0)
if r == 0:
    import threading
    work = dist.all_reduce(torch.ones(1 << 16), async_op=True)
    ended = []
    def waiter():  # when the Work completes, however far shrink_group is
        try:
            work.wait()
            ended.append(("ok", time.monotonic(), ""))
        except Exception as e:
            ended.append(("error", time.monotonic(), str(e).replace("\\n", " ")[:400]))
    time.sleep(0.3)
    say("INFLIGHT", work.is_completed())
    watcher = threading.Thread(target=waiter, daemon=True)
    watcher.start()
if r == 1:
    time.sleep(1.5)  # rank 0 shrinks first: with SHRINK_ABORT its own abort must fail the Work
t0 = time.monotonic()
pg = dist.shrink_group([2], shrink_flags=FLAGS)
shrunk_after = time.monotonic() - t0
if r == 0:
    watcher.join(30)
    how, at, text = ended[0] if ended else ("hung", time.monotonic(), "")
    say("WORK", how, f"{{at - t0:.2f}}", text)
y = torch.full((16,), float(r + 1))
dist.all_reduce(y)
say("SUM", dist.get_rank(), dist.get_world_size(), float(y[0]), f"{{shrunk_after:.2f}}")
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags, under", [(0, "store-ring"), (1, "store-ring"), (1, "jaccl")],
                         ids=["SHRINK_DEFAULT", "SHRINK_ABORT", "SHRINK_ABORT-jaccl"])
def test_a_work_in_flight_completes_with_an_error_and_never_hangs(tmp_path, flags, under):
    pytest.importorskip("torch")
    procs = start("torch", 3, ABORT_BODY.format(flags=flags), tmp_path, envs=envs(under, 3, tmp_path))
    try:
        assert procs[0].wait_line("INFLIGHT", 80)[2] == "False", reports(procs)
        work = procs[0].wait_line("WORK", 30)
        sums = [procs[q].wait_line("SUM", 30) for q in (0, 1)]
        codes = finish_all(procs, 20)
    finally:
        stop_all(procs)
    assert work[2] == "error", (work, reports(procs))
    assert float(work[3]) < 5.0, work  # the shrink's own time, not an operation deadline (30 s)
    text = " ".join(work[4:])
    if flags:  # aborted by this rank before the agreement, while rank 1 still sleeps
        assert "SHRINK_ABORT" in text and float(work[3]) < 1.0, work
    else:  # failed when a decision broke the old group (this rank's, or first the peer's: then it names that peer)
        said = ("being shrunk", "closed its connection", "left the group", "gave the group up")
        assert any(s in text for s in said), text
    assert [s[2:5] for s in sums] == [["0", "2", "3.0"], ["1", "2", "3.0"]], reports(procs)
    assert codes == [0, 0, 0], reports(procs)
    print(f"flags {flags}: the Work in flight failed {work[3]} s after shrink_group began: {text[:200]}")


# FSDP2 (fully_shard) over 3 ranks, rank 2 SIGKILLs itself at step 4. A dead rank takes its
# shard of every parameter with it, so the recipe keeps a full copy: after each good step every
# rank gathers the full state (DTensor.full_tensor). On a failure the survivors shrink the default
# group, build the model again from that copy, fully_shard it on a mesh of the new group, make a
# new optimizer and redo the step on re-cut shards. Rank 0 then replays the training without FSDP
# (3 shards for steps 0-3, 2 from step 4) and compares the parameters.
FSDP2_BODY = """
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
import adapter

def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

def sharded(state):
    model = make()
    model.load_state_dict(state)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.SGD(model.parameters(), lr=0.05)

data = torch.randn(96, 8, generator=torch.Generator().manual_seed(1))
target = data.sum(1, keepdim=True)
saved = make().state_dict()
model, opt = sharded(saved)
say("READY")
step, STEPS = 0, 12
while step < STEPS:
    if r == 2 and step == 4:
        os.kill(os.getpid(), 9)
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = data[rank::world], target[rank::world]
    try:
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        saved = {k: v.full_tensor() for k, v in model.state_dict().items()}  # the copy to rebuild from
    except Exception as e:
        dead = adapter.culprit_of(e)
        say("ERR", step, dead, type(e).__name__)
        dist.shrink_group([dead])
        model, opt = sharded(saved)  # the last good step's parameters, sharded over the survivors
        say("REBUILT", dist.get_rank(), dist.get_world_size())
        continue
    step += 1
flat = torch.cat([saved[k].flatten() for k in sorted(saved)])
gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, flat)
same = all(torch.equal(g, flat) for g in gathered)
replay = make()
ref_opt = torch.optim.SGD(replay.parameters(), lr=0.05)
""" + REPLAY + """ref_state = replay.state_dict()
ref = torch.cat([ref_state[k].flatten() for k in sorted(ref_state)])
say("DONE", dist.get_rank(), dist.get_world_size(), step, same, torch.allclose(flat, ref, atol=1e-5),
    float((flat - ref).abs().max()))
dist.destroy_process_group()
"""


@pytest.mark.timeout(150)
def test_fsdp2_rebuilt_from_a_full_copy_on_the_shrunk_group_trains_on(tmp_path):
    pytest.importorskip("torch")
    survivors_train_on_like_a_replay(FSDP2_BODY, tmp_path, 100)
