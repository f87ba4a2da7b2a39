"""Adversarial review of the public API on the ring: edge-case inputs, dtype extremes, split,
threads. Every check runs (a failure does not stop the others); failures are printed and the
exit code is 1 when any failed."""
import threading
import traceback

import ml_dtypes
import numpy as np

import adapter as dist

world = dist.init()
r, n = world.rank(), world.size()
failures = []


def check(fn):
    try:
        fn()
    except Exception:
        failures.append(f"{fn.__name__}: {traceback.format_exc()}")
    return fn


@check
def spec_example():
    x = dist.all_sum(np.ones(10))
    assert x.shape == (10,) and np.all(x == n), x
    assert dist.init() is world and dist.init(backend="ring") is world


@check
def zero_d_inputs():
    x = np.array(r + 1.0, np.float32)
    s = dist.all_sum(x)
    assert s.shape == () and s == n * (n + 1) / 2, s
    assert dist.all_max(x) == n and dist.all_min(x) == 1
    g = dist.all_gather(np.float64(r))
    assert g.shape == (n,) and list(g) == list(range(n)), g
    b = dist.broadcast(np.array(r * 7), root=n - 1)
    assert b.shape == () and b == (n - 1) * 7, b
    try:
        dist.sum_scatter(np.array(1.0))
    except ValueError:
        pass
    else:
        raise AssertionError("sum_scatter of a 0-d array did not raise ValueError")


@check
def empty_arrays():
    for shape in [(0,), (0, 3), (3, 0)]:
        e = np.zeros(shape, np.float32)
        assert dist.all_sum(e).shape == shape
        assert dist.all_max(e).shape == shape
        gathered = dist.all_gather(e)
        assert gathered.shape == (n * shape[0],) + shape[1:], gathered.shape
        assert dist.broadcast(e).shape == shape
    z = dist.sum_scatter(np.zeros((0, 4)))
    assert z.shape == (0, 4), z.shape


@check
def layouts_and_input_untouched():
    base = np.arange(24, dtype=np.float64).reshape(4, 6) + r
    for x in (np.asfortranarray(base), base[::-1], base[:, ::-2], base.T):
        keep = x.copy()
        want = sum(np.asarray(x) - r + q for q in range(n))
        got = dist.all_sum(x)
        assert np.array_equal(got, want), (got, want)
        assert np.array_equal(x, keep), "input modified"
        got = dist.all_gather(x)
        assert np.array_equal(got, np.concatenate([x - r + q for q in range(n)])), got
        got = dist.broadcast(x, root=0)
        assert np.array_equal(got, x - r), got
        assert np.array_equal(x, keep), "input modified"


@check
def big_uneven_count():
    m = 1_000_003  # prime: not divisible by ranks x channels x segments
    x = np.arange(m, dtype=np.float32) % 97 + r
    got = dist.all_sum(x)
    want = (np.arange(m, dtype=np.float32) % 97) * n + n * (n - 1) / 2
    assert np.array_equal(got, want)
    got = dist.all_gather(x[: 300_001])
    assert got.shape == (n * 300_001,) and got[300_001 * (n - 1)] == n - 1
    blk = dist.sum_scatter(np.ones((n * 70_001,), np.int64) * (r + 1))
    assert blk.shape == (70_001,) and np.all(blk == n * (n + 1) // 2)


@check
def dtype_extremes():
    u = np.array([np.iinfo(np.uint64).max, 0, 2**63], np.uint64)
    assert np.array_equal(dist.all_max(u), u) and np.array_equal(dist.all_min(u), u)
    assert dist.all_sum(np.array([np.iinfo(np.uint64).max], np.uint64))[0] == np.uint64(2**64 - n)
    i = np.array([np.iinfo(np.int64).min, np.iinfo(np.int64).max], np.int64)
    assert np.array_equal(dist.all_max(i), i)
    for dt in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64):
        vals = np.array([np.nan if r == 0 else 1, np.inf, -np.inf, 0], dt)
        mx, mn = dist.all_max(vals), dist.all_min(vals)
        assert np.isnan(float(mx[0])) and np.isnan(float(mn[0])), (dt, mx, mn)
        assert float(mx[1]) == np.inf and float(mn[2]) == -np.inf
        s = dist.all_sum(np.array([float(ml_dtypes.finfo(dt).max)], dt))
        assert float(s[0]) == np.inf, (dt, s)
    b = dist.all_sum(np.array([r == 0, False, True]))
    assert b.dtype == np.bool_ and list(b) == [True, False, True]
    bmin = dist.all_min(np.array([r == 0, True]))
    assert list(bmin) == [n == 1, True]
    c = dist.all_sum(np.array([1 + 2j, r * 1j], np.complex64))
    assert c.dtype == np.complex64 and c[0] == n * (1 + 2j) and c[1] == 1j * n * (n - 1) / 2
    c2 = dist.all_gather(np.array([r + 1j], np.complex128))
    assert c2.dtype == np.complex128 and c2[-1] == n - 1 + 1j
    h = dist.all_sum(np.full(100_000, 0.1, np.float16))
    assert abs(float(h[0]) - 0.1 * n) < 0.01 and abs(float(h[-1]) - 0.1 * n) < 0.01, h[:3]
    bf = dist.all_sum(np.full(100_000, 1.0 + r, ml_dtypes.bfloat16))
    assert bf.dtype == ml_dtypes.bfloat16 and float(bf[-1]) == n * (n + 1) / 2


