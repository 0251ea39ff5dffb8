"""Enums, frozen per-call option dataclasses and the exception hierarchy."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum

DEFAULT_TIMEOUT = timedelta(seconds=30)
"""Timeout of every rendezvous wait and every op unless the group sets another."""

LONGEST_TIMEOUT = timedelta(days=365)
"""The longest that any wait of this library lasts: a longer timeout, up to ``timedelta.max``,
waits this long, which is no practical limit. Gloo's clock overflows near 250 years and
Python's waits refuse about 292, so a longer wait could not be honoured on every transport."""


FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
"""The floating-point dtype names; the only ones ``ReduceOp.AVG`` takes."""


class ArgumentError(RuntimeError):
    """An argument of a call is invalid; raised before anything is sent.

    Every one is also a ``ValueError`` or a ``TypeError`` (the two subclasses
    below), and a ``RuntimeError``, which is what code written for
    ``ray.util.collective`` catches. It is no ``CollectiveError``: the group
    stays usable.
    """


class ArgumentValueError(ArgumentError, ValueError):
    """An argument has a wrong value: a rank out of range, a list of the wrong length."""


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument is of a wrong kind: not a buffer, an unsupported dtype or device."""


def bounded_timeout(timeout: object, name: str = "timeout") -> timedelta | None:
    """Return ``timeout``, None or a positive ``timedelta``, at most ``LONGEST_TIMEOUT``.

    Raises:
        ArgumentTypeError: ``timeout`` is neither None nor a ``timedelta``.
        ArgumentValueError: ``timeout`` is zero or negative.

    """
    if timeout is None:
        return None
    if not isinstance(timeout, timedelta):
        raise ArgumentTypeError(
            f"{name} must be a datetime.timedelta, got {type(timeout).__name__}"
        )
    if timeout <= timedelta(0):
        raise ArgumentValueError(f"{name} must be positive, got {timeout}")
    return min(timeout, LONGEST_TIMEOUT)


def time_left(deadline: float) -> timedelta:
    """Return the time from now until ``deadline`` (a ``time.monotonic`` time), at least 1 ms.

    A wait with what is left of an op's deadline never gets a zero or negative timeout,
    which would not wait at all or be refused.
    """
    return timedelta(seconds=max(deadline - time.monotonic(), 0.001))


def _foreign_name(value: object, enum_name: str) -> str | None:
    """Return the member name of ``value`` if it is a member of another library's enum.

    ``ray.util.collective.types.ReduceOp.SUM`` maps to ``"SUM"``; nothing of Ray
    is imported to recognise it.
    """
    if isinstance(value, Enum) and type(value).__name__ == enum_name:
        return value.name
    return None


def _qualified(value: object) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}"


class Backend(str, Enum):
    """A collective transport; user strings are matched case-insensitively."""

    GLOO = "gloo"
    NCCL = "nccl"

    @classmethod
    def _missing_(cls, value: object) -> Backend | None:
        if isinstance(value, str):
            name = value.lower()
            if name == "torch_gloo":
                return cls.GLOO
            for member in cls:
                if member.value == name:
                    return member
        return None

    @classmethod
    def parse(cls, value: Backend | str) -> Backend:
        """Normalise a backend given as an enum member or a string.

        Ray's ``Backend.GLOO`` is the string ``"GLOO"``, so it parses as any name does.

        Raises:
            ArgumentTypeError: ``value`` is neither a ``Backend`` nor a string.
            ArgumentValueError: ``value`` names no known backend.

        """
        if isinstance(value, cls):
            return value
        value = _foreign_name(value, "Backend") or value
        if not isinstance(value, str):
            raise ArgumentTypeError(f"backend must be a Backend or a str, got {_qualified(value)}")
        try:
            return cls(value)
        except ValueError:
            known = ", ".join(repr(m.value) for m in cls)
            raise ArgumentValueError(f"backend must be one of {known}, got {value!r}") from None


class CpuTransport(str, Enum):
    """How a CPU (``backend="gloo"``) group moves bytes between its ranks.

    ``AUTO`` uses shared memory among the ranks that share a node and Gloo over
    TCP between nodes. ``GLOO`` forces Gloo over TCP everywhere, for debugging
    and comparison. ``SHM`` is ``AUTO`` that refuses to fall back to TCP inside
    a node when the shared-memory arena cannot be made.
    """

    AUTO = "auto"
    SHM = "shm"
    GLOO = "gloo"

    @classmethod
    def parse(cls, value: CpuTransport | str, name: str = "cpu_transport") -> CpuTransport:
        """Normalise a transport given as an enum member or a string (any case).

        Raises:
            ArgumentTypeError: ``value`` is neither a ``CpuTransport`` nor a string.
            ArgumentValueError: ``value`` names no transport.

        """
        if isinstance(value, cls):
            return value
        if not isinstance(value, str):
            raise ArgumentTypeError(
                f"{name} must be a CpuTransport or a str, got {type(value).__name__}"
            )
        try:
            return cls(value.lower())
        except ValueError:
            known = ", ".join(repr(m.value) for m in cls)
            raise ArgumentValueError(f"{name} must be one of {known}, got {value!r}") from None


@dataclass(frozen=True)
class GroupOptions:
    """Settings of one group that its members agree on and its backend reads.

    ``None`` means "not set by the caller": the member that builds the group then
    reads the environment variable named below, so ``runtime_env`` works.
    """

    strict_buffers: bool | None = None
    """Refuse read-only output buffers instead of writing them with a warning
    (``COLLECTIVE_STRICT_BUFFERS=1``)."""

    cpu_transport: CpuTransport | None = None
    """The CPU groups' transport (``COLLECTIVE_CPU_TRANSPORT``); ``AUTO`` when unset."""

    def resolved(self) -> GroupOptions:
        """Return these options with every unset field taken from the environment.

        Raises:
            ArgumentValueError: an environment variable holds a value it cannot take.

        """
        strict = self.strict_buffers
        if strict is None:
            raw = os.environ.get(STRICT_BUFFERS_ENV, "0").strip().lower()
            if raw not in _FLAG_VALUES:
                raise ArgumentValueError(
                    f"{STRICT_BUFFERS_ENV} must be one of {sorted(_FLAG_VALUES)}, got {raw!r}"
                )
            strict = _FLAG_VALUES[raw]
        transport = self.cpu_transport
        if transport is None:
            raw = os.environ.get(CPU_TRANSPORT_ENV, CpuTransport.AUTO.value)
            transport = CpuTransport.parse(raw, CPU_TRANSPORT_ENV)
        return GroupOptions(strict, transport)


