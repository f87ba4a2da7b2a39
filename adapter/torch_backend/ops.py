"""Tensor-level collectives for the torch process group, written against the adapter Backend
interface (numpy buffers) so every adapter backend can run underneath.

Contiguous CPU tensors are viewed in place (no copy). A contiguous CUDA tensor goes to a backend
that takes device buffers (NCCL) as it is; otherwise it is staged through one pinned host copy
each way. Anything else (non-contiguous CPU tensors) goes through a contiguous CPU copy that is
written back afterwards.
Everything here runs on the process group's communication thread, or inline on the calling thread
for a synchronous op (see process_group.py).
"""
from __future__ import annotations

import threading
from typing import Callable, Sequence

import numpy as np
import torch

from .. import gpu
from ..arrays import as_numpy, numpy_dtype, plain_cpu_tensor_view
from ..backends.base import Backend, ReduceOp
from ..backends.elements import DTYPE_CODES
from ..backends.protocol import RECV, SEND, Request, mismatch_message
from ..errors import MismatchError
from .arg_errors import InvalidArgument, InvalidArgumentType

RED_OPS = {
    "SUM": ReduceOp.SUM,
    "PRODUCT": ReduceOp.PROD,
    "MIN": ReduceOp.MIN,
    "MAX": ReduceOp.MAX,
    "BAND": ReduceOp.BAND,
    "BOR": ReduceOp.BOR,
    "BXOR": ReduceOp.BXOR,
}


def reduce_op_name(op: object) -> str:
    """'SUM', 'AVG', ... from a torch ReduceOp, RedOpType or string."""
    op = getattr(op, "op", op)  # torch.distributed.ReduceOp wraps a RedOpType in .op
    name = getattr(op, "name", None) or str(op).rsplit(".", 1)[-1]
    return name.upper()


def check_reduce_op(name: str, tensor: torch.Tensor) -> None:
    """Reject what cannot be done before anything is queued, so the caller gets the error."""
    if name == "PREMUL_SUM":
        raise InvalidArgument("jacklring does not support ReduceOp.PREMUL_SUM (an NCCL-only op); "
                         "scale the tensor and use SUM")
    if name != "AVG" and name not in RED_OPS:
        raise InvalidArgument(f"jacklring does not support reduce op {name}")
    if name == "AVG" and tensor.dtype == torch.bool:
        raise InvalidArgument("ReduceOp.AVG is undefined for bool tensors")
    if name in ("BAND", "BOR", "BXOR") and (tensor.is_floating_point() or tensor.is_complex()):
        raise InvalidArgument(f"ReduceOp.{name} needs an integer or bool tensor, got {tensor.dtype}")
    if name in ("MIN", "MAX") and tensor.is_complex():
        raise InvalidArgument(f"ReduceOp.{name} is undefined for complex tensors")


def finish_average(tensor: torch.Tensor, name: str, size: int) -> None:
    """AVG = SUM then divide; integers divide truncating toward zero (as NCCL does)."""
    if name != "AVG":
        return
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.div_(size)
    else:
        tensor.copy_(torch.div(tensor, size, rounding_mode="trunc"))


BACKEND_SUM = ReduceOp.SUM


def backend_op(name: str) -> ReduceOp:
    return ReduceOp.SUM if name == "AVG" else RED_OPS[name]


class Staged:
    """A 1-D numpy view of a tensor: the tensor itself when it is contiguous CPU memory, else a
    contiguous host copy that write_back() copies into the tensor. A CUDA tensor's copy is in
    pinned memory from adapter.gpu's pool: one device-to-host copy in, one host-to-device out."""

    def __init__(self, tensor: torch.Tensor, fill: bool = True) -> None:
        self.tensor = tensor
        plain = plain_cpu_tensor_view(tensor)  # the common case, in a few attribute reads
        if plain is not None:
            self.copy, self.staged, self.array = tensor, False, plain.reshape(-1)
            return
        self.staged = True
        if tensor.is_cuda:
            source = tensor.detach().resolve_conj().resolve_neg()
            host = gpu.stage_to_host(source) if fill else gpu.host_empty(tuple(tensor.shape), numpy_dtype(tensor.dtype),
                                                                          tensor)
            self.array = host.reshape(-1)
            self.copy = torch.from_numpy(self.array.view(np.uint8)).view(tensor.dtype).view(tensor.shape)
            return
        direct = tensor.device.type == "cpu" and tensor.is_contiguous() and not tensor.is_conj() \
            and not tensor.is_neg()
        if direct:
            self.copy = tensor.detach()
        elif fill:
            self.copy = tensor.detach().resolve_conj().resolve_neg().to("cpu", memory_format=torch.contiguous_format)
            self.copy = self.copy.contiguous()
        else:
            self.copy = torch.empty(tensor.shape, dtype=tensor.dtype)
        self.staged = not direct
        self.array = as_numpy(self.copy.reshape(-1))[0]

    def write_back(self) -> None:
        if self.staged:
            with torch.no_grad():
                self.tensor.copy_(self.copy)