@check
def torch_inputs():
    import torch

    w = torch.ones(5, requires_grad=True)
    s = dist.all_sum(w)
    assert isinstance(s, torch.Tensor) and torch.all(s == n) and not s.requires_grad
    assert torch.all(w == 1)
    base = torch.arange(20, dtype=torch.float32).reshape(4, 5) + r
    view = base[:, 1::2]
    keep = base.clone()
    s = dist.all_sum(view)
    assert torch.equal(s, sum((torch.arange(20, dtype=torch.float32).reshape(4, 5) + q)[:, 1::2] for q in range(n)))
    b = dist.broadcast(view, root=0)
    assert torch.equal(b, (base - r)[:, 1::2])
    g = dist.all_gather(base.t())
    assert g.shape == (5 * n, 4)
    assert torch.equal(base, keep), "torch input modified"
    for dt in (torch.bfloat16, torch.float16, torch.uint64, torch.bool, torch.complex64, torch.int8):
        t = torch.ones(3, dtype=dt)
        out = dist.all_max(t) if dt not in (torch.complex64,) else dist.all_sum(t)
        assert out.dtype == dt, (dt, out.dtype)
    zero = dist.all_sum(torch.tensor(2.0))
    assert zero.shape == () and zero.item() == 2 * n
    rv = dist.recv((0, 3), torch.float32, (r - 1) % n) if False else None  # noqa: placeholder
    assert rv is None
    frozen = torch.ones(4)
    frozen_np = frozen.numpy()
    frozen_np.flags.writeable = False
    out = dist.all_sum(frozen)
    assert torch.all(frozen == 1) and torch.all(out == n)


@check
def readonly_numpy():
    x = np.ones(10_000, np.float32)
    x.flags.writeable = False
    assert np.all(dist.all_sum(x) == n)
    assert np.all(dist.all_gather(x)[:3] == 1)
    assert np.all(dist.broadcast(x) == 1)
    assert np.all(dist.sum_scatter(np.ones(4 * n)) == n)
    dst = (r + 1) % n
    src = (r - 1) % n
    dist.send(x[:5], dst)
    assert np.all(dist.recv((5,), np.float32, src) == 1)


@check
def point_to_point_edges():
    dst, src = (r + 1) % n, (r - 1) % n
    dist.send(np.zeros((0, 3), np.float32), dst)
    got = dist.recv((0, 3), np.float32, src)
    assert got.shape == (0, 3)
    dist.send(np.array(5, np.int16), dst)
    got = dist.recv((), np.int16, src)
    assert got.shape == () and got == 5
    dist.send(np.asfortranarray(np.arange(6).reshape(2, 3)), dst)
    assert np.array_equal(dist.recv((2, 3), np.int64, src), np.arange(6).reshape(2, 3))
    for bad in (r, n, -1):
        try:
            dist.send(np.ones(1), bad)
        except ValueError:
            pass
        else:
            raise AssertionError(f"send to {bad} did not raise")
    for bad_root in (n, -1):
        try:
            dist.broadcast(np.ones(1), root=bad_root)
        except ValueError:
            pass
        else:
            raise AssertionError(f"broadcast root {bad_root} did not raise")


