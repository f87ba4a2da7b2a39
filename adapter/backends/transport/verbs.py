"""JACCL's RDMA transport over pyverbs (imported lazily: only this module needs it).

One reliable-connected queue pair per peer and device (several devices in a cell = several
cables = several queue pairs, slot s travels on device s mod n), each with its own protection
domain and completion queue; frame buffers are registered once per (peer, direction, slot) and
reused. Every completion's status is checked: a failed one raises PeerError naming the peer
and the verbs status string, never a silently corrupted buffer. Every poll loop has a deadline.

Split in two layers:
  - bookkeeping that runs anywhere and is unit-tested: work-request ids, the table of posted
    work, completion-status checks, GID choice, device probing;
  - the hardware layer (`_QueuePair`, `_register`, `VerbsTransport.poll`'s CQ reads, `connect`),
    kept as thin as possible because only a machine with an RDMA device exercises it.
"""
from __future__ import annotations

import ctypes
import json
import os
import time
from typing import Callable

from ... import config
from ...errors import BackendUnavailable, CollectiveTimeout, ConfigError, PeerError
from .slots import KIND_NAMES, RECV, SEND, BufferPool, Completion, Transport

FRAME_BYTES = 1 << 20
SLOTS = 2
PORT = 1
PSN_MASK = 0xFFFFFF
_POLL_BATCH = 16

Exchange = Callable[[bytes], list[bytes]]


# ---------------------------------------------------------------- bookkeeping (tested anywhere)

def encode_wr_id(kind: int, peer: int, slot: int) -> int:
    """A work-request id carrying (kind, peer, slot), so a completion names its buffer."""
    if kind not in KIND_NAMES or not 0 <= peer < 1 << 16 or not 0 <= slot < 1 << 8:
        raise ValueError(f"cannot encode work request kind={kind} peer={peer} slot={slot}")
    return (kind << 24) | (peer << 8) | slot


def decode_wr_id(wr_id: int) -> tuple[int, int, int]:
    return (wr_id >> 24) & 0xFF, (wr_id >> 8) & 0xFFFF, wr_id & 0xFF


