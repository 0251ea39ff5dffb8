"""The signature check of a launch (see ``mismatch``): where it runs and on which communicator.

By default (``COLLECTIVE_NCCL_CHECK=1``) an op's check runs on the op's own stream
and communicator, just ahead of the op. With ``COLLECTIVE_NCCL_CHECK=side`` it runs
on a communicator that only checks use, one per GPU, and on the group's comm stream
of that GPU (the one its async ops run on), so that it never queues ahead of the op
on the op's stream. That communicator is made with the first check on its GPU, as
the collective ones are (every rank makes its k-th under store key ``check/k``),
kept with the group's others, and aborted or destroyed with them; the comm stream
goes back to the process's pool with the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from collective.groups.nccl import mismatch
from collective.groups.nccl.launch import Signed, signed
from collective.groups.nccl.lifecycle import NcclLifecycle
from collective.types import CollectiveError, ReduceOp


class NcclChecking(NcclLifecycle):
    """Builds each launch's signature check; ``running.NcclRunning`` issues and reads it."""

    def _signed(
        self,
        op: str,
        x: Any,
        device: int,
        comm: Any,
        stream: int,
        root: int,
        reduce_op: ReduceOp | None,
        timeout: timedelta,
    ) -> Signed:
        """Return the signature check of ``op`` on ``x``, on GPU ``device`` (``launch.signed``).

        ``comm`` and ``stream`` are the op's; a group that checks beside its ops
        (``mismatch.SIDE``) uses its check communicator and comm stream instead,
        making them within ``timeout`` if new.
        """
        check = self._checks.get(device)
        if check is None:
            check = self._checks[device] = mismatch.Check(self._cupy, device)
        if self._side:
            comm = self._check_comms((device,), timeout)[0]
            stream = self._stream(device)
        words = mismatch.words(op, x, root, reduce_op)
        return signed(self._cupy, check, words, device, comm, stream)

    def _check_comms(self, devices: Sequence[int], timeout: timedelta) -> list[Any]:
        """Return the communicators of the checks on ``devices``, making them if new.

        The k-th made by a group meets under ``check/k``: the ranks make them in the
        same order, at the first check on those devices, as they issue the same ops.
        """
        key = ("check", tuple(devices))
        found = self._comms.get(key)
        if found is not None:
            return found
        made = sum(1 for k in self._comms if k[0] == "check")
        n = len(devices)
        ranks = [self.rank * n + i for i in range(n)]
        world = self.world_size * n
        return self._communicators(key, f"check/{made}", devices, world, ranks, timeout)

    def _mismatched(self, found: str) -> CollectiveError:
        """Return the error of a mismatch the signature check ``found``."""
        return mismatch.error(self.group_name, self.rank, found)