def on_device(comm: Backend, tensor: torch.Tensor) -> "gpu.DeviceBuffer | None":
    """A contiguous CUDA tensor headed for a backend that reads device memory itself (NCCL), as
    that backend's DeviceBuffer: no staging at all. None for everything else."""
    if comm.takes_device_buffers and tensor.is_cuda and tensor.is_contiguous() and not tensor.is_conj() \
            and not tensor.is_neg():
        return gpu.device_buffer(tensor)
    return None


def view(tensor: torch.Tensor, fill: bool = True) -> Staged:
    return Staged(tensor, fill)


# ---- reductions -------------------------------------------------------------------------------

def all_reduce(comm: Backend, tensors: Sequence[torch.Tensor], name: str) -> None:
    op = backend_op(name)
    for tensor in tensors:
        device = on_device(comm, tensor)
        if device is not None:
            comm.all_reduce(device, device, op)
        else:
            staged = view(tensor)
            comm.all_reduce(staged.array, staged.array, op)
            staged.write_back()
        finish_average(tensor, name, comm.size())


def sparse_all_reduce(comm: Backend, tensor: torch.Tensor) -> None:
    """SUM of sparse COO tensors (what gloo offers; DDP sends nn.Embedding(sparse=True) gradients
    this way): every rank's indices and values are gathered, concatenated in rank order and
    coalesced (duplicates summed), and the result replaces the tensor's contents."""
    mine = tensor.detach().coalesce().cpu()
    indices, values = mine.indices().contiguous(), mine.values().contiguous()
    n = comm.size()
    counts = torch.empty(n, dtype=torch.int64)
    comm.all_gather(as_numpy(torch.tensor([indices.shape[1]], dtype=torch.int64))[0], as_numpy(counts)[0])
    all_indices = [torch.empty(indices.shape[0], int(c), dtype=indices.dtype) for c in counts]
    all_values = [torch.empty(int(c), *values.shape[1:], dtype=values.dtype) for c in counts]
    all_gather_list(comm, all_indices, indices)
    all_gather_list(comm, all_values, values)
    total = torch.sparse_coo_tensor(torch.cat(all_indices, 1), torch.cat(all_values, 0), mine.shape).coalesce()
    with torch.no_grad():
        tensor.copy_(total.to(tensor.device))


def all_reduce_coalesced(comm: Backend, tensors: Sequence[torch.Tensor], name: str) -> None:
    """One all_reduce per dtype over the tensors packed end to end (few large messages)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for group in by_dtype.values():
        if len(group) == 1:
            all_reduce(comm, group, name)
            continue
        flat = torch.cat([t.detach().reshape(-1).cpu() for t in group])
        all_reduce(comm, [flat], name)
        offset = 0
        with torch.no_grad():
            for t in group:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view(t.shape))
                offset += n


def reduce(comm: Backend, tensor: torch.Tensor, root: int, name: str) -> None:
    """Result on root only; other ranks' tensors are left unchanged."""
    staged = view(tensor)
    if comm.rank() == root:
        comm.all_reduce(staged.array, staged.array, backend_op(name))
        staged.write_back()
        finish_average(tensor, name, comm.size())
    else:
        scratch = np.empty_like(staged.array)
        comm.all_reduce(staged.array, scratch, backend_op(name))


def reduce_scatter_flat(comm: Backend, output: torch.Tensor, input: torch.Tensor, name: str) -> None:
    """output (m elements) = this rank's block of op over ranks of input (size * m elements)."""
    n = comm.size()
    if input.numel() != n * output.numel():
        raise InvalidArgument(f"reduce_scatter: input has {input.numel()} elements, expected "
                         f"{n} x {output.numel()} (world size x output)")
    src = view(input)
    dst = view(output, fill=False)
    comm.reduce_scatter(src.array, dst.array, backend_op(name))
    dst.write_back()
    finish_average(output, name, n)


