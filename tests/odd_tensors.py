"""Odd tensors for the ops and the Ray Direct Transports: those refused, those carried whole.

``refused(kind)`` makes a tensor that holds more than its shape, its dtype and its
elements' bytes; ``REFUSED[kind]`` is what the refusal says about it. ``carried()``
makes views of other kinds (conjugate, negative, expanded, transposed, requiring
grad), small and past ``wire.DIRECT_BYTES``, and tensors of subclasses, which Ray
pickles around the plain tensors inside; ``stripped(got)`` lists every property in
which what a consumer got differs from what it should get. ``wrapped(kind)`` makes a
tensor of a subclass that defines ``__torch_dispatch__`` (a ``DTensor`` among them),
whose memory does not hold its values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

REFUSED = {
    "quantized per tensor": r"it is quantized \(torch.qint8, torch.per_tensor_affine\)",
    "quantized per channel": r"it is quantized \(torch.quint8, torch.per_channel_affine\)",
    "sparse coo": "its layout is torch.sparse_coo",
    "sparse csr": "its layout is torch.sparse_csr",
    "mkldnn": "its layout is torch._mkldnn",
    "nested": "it is a nested tensor",
    "meta": "it is on the meta device",
}
"""What Ray hands a transport (plain ``torch.Tensor`` objects) that it refuses, and why."""


class Marked(torch.Tensor):
    """A subclass of ``torch.Tensor`` with storage of its own, as user code makes."""


def subclasses() -> dict[str, Any]:
    """Return tensors of subclasses: Ray pickles them around the plain tensors inside.

    A transport that is handed one itself refuses it (a Parameter excepted): its own
    state would be lost.
    """
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3) / 7
    return {"subclass": x.as_subclass(Marked), "parameter": torch.nn.Parameter(x * 3)}


def refused(kind: str) -> Any:
    """Return a tensor of ``kind`` (a key of ``REFUSED``)."""
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3) / 7
    if kind == "quantized per tensor":
        return torch.quantize_per_tensor(x, 0.1, 3, torch.qint8)
    if kind == "quantized per channel":
        scales, points = torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0, 1, 2, 3])
        return torch.quantize_per_channel(x, scales, points, 0, torch.quint8)
    if kind == "sparse coo":
        return x.to_sparse()
    if kind == "sparse csr":
        return x.to_sparse_csr()
    if kind == "mkldnn":
        return x.to_mkldnn()
    if kind == "nested":
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    return torch.empty(4, 3, device="meta")


WRAPPED = {
    "dtensor": r"its class is DTensor, .*; pass t\.to_local\(\) for this rank's shard, or "
    r"t\.full_tensor\(\)",
    "fake tensor": "its class is FakeTensor, a subclass of torch.Tensor that defines "
    "__torch_dispatch__",
    "functional tensor": "its class is FunctionalTensor, a subclass of torch.Tensor that "
    "defines __torch_dispatch__",
    "jagged nested": "it is a nested tensor",
}
"""Tensors of subclasses that define ``__torch_dispatch__`` (``wrapped(kind)``), whose
memory does not hold their values, and what their refusal says about them."""


@contextlib.contextmanager
def fake_world() -> Iterator[None]:
    """Hold a default process group of two ranks that moves nothing, for ``wrapped("dtensor")``."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def wrapped(kind: str) -> Any:
    """Return a tensor of ``kind`` (a key of ``WRAPPED``) of 12 float32 elements per rank.

    A DTensor needs ``fake_world``: it is rank 0's shard of 4 x 3 of a tensor of 8 x 3.
    """
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3) / 7
    if kind == "dtensor":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = DeviceMesh("cpu", [0, 1])
        return DTensor.from_local(x, mesh, [Shard(0)], run_check=False)
    if kind == "fake tensor":
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            return torch.empty(4, 3)
    if kind == "functional tensor":
        from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

        with FunctionalTensorMode():
            return FunctionalTensor.to_functional(x)
    return torch.nested.nested_tensor([x[0], x[1, :2]], layout=torch.jagged)


BIG = 1 << 18
"""Elements of a float32 tensor of 1 MiB: from ``wire.DIRECT_BYTES`` on, one moves alone."""


def carried() -> dict[str, Any]:
    """Return views of every odd kind that arrive whole, small and big, and ``subclasses()``."""
    g = torch.Generator().manual_seed(49)
    out: dict[str, Any] = subclasses()
    for size, tag in ((6, "small"), (BIG, "big")):
        z = torch.randn(size, dtype=torch.complex64, generator=g)
        out[f"conj {tag}"] = z.conj()
        out[f"imag of conj {tag}"] = z.conj().imag  # a negative view, strided
        out[f"negative view {tag}"] = torch._neg_view(torch.randn(size, generator=g))
        out[f"expanded {tag}"] = torch.randn(size // 2, 1, generator=g).expand(size // 2, 2)
        out[f"transposed {tag}"] = torch.randn(2, size // 2, generator=g).t()
        out[f"requires grad {tag}"] = (torch.randn(size, generator=g) * 2).requires_grad_()
    return out


def _values(t: Any) -> Any:
    """Return ``t``'s values as a plain tensor, resolved."""
    return t.detach().resolve_conj().resolve_neg().as_subclass(torch.Tensor)


def stripped(got: dict[str, Any]) -> list[str]:
    """Return ``kind: property`` for every property of ``got`` unlike what ``carried()`` sent.

    Each arrives with its class (a plain ``torch.Tensor`` for every view), its dtype,
    shape and layout, its values, resolved; contiguous when plain; requiring grad only
    when it is a ``Parameter`` that did.
    """
    sent_all = carried()
    bad = [] if sorted(got) == sorted(sent_all) else ["keys"]
    for kind, sent in sent_all.items():
        t, plain = got[kind], type(sent) is torch.Tensor
        checks = {
            "class": type(t) is type(sent),
            "dtype": t.dtype == sent.dtype,
            "shape": t.shape == sent.shape,
            "layout": t.layout == sent.layout,
            "conj": not t.is_conj(),
            "neg": not t.is_neg(),
            "grad": t.requires_grad == (sent.requires_grad and not plain),
            "contiguous": not plain or t.is_contiguous(),
            "values": t.shape == sent.shape and torch.equal(_values(t), _values(sent)),
        }
        bad += [f"{kind}: {name}" for name, ok in checks.items() if not ok]
    return bad


def _rdt_store() -> Any:
    """Return Ray's store of this process's RDT objects."""
    import ray

    return ray._private.worker.global_worker.rdt_manager.rdt_store


def rdt_holds(obj_id: str) -> bool:
    """Return whether Ray's store of this process's RDT objects holds object ``obj_id``."""
    return bool(_rdt_store().has_object(obj_id))


def rdt_holds_tensor(tensor: Any) -> bool:
    """Return whether an object in Ray's store of this process's RDT objects holds ``tensor``."""
    return bool(_rdt_store().has_tensor(tensor))
