"""What the caller of an op sees when the op's steps in shared memory fail.

The CPU group and the group of ranks that share a GPU take their steps through the
same protocol (``steps``, ``sendrecv``, ``sync``), which fails with its own
exceptions; ``caller_error`` turns each into the error the caller gets, in the
group's words, and says whether the failure breaks the group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta

import numpy as np

from collective import signature
from collective.groups.shm.sendrecv import MessageMismatchError
from collective.groups.shm.steps import MismatchError
from collective.groups.shm.sync import AbortedError, PeerDiedError, StalledError
from collective.types import (
    ArgumentError,
    ArgumentValueError,
    CollectiveError,
    CollectiveTimeoutError,
)


def caller_error(
    exc: BaseException,
    op: str,
    group_name: str,
    rank: int,
    timeout: timedelta,
    global_rank: Callable[[int], int],
    laggards: Callable[[int | None], str],
) -> tuple[BaseException, bool]:
    """Return the error the caller of ``op`` sees of ``exc``, and whether it breaks the group.

    Args:
        exc: what ended the op.
        op: the op's name.
        group_name: the group's name.
        rank: this rank, in the group.
        timeout: the op's timeout.
        global_rank: maps a local rank (an index among the arena's ranks) to the group's.
        laggards: describes who never joined the op, given the local rank this rank
            waited on when time ran out (or None).

    """
    where = f"{op} on group {group_name!r}"
    if isinstance(exc, ArgumentError):
        return exc, False
    if isinstance(exc, MessageMismatchError):
        return CollectiveError(f"{where} failed on rank {rank}: {exc}"), False
    if isinstance(exc, CollectiveError):
        return exc, True
    if isinstance(exc, TimeoutError):
        stalled = exc.local_rank if isinstance(exc, StalledError) else None
        return CollectiveTimeoutError(op, group_name, rank, timeout, laggards(stalled)), True
    if isinstance(exc, PeerDiedError):
        dead = global_rank(exc.local_rank)
        return CollectiveError(f"{where} failed on rank {rank}: rank {dead} died"), True
    if isinstance(exc, AbortedError):
        why = str(exc)
        if exc.local_rank is not None and not why:
            why = f"rank {global_rank(exc.local_rank)} gave up on the group"
        return CollectiveError(f"{where} was aborted on rank {rank}: {why}"), True
    if isinstance(exc, MismatchError):
        message = (
            f"{where} failed on rank {rank}: {exc}; pass check_args=True to the group to "
            "catch such calls before any data moves"
        )
        return CollectiveError(message), True
    return CollectiveError(f"{where} failed on rank {rank}: {exc!r}"), True


def unpaired(
    sends: np.ndarray, receives: np.ndarray, size: int, ranks: Sequence[int]
) -> ArgumentValueError:
    """Return the error of an alltoall whose byte counts do not pair up, counted in elements.

    ``sends[i, j]`` is what local rank i sends to j, ``receives[j, i]`` what j expects
    from i, in bytes of elements of ``size``; ``ranks`` maps local ranks to the group's.
    """
    lines = signature.unpaired((sends // size).tolist(), (receives // size).tolist(), ranks)
    return ArgumentValueError("alltoall sizes do not pair up: " + "; ".join(lines))