def reduce_scatter_list(comm: Backend, output: torch.Tensor, inputs: Sequence[torch.Tensor], name: str) -> None:
    """inputs[q] is the block reduced into rank q's output; blocks may differ in size."""
    n, r = comm.size(), comm.rank()
    if len(inputs) != n:
        raise InvalidArgument(f"reduce_scatter: expected {n} input tensors (one per rank), got {len(inputs)}")
    sizes = [t.numel() for t in inputs]
    if sizes[r] != output.numel():
        raise InvalidArgument(f"reduce_scatter: output has {output.numel()} elements but input block {r} has {sizes[r]}")
    flat = torch.cat([t.detach().reshape(-1).cpu() for t in inputs])
    if len(set(sizes)) == 1:
        reduce_scatter_flat(comm, output, flat, name)
        return
    # Uneven blocks: reduce everything, keep this rank's block.
    all_reduce(comm, [flat], name)
    start = sum(sizes[:r])
    with torch.no_grad():
        output.copy_(flat[start:start + sizes[r]].view(output.shape))


# ---- gathers --------------------------------------------------------------------------------

def all_gather_flat(comm: Backend, output: torch.Tensor, input: torch.Tensor) -> None:
    n = comm.size()
    if output.numel() != n * input.numel():
        raise InvalidArgument(f"all_gather_into_tensor: output has {output.numel()} elements, expected "
                         f"{n} x {input.numel()} (world size x input)")
    if output.dtype != input.dtype:
        raise InvalidArgumentType(f"all_gather_into_tensor: output dtype {output.dtype} != input dtype {input.dtype}")
    src = view(input)
    dst = view(output, fill=False)
    source = src.array
    if np.may_share_memory(source, dst.array):
        source = source.copy()  # FSDP passes its input as a slice of the output
    comm.all_gather(source, dst.array)
    dst.write_back()


def all_gather_list(comm: Backend, outputs: Sequence[torch.Tensor], input: torch.Tensor) -> None:
    """outputs[q] = rank q's input; sizes may differ between ranks (uneven all-gather): every
    rank knows them from its output list, so blocks are padded to the largest and sliced."""
    n, r = comm.size(), comm.rank()
    if len(outputs) != n:
        raise InvalidArgument(f"all_gather: expected {n} output tensors (one per rank), got {len(outputs)}")
    sizes = [t.numel() for t in outputs]
    if sizes[r] != input.numel():
        raise InvalidArgument(f"all_gather: output tensor {r} has {sizes[r]} elements but this rank's input "
                         f"has {input.numel()}")
    for t in outputs:
        if t.dtype != input.dtype:
            raise InvalidArgumentType(f"all_gather: output dtype {t.dtype} != input dtype {input.dtype}")
    block = max(sizes)
    src = torch.zeros(block, dtype=input.dtype)
    src[:input.numel()] = input.detach().reshape(-1).cpu()
    gathered = torch.empty(n * block, dtype=input.dtype)
    comm.all_gather(as_numpy(src)[0], as_numpy(gathered)[0])
    with torch.no_grad():
        for q, t in enumerate(outputs):
            t.copy_(gathered[q * block:q * block + sizes[q]].view(t.shape))


def broadcast(comm: Backend, tensor: torch.Tensor, root: int) -> None:
    device = on_device(comm, tensor)
    if device is not None:
        comm.broadcast(device, root)
        return
    staged = view(tensor)
    comm.broadcast(staged.array, root)
    staged.write_back()


# ---- point to point based (on a private communicator, see ProcessGroup._aux) ------------------

