"""What the fast-path scripts of this folder share (imported, not run): the job's group, which
must have shared memory and the engine's fast path, fail(), and the sequence-number check."""
import sys
from typing import Callable

import numpy as np

import adapter
from adapter.errors import MismatchError

g = adapter.init(strict=True)
r, n = g.rank(), g.size()
state = getattr(g.backend, "state", None)  # the ring's; JACCL's backend does not show its count


def fail(text: str) -> None:
    sys.exit(f"rank {r}: {text}")


if (state is not None and state.shm is None) or g.fast is None:
    fail("expected shared memory and the fast path")


def sequences_agree() -> None:
    """The ring's sequence number is its segment's on this rank and the same on every rank."""
    if state is not None:
        seqs = adapter.all_gather(np.array([state.seq], np.int64))
        if state.seq != state.shm.sequence or len(set(seqs.tolist())) != 1:
            fail(f"sequence numbers: this rank {state.seq}, its segment {state.shm.sequence}, all {seqs.tolist()}")


def worded_alike(calls: dict[str, Callable[[adapter.Group], object]]) -> None:
    """Each call (label: a collective on a group) must raise MismatchError, on a fresh split of
    the job each, and every label's message must be the same."""
    texts = {}
    for label, call in calls.items():
        sub = g.split(0)
        try:
            call(sub)
        except MismatchError as exc:
            texts[label] = str(exc)
        else:
            fail(f"{label}: no MismatchError")
        sub.close()
    if len(set(texts.values())) != 1 or "mismatch" not in next(iter(texts.values())):
        fail("a mismatch is worded apart:\n" + "\n".join(f"{k}: {v}" for k, v in texts.items()))
