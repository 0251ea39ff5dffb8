"""What the op modules use of the process group they are methods of, as a ``Protocol``.

The ops are written as functions whose ``self`` is a ``CollectiveProcessGroup``; this
names what they call on it, so that they need not import the class that holds them.
"""

from __future__ import annotations

from typing import Any, Protocol

from collective.groups.cpu.group import CpuGroup
from collective.ops.list_calls import Builder
from collective.work import Work


class Adapter(Protocol):
    """The part of ``CollectiveProcessGroup`` the op modules call."""

    group: CpuGroup

    def size(self) -> int:
        """Return the group's size."""

    def run_list(
        self,
        build: Builder,
        op: str,
        args: tuple[Any, ...],
        extra: tuple[Any, ...],
        opts: Any,
        outputs: list[Any],
    ) -> Any:
        """Run a list op through the library's list path; return torch's ``Work``."""

    def async_work(self, work: Work | None, outputs: list[Any], lane: str = "collective") -> Any:
        """Return torch's ``Work`` of the library's ``work``."""

    def other_device(self, op: str, tensor: Any, *args: Any) -> Any:
        """Run ``op`` on a tensor of another device through torch's own dispatch."""