class Sender:
    """One helper thread so a rank can send to one peer while receiving from another."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, fn: Callable[[], None]) -> None:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                self._error = exc
        self._error = None
        self._thread = threading.Thread(target=run, name="jacklring-alltoall-send", daemon=True)
        self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def all_to_all(comm: Backend, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> None:
    """Pairwise exchange: at step s send to rank r+s while receiving from rank r-s."""
    n, r = comm.size(), comm.rank()
    if len(outputs) != n or len(inputs) != n:
        raise InvalidArgument(f"all_to_all: expected {n} input and {n} output tensors, got "
                         f"{len(inputs)} and {len(outputs)}")
    with torch.no_grad():
        outputs[r].copy_(inputs[r].view(outputs[r].shape) if inputs[r].numel() == outputs[r].numel()
                         else inputs[r])
    sender = Sender()
    for step in range(1, n):
        to, frm = (r + step) % n, (r - step) % n
        src = view(inputs[to])
        dst = view(outputs[frm], fill=False)
        if src.array.size:
            sender.start(lambda a=src.array, to=to: comm.send(a, to))
        try:
            if dst.array.size:
                comm.recv(dst.array, frm)
        finally:
            sender.join()
        dst.write_back()


def split_dim0(tensor: torch.Tensor, splits: Sequence[int], n: int, what: str) -> list[torch.Tensor]:
    if not splits:
        if tensor.shape[0] % n if tensor.dim() else tensor.numel() % n:
            raise InvalidArgument(f"all_to_all_single: {what} dim 0 ({tensor.shape[0] if tensor.dim() else 0}) "
                             f"is not divisible by the world size {n}; pass split sizes")
        flat = tensor if tensor.dim() else tensor.reshape(-1)
        return list(flat.chunk(n, 0)) if flat.shape[0] else [flat] * n
    if len(splits) != n or sum(splits) != tensor.shape[0]:
        raise InvalidArgument(f"all_to_all_single: {what} split sizes {list(splits)} do not cover dim 0 "
                         f"({tensor.shape[0]}) in {n} parts")
    return list(tensor.split(list(splits), 0))


def gather(comm: Backend, outputs: Sequence[torch.Tensor] | None, input: torch.Tensor, root: int) -> None:
    n, r = comm.size(), comm.rank()
    if r != root:
        comm.send(view(input).array, root)
        return
    assert outputs is not None
    with torch.no_grad():
        outputs[r].copy_(input.view(outputs[r].shape))
    for q in range(n):
        if q != r:
            dst = view(outputs[q], fill=False)
            comm.recv(dst.array, q)
            dst.write_back()


def scatter(comm: Backend, output: torch.Tensor, inputs: Sequence[torch.Tensor] | None, root: int) -> None:
    n, r = comm.size(), comm.rank()
    if r != root:
        dst = view(output, fill=False)
        comm.recv(dst.array, root)
        dst.write_back()
        return
    assert inputs is not None
    for q in range(n):
        if q != r:
            comm.send(view(inputs[q]).array, q)
    with torch.no_grad():
        output.copy_(inputs[r].view(output.shape))


# ---- tagged point to point ----------------------------------------------------------------------
# The adapter backends deliver a peer's messages in order, with no tag. torch matches a recv to
# the first message with its tag, so every message is preceded by an envelope the receiver reads
# first: magic, tag, byte count, dtype code. The payload travels as raw bytes.

ENVELOPE_MAGIC = 0x4A4C54475450  # "JLTGTP"
ENVELOPE_WORDS = 4


class Envelope:
    __slots__ = ("tag", "nbytes", "code")

    def __init__(self, tag: int, nbytes: int, code: int) -> None:
        self.tag, self.nbytes, self.code = tag, nbytes, code

    @classmethod
    def of(cls, array: np.ndarray, tag: int) -> "Envelope":
        return cls(int(tag), int(array.nbytes), DTYPE_CODES.get(array.dtype, 0))


def send_tagged(comm: Backend, array: np.ndarray, dst: int, tag: int) -> None:
    env = Envelope.of(array, tag)
    comm.send(np.array([ENVELOPE_MAGIC, env.tag, env.nbytes, env.code], np.int64), dst)
    if env.nbytes:
        comm.send(array.view(np.uint8), dst)


def recv_envelope(comm: Backend, src: int) -> Envelope:
    words = np.empty(ENVELOPE_WORDS, np.int64)
    comm.recv(words, src)
    if int(words[0]) != ENVELOPE_MAGIC:
        raise MismatchError(f"rank {comm.rank()}: a point-to-point message from rank {src} has no envelope "
                            f"(the peer does not speak jacklring's tagged protocol)")
    return Envelope(int(words[1]), int(words[2]), int(words[3]))


def recv_payload(comm: Backend, src: int, env: Envelope, into: np.ndarray | None = None) -> np.ndarray:
    """The payload announced by env: into `into` (an array of exactly env.nbytes), else into a
    fresh byte buffer that is returned."""
    target = np.empty(env.nbytes, np.uint8) if into is None else into.view(np.uint8)
    if env.nbytes:
        comm.recv(target, src)
    return target


def check_envelope(rank: int, src: int, env: Envelope, array: np.ndarray, tag: int) -> None:
    mine = Envelope.of(array, tag)
    if mine.nbytes != env.nbytes or mine.code != env.code:
        expected = Request(RECV, dtype=mine.code, nbytes=mine.nbytes, extra=src)
        sent = Request(SEND, dtype=env.code, nbytes=env.nbytes, extra=rank)
        raise MismatchError(mismatch_message(rank, src, expected, sent, f" (tag {tag})"))