@check
def sum_scatter_shapes():
    x = np.arange(n * 3, dtype=np.float32) + r
    got = dist.sum_scatter(x)
    want = sum(np.arange(n * 3, dtype=np.float32) + q for q in range(n))[r * 3:(r + 1) * 3]
    assert np.array_equal(got, want), (got, want)
    try:
        dist.sum_scatter(np.ones(n + 1))
    except ValueError:
        pass
    else:
        raise AssertionError("indivisible sum_scatter did not raise")


@check
def plain_python_and_foreign_layouts():
    import torch

    assert list(dist.sum_scatter([1.0] * n)) == [float(n)]
    dist.send(np.arange(4, dtype=np.int8), (r + 1) % n)
    got = dist.recv(4, np.int8, (r - 1) % n)
    assert got.shape == (4,) and list(got) == [0, 1, 2, 3]
    c = dist.all_sum(torch.tensor([1 + 1j], dtype=torch.complex64).conj())
    assert c.tolist() == [n * (1 - 1j)], c
    be = dist.all_sum(np.ones(3, ">f4"))
    assert be.tolist() == [n] * 3


@check
def split_variants():
    solo = world.split(r)  # every rank a different color
    assert solo.size() == 1 and solo.rank() == 0
    x = np.arange(3)
    assert np.array_equal(dist.all_sum(x, group=solo), x)
    rev = world.split(0, key=-5 - r)  # negative keys
    assert rev.size() == n
    total = dist.all_sum(np.array([r]), group=rev)
    assert total[0] == n * (n - 1) // 2
    half = world.split(r % 2, key=n - r)
    nested = half.split(0, key=0)
    assert nested.size() == half.size()
    assert dist.all_sum(np.array([1]), group=nested)[0] == half.size()
    # the split group and the parent at once, from two threads
    errors = []

    def on_sub():
        try:
            for i in range(30):
                got = dist.all_sum(np.full(50_000 if i % 3 == 0 else 7, 1.0), group=half)
                assert np.all(got == half.size())
        except Exception:
            errors.append(traceback.format_exc())

    t = threading.Thread(target=on_sub)
    t.start()
    for i in range(30):
        got = dist.all_sum(np.full(60_000 if i % 4 == 0 else 5, 2.0))
        assert np.all(got == 2 * n)
    t.join(60)
    assert not t.is_alive() and not errors, errors


@check
def p2p_while_collectives():
    dst, src = (r + 1) % n, (r - 1) % n
    errors = []

    def p2p():
        try:
            for i in range(20):
                dist.send(np.full(1000, i, np.int32), dst)
                got = dist.recv((1000,), np.int32, src)
                assert np.all(got == i)
        except Exception:
            errors.append(traceback.format_exc())

    t = threading.Thread(target=p2p)
    t.start()
    for _ in range(20):
        assert np.all(dist.all_sum(np.ones(3000)) == n)
        dist.barrier()
    t.join(60)
    assert not t.is_alive() and not errors, errors


@check
def two_threads_sending_to_one_peer():
    # Each message must arrive whole: two senders must not interleave bytes on one connection.
    dst, src = (r + 1) % n, (r - 1) % n
    errors = []

    def sender(value):
        try:
            for _ in range(10):
                dist.send(np.full(100_000, value, np.float64), dst)
        except Exception:
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=sender, args=(v,)) for v in (1.0, 2.0)]
    for t in threads:
        t.start()
    seen = []
    for _ in range(20):
        got = dist.recv((100_000,), np.float64, src)
        assert got[0] in (1.0, 2.0) and np.all(got == got[0]), "a message mixed two senders"
        seen.append(got[0])
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sorted(seen) == [1.0] * 10 + [2.0] * 10


@check
def close_then_use():
    sub = world.split(0)
    assert dist.all_sum(np.ones(2), group=sub)[0] == n
    sub.backend.close()
    sub.backend.close()
    for call in (lambda: dist.all_sum(np.ones(2), group=sub), lambda: dist.barrier(group=sub),
                 lambda: dist.send(np.ones(1), (r + 1) % n, group=sub)):
        try:
            call()
        except dist.DistributedError as exc:
            assert "closed" in str(exc), exc
        else:
            raise AssertionError("use after close did not raise")


dist.barrier()
for f in failures:
    print(f"rank {r} FAIL {f}")
print(f"rank {r}: {len(failures)} failure(s)")
raise SystemExit(1 if failures else 0)