STRICT_BUFFERS_ENV = "COLLECTIVE_STRICT_BUFFERS"
"""Environment variable that makes groups refuse read-only output buffers when set to 1."""

CPU_TRANSPORT_ENV = "COLLECTIVE_CPU_TRANSPORT"
"""Environment variable that picks the CPU transport: auto, shm or gloo."""

_FLAG_VALUES = {"": False, "0": False, "false": False, "no": False}
_FLAG_VALUES.update({"1": True, "true": True, "yes": True})


class ReduceOp(Enum):
    """An elementwise reduction; the first four are numbered as in ``ray.util.collective``.

    ``AVG`` takes floating-point tensors only. ``BAND``, ``BOR`` and ``BXOR`` take
    integer and bool tensors only.
    """

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    AVG = 4
    BAND = 5
    BOR = 6
    BXOR = 7

    def accepts(self, dtype: str) -> bool:
        """Return whether this reduction is defined on tensors of ``dtype`` (a dtype name)."""
        if self is ReduceOp.AVG:
            return dtype in FLOAT_DTYPES
        if self in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
            return dtype not in FLOAT_DTYPES
        return True

    @classmethod
    def parse(cls, value: ReduceOp | str) -> ReduceOp:
        """Normalise a reduction given as an enum member, its name, or Ray's member of that name.

        Raises:
            ArgumentTypeError: ``value`` is no ``ReduceOp``, no string and no Ray ``ReduceOp``.
            ArgumentValueError: ``value`` names no known reduction.

        """
        if isinstance(value, cls):
            return value
        name = _foreign_name(value, "ReduceOp")
        if name is None and isinstance(value, str):
            name = value.upper()
        if name is not None and name in cls.__members__:
            return cls[name]
        if name is not None:
            known = ", ".join(cls.__members__)
            raise ArgumentValueError(f"op must be one of {known}, got {value!r}")
        raise ArgumentTypeError(
            f"op must be a collective.ReduceOp or its name, got {_qualified(value)}"
        )


