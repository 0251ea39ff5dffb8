"""Op progress: when an op times out, ask the peers which op of the group they have reached.

Each rank counts the collective ops it issues on a group: a plain counter, nothing
is sent per op. When an op times out, the rank deletes each peer's count key, then
writes a query under the peer's abort key in the rendezvous store, the key that
the peer's ``FailureWatch`` thread is already blocked on. Each time that thread
wakes, it deletes its abort key and then writes its count (and, where the group keeps
it, the name of the last op it issued) under its count key, so every query, even one
that another rank's query or a failure report overwrote before it was read, is
followed by a count written after it was asked. A peer whose count is below the
number of the op that timed out never joined that op.

A rank that destroys its group stops answering, but its count is final then: it
leaves it under a final key that askers never delete (``settle``), before its watch
thread ends, and publishes it once more under its count key after. An asker rings,
then reads the final key, and waits for the count key only where there is none: it
gets an answer whether the peer destroyed before, while or after it was asked.

Point-to-point ops are not counted: two ranks issue them, so counts would differ.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

from collective.rendezvous.store import RendezvousStore
from collective.types import CollectiveError

QUERY = b"\x00progress/"
"""How a query written under an abort key starts; the querier's rank follows."""

ANSWER_WAIT = timedelta(seconds=2)
"""How long a timed-out rank waits for all its peers' answers together."""

ANSWER_SHARE = 0.1
"""The share of a timeout that a timed-out op waits on top for the peers' progress answers."""

LEAST_ANSWER_WAIT = timedelta(milliseconds=500)
"""The shortest wait for the answers: what a live peer on a busy node needs to give one
(its watch thread wakes and makes two store calls, each a round trip to the store actor)."""


def answer_wait(timeout: timedelta) -> timedelta:
    """Return how long an op that timed out after ``timeout`` waits for its peers' answers.

    A share of the timeout, between ``LEAST_ANSWER_WAIT`` and ``ANSWER_WAIT``:
    a short ``wait(timeout)`` raises soon after its timeout even while a peer is frozen
    and never answers.
    """
    return min(ANSWER_WAIT, max(LEAST_ANSWER_WAIT, timeout * ANSWER_SHARE))


def is_query(value: bytes) -> bool:
    """Return whether ``value``, read from an abort key, is a progress query."""
    return value.startswith(QUERY)


def _count_key(rank: int) -> str:
    return f"progress/count/{rank}"


def _final_key(rank: int) -> str:
    return f"progress/final/{rank}"


def publish(store: RendezvousStore, rank: int, count: int, last: str = "") -> None:
    """Write ``rank``'s op count and last op under its count key, for askers; never raises."""
    _write(store, _count_key(rank), count, last)


def settle(store: RendezvousStore, rank: int, count: int, last: str = "") -> bool:
    """Leave ``rank``'s final op count and last op for askers once it stops answering.

    Written when its group is destroyed; never raises.

    Returns:
        Whether the store took it.

    """
    return _write(store, _final_key(rank), count, last)


def _write(store: RendezvousStore, key: str, count: int, last: str) -> bool:
    try:
        store.set(key, f"{count}\n{last}".encode())
    except (CollectiveError, TimeoutError, RuntimeError):
        return False
    return True


def _answer(store: RendezvousStore, peer: int, wait: timedelta) -> bytes:
    """Return ``peer``'s final count if it has stopped, else its answer within ``wait``."""
    final = store.peek(_final_key(peer))
    return final if final is not None else store.get(_count_key(peer), wait)


def ask(
    store: RendezvousStore,
    rank: int,
    world_size: int,
    op_number: int,
    query_key: Callable[[int], str],
    wait: timedelta = ANSWER_WAIT,
    op: str = "",
) -> str:
    """Ask every peer for its op count; describe who joined op ``op_number`` and who never did.

    Args:
        store: the group's rendezvous store.
        rank: this rank.
        world_size: the group's size.
        op_number: the number of the op that timed out here, counting from 1.
        query_key: the key a peer's watch thread reads, by the peer's rank.
        wait: how long to wait for all answers together.
        op: the op that timed out here, to name a peer whose op of that number differs.

    Returns:
        One line for the error message; it never raises.

    """
    peers = [r for r in range(world_size) if r != rank]
    asked = []
    for peer in peers:
        try:
            store.delete(_count_key(peer))
            store.set(query_key(peer), QUERY + f"{rank}".encode())
            asked.append(peer)
        except (CollectiveError, TimeoutError, RuntimeError):
            continue
    deadline = time.monotonic() + wait.total_seconds()
    counts: dict[int, int] = {}
    lasts: dict[int, str] = {}
    for peer in asked:
        left = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        try:
            count, _, last = _answer(store, peer, left).decode().partition("\n")
            counts[peer] = int(count)
            lasts[peer] = last
        except (CollectiveError, TimeoutError, RuntimeError, ValueError):
            continue
    silent = [p for p in peers if p not in counts]
    return describe(rank, op_number, counts, silent, "did not answer (dead or frozen)", lasts, op)


def describe(
    rank: int,
    op_number: int,
    counts: dict[int, int],
    unknown: list[int],
    why: str,
    lasts: dict[int, str] | None = None,
    op: str = "",
) -> str:
    """Describe who joined op ``op_number``, given the op ``counts`` of the peers that said.

    Args:
        rank: this rank, which joined the op.
        op_number: the number of the op that timed out here, counting from 1.
        counts: how many ops each peer that could be asked has issued.
        unknown: the peers whose count is not known.
        why: why they are not known, e.g. ``"did not answer"``.
        lasts: the name of the last op each peer issued, where it said ("" if none).
        op: this rank's op; a peer whose op ``op_number`` (its last) has another name
            issued a different op.

    Returns:
        One line for a timeout's message.

    """
    said = lasts or {}
    other = sorted(p for p, c in counts.items() if c == op_number and op and said.get(p, op) != op)
    joined = sorted([rank] + [p for p, c in counts.items() if c >= op_number and p not in other])
    missing = sorted(p for p, c in counts.items() if c < op_number)
    line = f"ranks that joined it (op {op_number} of the group): {joined}; "
    line += f"ranks that never joined it: {missing}"
    if missing:
        line += " (" + ", ".join(_issued(p, counts[p], said.get(p, "")) for p in missing) + ")"
    if other:
        line += f"; ranks whose op {op_number} was another: " + ", ".join(
            f"rank {p} ({said[p]})" for p in other
        )
    return line + (f"; ranks that {why}: {unknown}" if unknown else "")


def _issued(peer: int, count: int, last: str) -> str:
    text = f"rank {peer} has issued {count} ops"
    return f"{text}, the last {last}" if last and count else text
