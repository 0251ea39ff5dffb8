"""What both Ray Direct Transports refuse when they are handed it, without Ray.

Ray hands a transport the plain ``torch.Tensor`` objects of a value and pickles
subclasses around the plain tensors inside (``test_rdt_ray.py`` and
``test_rdt_shm_ray.py`` check what arrives, through Ray); a transport handed a
subclass itself, or a tensor that holds more than its bytes, refuses it before it
writes anything.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import pytest
import torch

from collective.ray_plugins.shm_transport import ShmTransport
from collective.ray_plugins.transport import CollectiveTransport
from tests import odd_tensors


def _transports() -> list[tuple[str, Any]]:
    return [("COLLECTIVE_SHM", ShmTransport()), ("COLLECTIVE", CollectiveTransport())]


def test_a_subclass_handed_to_a_transport_is_refused() -> None:
    tensor = odd_tensors.subclasses()["subclass"]
    why = "its class is Marked, a subclass of torch.Tensor whose own state would be lost"
    for transport, manager in _transports():
        with pytest.raises(TypeError, match=f"{transport!r} cannot move tensor 1 .*: {why}"):
            manager.extract_tensor_transport_metadata("x", [torch.ones(2), tensor])
    assert glob.glob(f"/dev/shm/collective-{os.getpid()}-*") == []


@pytest.mark.parametrize("kind", list(odd_tensors.REFUSED))
def test_what_holds_more_than_its_bytes_is_refused_by_both(kind: str) -> None:
    for transport, manager in _transports():
        with pytest.raises(TypeError, match=f"{transport!r} .*: {odd_tensors.REFUSED[kind]}"):
            manager.extract_tensor_transport_metadata("x", [odd_tensors.refused(kind)])
    assert glob.glob(f"/dev/shm/collective-{os.getpid()}-*") == []


@pytest.mark.parametrize("kind", list(odd_tensors.WRAPPED))
def test_a_wrapper_subclass_is_refused_for_what_its_memory_lacks(kind: str) -> None:
    with odd_tensors.fake_world():
        tensor = odd_tensors.wrapped(kind)
        for transport, manager in _transports():
            with pytest.raises(TypeError, match=f"{transport!r} .*: {odd_tensors.WRAPPED[kind]}"):
                manager.extract_tensor_transport_metadata("x", [tensor])
    assert glob.glob(f"/dev/shm/collective-{os.getpid()}-*") == []