class PendingWork:
    """Which (kind, peer, slot) buffers are posted and not yet completed.

    Posting a busy slot (the algorithm would overwrite a buffer the device still reads) and a
    completion nobody posted (a stale or foreign work request) are both errors.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._posted: set[int] = set()

    def post(self, kind: int, peer: int, slot: int) -> int:
        wr_id = encode_wr_id(kind, peer, slot)
        if wr_id in self._posted:
            raise RuntimeError(f"rank {self.rank}: {KIND_NAMES[kind]} slot {slot} to rank {peer} "
                               "is already posted (its buffer is still in use)")
        self._posted.add(wr_id)
        return wr_id

    def complete(self, wr_id: int) -> tuple[int, int, int]:
        if wr_id not in self._posted:
            raise PeerError(f"rank {self.rank}: completion for work request {wr_id:#x} that was never "
                            f"posted (kind/peer/slot {decode_wr_id(wr_id)})")
        self._posted.remove(wr_id)
        return decode_wr_id(wr_id)

    def __len__(self) -> int:
        return len(self._posted)

    def describe(self) -> str:
        parts = [f"{KIND_NAMES.get(k, k)} slot {s} with rank {p}" for k, p, s in map(decode_wr_id, sorted(self._posted))]
        return ", ".join(parts) or "nothing"


def status_text(status: int) -> str:
    """The ibv_wc_status string (pyverbs' own table when importable)."""
    try:
        from pyverbs.cq import cqe_status_to_str
        return cqe_status_to_str(status)
    except Exception:  # pyverbs missing or an unknown code
        return f"status {status}"


def check_completion(wc, pending: PendingWork, rank: int) -> Completion:
    """Turn a work completion into a Completion, or raise PeerError naming peer and status."""
    kind, peer, slot = pending.complete(wc.wr_id)
    if wc.status != 0:  # IBV_WC_SUCCESS
        raise PeerError(
            f"rank {rank}: RDMA {KIND_NAMES.get(kind, kind)} with rank {peer} (slot {slot}) failed: "
            f"{status_text(wc.status)} (ibv status {wc.status}, vendor error {wc.vendor_err:#x}); "
            "the peer may have died or the link is down")
    return Completion(kind, peer, slot, wc.byte_len)


def choose_gid_index(gids: list[str | None]) -> int:
    """Index of the first IPv4-mapped GID (RoCE v2 over an IPv4 link), as MLX picks it;
    JACKLRING_IBV_GID_INDEX overrides."""
    override = config.get("JACKLRING_IBV_GID_INDEX")
    if override is not None:
        return override
    for index, gid in enumerate(gids):
        digits = (gid or "").replace(":", "").lower()
        # IPv4-mapped: 80 zero bits, 16 one bits, then a non-zero IPv4 address
        if len(digits) == 32 and digits[:24] == "0" * 20 + "ffff" and digits[24:] != "0" * 8:
            return index
    raise BackendUnavailable("no IPv4-mapped GID on this RDMA device (is the interface up with an IPv4 "
                             "address?); set JACKLRING_IBV_GID_INDEX to choose one")


def probe_devices(names: set[str]) -> str | None:
    """None when pyverbs imports and every named device exists, else the reason."""
    try:
        from pyverbs.device import get_device_list
    except ImportError as exc:
        return f"pyverbs is not installed ({exc})"
    try:
        found = {d.name.decode() if isinstance(d.name, bytes) else d.name for d in get_device_list()}
    except Exception as exc:  # PyverbsRDMAError when no RDMA device / driver exists
        return f"no RDMA device ({type(exc).__name__}: {exc})"
    missing = sorted(names - found)
    if missing:
        return f"RDMA device(s) {', '.join(missing)} not found (present: {', '.join(sorted(found)) or 'none'})"
    return None


# ---------------------------------------------------------------- hardware layer (needs a device)

class _QueuePair:
    """PD, CQ and RC QP on one device towards one peer. Untested here: needs an RDMA device."""

    def __init__(self, device: str, depth: int) -> None:
        from pyverbs import enums as e
        from pyverbs.cq import CQ
        from pyverbs.device import Context
        from pyverbs.pd import PD
        from pyverbs.qp import QP, QPCap, QPInitAttr

        self.device = device
        self.ctx = Context(name=device)
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, 2 * depth, None, None, 0)
        cap = QPCap(max_send_wr=depth, max_recv_wr=depth, max_send_sge=1, max_recv_sge=1)
        self.qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))
        self.psn = int.from_bytes(os.urandom(3), "little") & PSN_MASK
        port = self.ctx.query_port(PORT)
        gids = []
        for i in range(port.gid_tbl_len):
            try:
                gids.append(str(self.ctx.query_gid(port_num=PORT, index=i)))
            except Exception:
                gids.append(None)
        self.gid_index = choose_gid_index(gids)
        self.info = {"qpn": self.qp.qp_num, "psn": self.psn, "lid": port.lid, "gid": gids[self.gid_index]}

    def connect(self, remote: dict) -> None:
        """RESET -> INIT -> RTR -> RTS towards the remote queue pair."""
        from pyverbs import enums as e
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        attr = QPAttr(port_num=PORT)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE
        attr.path_mtu = e.IBV_MTU_1024
        attr.dest_qp_num = remote["qpn"]
        attr.rq_psn = remote["psn"]
        attr.max_dest_rd_atomic = 1
        attr.min_rnr_timer = 12
        attr.ah_attr = AHAttr(gr=GlobalRoute(dgid=GID(remote["gid"]), sgid_index=self.gid_index),
                              is_global=1, dlid=remote["lid"], port_num=PORT)
        self.qp.to_rtr(attr)
        attr.sq_psn = self.psn
        attr.timeout = 14       # ~67 ms per try: a dead peer surfaces as RETRY_EXC_ERR within seconds
        attr.retry_cnt = 7
        attr.rnr_retry = 7      # receiver not ready: keep retrying (the peer posts soon)
        attr.max_rd_atomic = 1
        self.qp.to_rts(attr)

    def register(self, nbytes: int):
        from pyverbs import enums as e
        from pyverbs.mr import MR
        return MR(self.pd, nbytes, e.IBV_ACCESS_LOCAL_WRITE)

    def post_send(self, mr, nbytes: int, wr_id: int) -> None:
        from pyverbs import enums as e
        from pyverbs.wr import SGE, SendWR
        self.qp.post_send(SendWR(wr_id=wr_id, opcode=e.IBV_WR_SEND, num_sge=1,
                                 sg=[SGE(mr.buf, nbytes, mr.lkey)], send_flags=e.IBV_SEND_SIGNALED))

    def post_recv(self, mr, nbytes: int, wr_id: int) -> None:
        from pyverbs.wr import SGE, RecvWR
        self.qp.post_recv(RecvWR(wr_id=wr_id, num_sge=1, sg=[SGE(mr.buf, nbytes, mr.lkey)]))

    def close(self) -> None:
        for obj in (self.qp, self.cq, self.pd, self.ctx):
            try:
                obj.close()
            except Exception:
                pass


