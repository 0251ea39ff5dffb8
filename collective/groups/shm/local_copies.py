"""LocalCopies: the collectives of a rank alone on its node, as local copies without an arena.

A group that spans nodes gives a node of one rank these ops in place of
``algorithms.Collectives``, so the hierarchical route runs the same code on every node.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from collective import signature
from collective.groups.shm.failures import unpaired
from collective.groups.shm.kernels import Reducer


class LocalCopies:
    """The same ops for a node where this rank is alone: local copies, no arena."""

    size = 1
    rank = 0

    def barrier(self, deadline: float) -> None:
        """Return at once."""

    def agree(
        self, kind: str, dtype: str, reduce_op: int, root: int, nbytes: int, deadline: float
    ) -> None:
        """Return at once: no other rank of this node can disagree."""

    def broadcast(self, data: np.ndarray, root: int, dtype: str, deadline: float) -> None:
        """Leave ``data`` as it is: this rank is the root."""

    def reduce(
        self, data: np.ndarray, root: int, reducer: Reducer, dtype: str, deadline: float
    ) -> None:
        """Finish the reduction of ``data`` alone (AVG divides by the world size)."""
        reducer.finish(data)

    def allreduce(self, data: np.ndarray, reducer: Reducer, dtype: str, deadline: float) -> None:
        """Finish the reduction of ``data`` alone (AVG divides by the world size)."""
        reducer.finish(data)

    def broadcast_list(self, datas: Sequence[np.ndarray], root: int, deadline: float) -> None:
        """Leave ``datas`` as they are: this rank is the root."""

    def relay(
        self, data: np.ndarray, source: int, target: int, dtype: str, deadline: float
    ) -> None:
        """Leave ``data`` as it is: this rank is both ends."""

    def allgather(
        self, piece: np.ndarray, outputs: list[np.ndarray], dtype: str, deadline: float
    ) -> None:
        """Copy ``piece`` into ``outputs[0]``."""
        outputs[0][:] = piece

    def gather(
        self, piece: np.ndarray, outputs: list[np.ndarray], root: int, dtype: str, deadline: float
    ) -> None:
        """Copy ``piece`` into ``outputs[0]``."""
        outputs[0][:] = piece

    def scatter(
        self, inputs: list[np.ndarray], output: np.ndarray, root: int, dtype: str, deadline: float
    ) -> None:
        """Copy ``inputs[0]`` into ``output``."""
        output[:] = inputs[0]

    def reducescatter(
        self,
        inputs: list[np.ndarray],
        output: np.ndarray,
        reducer: Reducer,
        dtype: str,
        deadline: float,
    ) -> None:
        """Copy ``inputs[0]`` into ``output`` and finish the reduction there."""
        output[:] = inputs[0]
        reducer.finish(output)

    def alltoall(
        self, inputs: list[np.ndarray], outputs: list[np.ndarray], dtype: str, deadline: float
    ) -> None:
        """Copy ``inputs[0]`` into ``outputs[0]``, checking that their sizes pair up."""
        if inputs[0].size != outputs[0].size:
            table = np.array([[inputs[0].size]]), np.array([[outputs[0].size]])
            raise unpaired(*table, signature.itemsize(dtype), [0])
        outputs[0][:] = inputs[0]
