"""Where Ray's object store is mapped into this process, to recognise buffers that live there.

Torch keeps no read-only flag, so a torch tensor over a read-only array of Ray's
object store (``torch.from_numpy(ray.get(ref))``) is recognised by its address. The
address ranges come from ``/proc/self/maps`` (Linux): the shared-memory files that
Ray's store allocates from are named ``plasma...``. A process maps a store file once,
when it first gets an object from it, so the ranges are read again only on request,
and at most once per ``REFRESH_S``. Elsewhere than on Linux no address is found.
"""

from __future__ import annotations

import bisect
import threading
import time

REFRESH_S = 0.1
"""The shortest time between two readings of this process's memory mappings."""

_lock = threading.Lock()
_ranges: tuple[list[int], list[int]] = ([], [])
"""The start and the end addresses of the mappings, sorted; replaced whole on each reading."""
_read_at = -REFRESH_S


def holds(address: int, reread: bool = False) -> bool:
    """Return whether ``address`` lies in a mapping of Ray's object store.

    Args:
        address: a byte address in this process.
        reread: read the mappings again first, unless that was done within ``REFRESH_S``.

    """
    global _ranges, _read_at
    if reread and time.monotonic() - _read_at >= REFRESH_S:
        with _lock:
            _read_at = time.monotonic()
            _ranges = _plasma_ranges()
    starts, ends = _ranges
    i = bisect.bisect_right(starts, address) - 1
    return i >= 0 and address < ends[i]


def read_since(moment: float) -> bool:
    """Return whether the mappings were last read at or after ``moment`` (``time.monotonic``)."""
    return _read_at >= moment


def _plasma_ranges() -> tuple[list[int], list[int]]:
    """Return the sorted start and end addresses of this process's object store mappings."""
    ranges = []
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and "/plasma" in fields[5]:
                    low, high = fields[0].split("-")
                    ranges.append((int(low, 16), int(high, 16)))
    except OSError:
        return [], []
    ranges.sort()
    return [low for low, _ in ranges], [high for _, high in ranges]
