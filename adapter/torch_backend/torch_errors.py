"""The exceptions of the jacklring process group: torch-flavoured (also a DistBackendError)
and naming rank, group and operation. The one place that turns a failure into what torch's
callers see."""
from __future__ import annotations

import torch.distributed as dist

from ..errors import CULPRIT_MARK, DistributedError, culprit_of, failure_of, with_failure


def torch_flavoured(cls: type) -> type:
    """`cls` that is also a torch.distributed.DistBackendError, the class c10d's own backends
    raise, so `except dist.DistBackendError` catches jacklring's errors too. The classes keep the
    jacklring name (PeerError, ...) and are module attributes (TorchPeerError, ...) so they pickle."""
    if issubclass(cls, dist.DistBackendError):
        return cls
    name = f"Torch{cls.__name__}"
    flavoured = globals().get(name)
    if flavoured is None:
        flavoured = type(cls.__name__, (cls, dist.DistBackendError), {"__module__": __name__, "__doc__": cls.__doc__})
        flavoured.__qualname__ = name  # pickled by this name; shown as the jacklring class's name
        globals()[name] = flavoured
    return flavoured


def wrap_error(rank: int, group: str, what: str, exc: BaseException,
               deadline_s: float | None = None) -> BaseException:
    """A DistributedError (also a DistBackendError) naming rank, group and operation, chained
    to the cause. Timeouts carry torch's wording ("Timed out waiting <n>ms for ...") next to
    ours, as gloo's do, so what users and torch's tests match on is there."""
    if isinstance(exc, dist.DistBackendError) and f"rank {rank}" in str(exc) and what in str(exc):
        return exc
    cls = type(exc) if isinstance(exc, DistributedError) else DistributedError
    detail = str(exc)
    if isinstance(exc, TimeoutError) and "Timed out" not in detail:
        waited = f"waiting {deadline_s * 1000:.0f}ms " if deadline_s else ""
        detail = f"Timed out {waited}for {what} to complete: {detail}"
    message = f"rank {rank}: jacklring {what} (group {group!r}) failed: {detail}"
    culprit = culprit_of(exc)
    if culprit is not None and CULPRIT_MARK.format(culprit) not in message:
        # The marker survives where torch re-raises only the text (DDP's reducer, futures).
        message = f"{message} {CULPRIT_MARK.format(culprit)}"
    try:
        wrapped = torch_flavoured(cls)(message)
    except TypeError:
        wrapped = torch_flavoured(DistributedError)(message)
    wrapped.__cause__ = exc
    # The cause's failure record (the rank blamed, the link that failed), with the culprit found
    # along its chain.
    record = failure_of(exc)
    return with_failure(wrapped, record, culprit=record.culprit if culprit is None else culprit)