@dataclass(frozen=True)
class AllReduceOptions:
    """Options of one allreduce call."""

    reduce_op: ReduceOp = ReduceOp.SUM
    timeout: timedelta | None = None
    async_op: bool = False


@dataclass(frozen=True)
class BarrierOptions:
    """Options of one barrier call."""

    timeout: timedelta | None = None
    async_op: bool = False


@dataclass(frozen=True)
class ReduceOptions:
    """Options of one reduce call."""

    reduce_op: ReduceOp = ReduceOp.SUM
    root_rank: int = 0
    root_tensor: int = 0
    timeout: timedelta | None = None
    async_op: bool = False


@dataclass(frozen=True)
class AllGatherOptions:
    """Options of one allgather call."""

    timeout: timedelta | None = None
    async_op: bool = False


@dataclass(frozen=True)
class BroadcastOptions:
    """Options of one broadcast call."""

    root_rank: int = 0
    root_tensor: int = 0
    timeout: timedelta | None = None
    async_op: bool = False


@dataclass(frozen=True)
class ReduceScatterOptions:
    """Options of one reducescatter call."""

    reduce_op: ReduceOp = ReduceOp.SUM
    timeout: timedelta | None = None
    async_op: bool = False


@dataclass(frozen=True)
class SendOptions:
    """Options of one send call."""

    dst_rank: int = 0
    dst_gpu_index: int = 0
    n_elements: int = 0
    timeout: timedelta | None = None
    async_op: bool = False


@dataclass(frozen=True)
class RecvOptions:
    """Options of one recv call."""

    src_rank: int = 0
    src_gpu_index: int = 0
    n_elements: int = 0
    timeout: timedelta | None = None
    async_op: bool = False


@dataclass(frozen=True)
class GatherOptions:
    """Options of one gather call."""

    root_rank: int = 0
    timeout: timedelta | None = None
    async_op: bool = False


@dataclass(frozen=True)
class ScatterOptions:
    """Options of one scatter call."""

    root_rank: int = 0
    timeout: timedelta | None = None
    async_op: bool = False


@dataclass(frozen=True)
class AllToAllOptions:
    """Options of one alltoall call."""

    timeout: timedelta | None = None
    async_op: bool = False


class CollectiveError(RuntimeError):
    """A collective operation or group lifecycle step failed."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A rendezvous wait or an op did not complete within its timeout."""

    def __init__(
        self, op: str, group_name: str, rank: int, timeout: timedelta, detail: str = ""
    ) -> None:
        self.op = op
        self.group_name = group_name
        self.rank = rank
        self.timeout = timeout
        self.detail = detail
        message = (
            f"{op} on group {group_name!r} timed out on rank {rank} "
            f"after {timeout.total_seconds():g}s"
        )
        super().__init__(f"{message}: {detail}" if detail else message)

    def __reduce__(self) -> tuple[type, tuple[str, str, int, timedelta, str]]:
        return (type(self), (self.op, self.group_name, self.rank, self.timeout, self.detail))


class GroupNotFoundError(CollectiveError):
    """No group of that name exists in this process or in the cluster."""
