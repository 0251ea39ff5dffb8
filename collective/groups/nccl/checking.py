"""What the ranks compare before an op: its first use (see ``first``) and its signature check.

The signature check of a launch (see ``mismatch``): where it runs and on which communicator.

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

from collective.frameworks import cuda_buffers
from collective.groups.nccl import mismatch
from collective.groups.nccl.cuda import wait_events
from collective.groups.nccl.first import First
from collective.groups.nccl.launch import Launch, Signed, signed
from collective.groups.nccl.making import NcclMaking
from collective.types import ArgumentValueError, CollectiveError, ReduceOp


class NcclChecking(NcclMaking):
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

    def _room(self, signed: Signed, timeout: timedelta) -> None:
        """Make room in the check's ring (op lock held): read the oldest result if all are unread.

        The GPU runs ``mismatch.SLOTS`` checked ops behind the host: wait up to
        ``timeout`` for the oldest, so that no op goes unchecked.

        Raises:
            CollectiveError: the oldest result shows a mismatch.
            TimeoutError: the oldest check did not finish within ``timeout``.
            RuntimeError: CUDA or NCCL failed.

        """
        check = signed.check
        if check.full():
            if not wait_events(self._cuda, [check.oldest_event()], self._probe, timeout):
                raise TimeoutError(
                    f"the signature check of {check.oldest()}, {mismatch.SLOTS} ops earlier "
                    f"on cuda:{signed.device}, did not finish"
                )
            found = check.read()
            if found is not None:
                raise self._mismatched(found)

    def _check_op(self, op: str, signed: Signed) -> None:
        """Issue ``op``'s signature check on its stream's GPU (after ``_room``)."""
        with self._cuda.Device(signed.device):
            signed.check.issue(op, signed.ptr, signed.comm, signed.stream, signed.words)

    def _kind(
        self,
        op: str,
        check_as: str | None,
        signed: tuple[int, ReduceOp | None] | None,
        buffers: Sequence[Any],
        extra: tuple[Any, ...],
    ) -> tuple[object, ...]:
        """Return what every rank of a launch's communicator agrees on at its first use."""
        b = cuda_buffers.cuda_buffer(buffers[0], "tensor")
        if op in ("send", "recv"):
            peer, gpu, n_elements = extra
            me, other = (self.rank, b.device), (peer, gpu)
            ends = (me, other) if op == "send" else (other, me)
            return ("send/recv", *ends, b.dtype, n_elements or b.count)
        if signed is None:
            return (op, b.dtype)
        return (check_as or op, *mismatch.fields(check_as or op, buffers[0], *signed))

    def _connect(self, launch: Launch, first: First, timeout: timedelta, capturing: bool) -> None:
        """Agree with the peers before a launch's first use of its kind (see ``first``).

        Called only when ``first``, the launch's ``first``, is of a kind not in
        ``_first.agreed`` (the ops read that set inline: it is on every op's path).

        Raises:
            ArgumentValueError: the first use would be captured in a CUDA graph.
            CollectiveError: a peer issued another op, or none within ``timeout``.

        """
        if capturing:
            raise ArgumentValueError(
                f"the first {launch.op} of its kind on group {self.group_name!r} connects "
                "NCCL's peers, which a CUDA graph cannot capture: run it once before the capture"
            )
        try:
            self._first.agree(first, launch.op, timeout)
        except (CollectiveError, TimeoutError) as exc:
            number = self._issued + 1 if launch.counted else 0
            raise self._fail(launch.op, timeout, exc, number) from exc

    def _mismatched(self, found: str) -> CollectiveError:
        """Return the error of a mismatch the signature check ``found``."""
        return mismatch.error(self.group_name, self.rank, found)