def _view_of(mr) -> memoryview:
    """A writable memoryview onto a registered region (pyverbs allocates it; we alias it)."""
    return memoryview((ctypes.c_char * mr.length).from_address(mr.buf)).cast("B")


class VerbsTransport(Transport):
    name = "rdma"

    def __init__(self, rank: int, size: int, queue_pairs: dict[int, list[_QueuePair]],
                 frame_bytes: int = FRAME_BYTES) -> None:
        self.rank = rank
        self.size = size
        self.peers = sorted(queue_pairs)
        self.frame_bytes = frame_bytes
        self.slots = max(SLOTS, max((len(q) for q in queue_pairs.values()), default=1))
        self._qps = queue_pairs
        self._pending = PendingWork(rank)
        self._pool = BufferPool(frame_bytes, self._allocate)
        self._closed = False

    def _qp(self, peer: int, slot: int) -> _QueuePair:
        qps = self._qps[peer]
        return qps[slot % len(qps)]

    def _allocate(self, nbytes: int, key: tuple[int, int, int]):
        peer, _, slot = key
        mr = self._qp(peer, slot).register(nbytes)
        return mr, _view_of(mr)

    def send_buffer(self, peer: int, slot: int) -> memoryview:
        return self._pool.get(peer, SEND, slot)[1]

    def recv_buffer(self, peer: int, slot: int) -> memoryview:
        return self._pool.get(peer, RECV, slot)[1]

    def post_send(self, peer: int, slot: int, nbytes: int) -> None:
        mr, _ = self._pool.get(peer, SEND, slot)
        self._qp(peer, slot).post_send(mr, nbytes, self._pending.post(SEND, peer, slot))

    def post_recv(self, peer: int, slot: int) -> None:
        mr, _ = self._pool.get(peer, RECV, slot)
        self._qp(peer, slot).post_recv(mr, self.frame_bytes, self._pending.post(RECV, peer, slot))

    def poll(self, deadline: float) -> list[Completion]:
        spins = 0
        while True:
            done = []
            for qps in self._qps.values():
                for qp in qps:
                    n, wcs = qp.cq.poll(_POLL_BATCH)
                    done.extend(check_completion(wc, self._pending, self.rank) for wc in wcs[:n])
            if done:
                return done
            spins += 1
            if spins % 1024 == 0:
                if time.monotonic() > deadline:
                    raise CollectiveTimeout(f"rank {self.rank}: timed out waiting for RDMA completions "
                                            f"({self._pending.describe()})")
                time.sleep(0)  # let other threads run while we spin

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _, (mr, _view) in list(self._pool.items()):
            try:
                mr.close()
            except Exception:
                pass
        self._pool.clear()
        for qps in self._qps.values():
            for qp in qps:
                qp.close()


def connect(rank: int, size: int, peers: list[int], device_row: list[list[str]], exchange: Exchange,
            deadline: float) -> VerbsTransport:
    """Open a queue pair per (peer, device), exchange their numbers and GIDs with `exchange`
    (called exactly once, on every rank) and move them to ready-to-send."""
    depth = 4 * SLOTS
    queue_pairs: dict[int, list[_QueuePair]] = {}
    try:
        for p in peers:
            queue_pairs[p] = [_QueuePair(device, depth) for device in device_row[p]]
        mine = {str(p): [qp.info for qp in qps] for p, qps in queue_pairs.items()}
        blobs = exchange(json.dumps(mine).encode())
        if time.monotonic() > deadline:
            raise PeerError(f"rank {rank}: RDMA set-up ran past its deadline")
        for p, qps in queue_pairs.items():
            theirs = json.loads(blobs[p]).get(str(rank))
            if theirs is None or len(theirs) != len(qps):
                raise ConfigError(f"rank {rank} and rank {p} disagree on the number of RDMA devices "
                                  f"between them (MLX_IBV_DEVICES cells [{rank}][{p}] and [{p}][{rank}])")
            for qp, remote in zip(qps, theirs):
                qp.connect(remote)
    except BaseException:
        for qps in queue_pairs.values():
            for qp in qps:
                qp.close()
        raise
    return VerbsTransport(rank, size, queue_pairs)
