"""Unit tests of collective.frameworks: specs, memory spans and overlap, CPU buffer staging."""

from __future__ import annotations

import mmap
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from collective.frameworks import memory as tensor_memory
from collective.frameworks import objectstore
from collective.frameworks.cpu_buffers import CpuBuffer, plain_flat
from collective.frameworks.kinds import DTYPES, TensorSpec, copy_of, plain_dtype, spec
from collective.frameworks.memory import (
    GRAD_LEAF,
    OVERLAPPING,
    PARTIAL,
    READ_ONLY,
    SAME,
    aliasing,
    memory_span,
    overlaps,
    write_hazards,
)
from collective.types import ArgumentTypeError


def address(x: np.ndarray) -> int:
    return x.__array_interface__["data"][0]


# --- spec -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", sorted(DTYPES - {"bfloat16"}))
def test_spec_of_numpy_arrays(dtype: str) -> None:
    got = spec(np.zeros((2, 3, 4), dtype=dtype), "x")
    assert got == TensorSpec("numpy", (2, 3, 4), dtype, "cpu")
    assert got.describe() == f"{dtype}[2, 3, 4] on cpu"


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_spec_of_torch_tensors(dtype: str) -> None:
    got = spec(torch.zeros(5, 2, dtype=getattr(torch, dtype)), "x")
    assert got == TensorSpec("torch", (5, 2), dtype, "cpu")
    assert all(type(d) is int for d in got.shape)


def test_spec_of_views_and_scalars() -> None:
    assert spec(np.zeros((4, 6), np.float32)[:, ::2], "x").shape == (4, 3)
    assert spec(torch.zeros(3, 5).t(), "x").shape == (5, 3)
    assert spec(np.zeros(()), "x") == TensorSpec("numpy", (), "float64", "cpu")
    assert spec(torch.tensor(2.0), "x") == TensorSpec("torch", (), "float32", "cpu")
    assert spec(np.zeros((0, 3), np.int8), "x").shape == (0, 3)


@pytest.mark.parametrize(
    "value, type_name",
    [([1.0, 2.0], "builtins.list"), (1.5, "builtins.float"), ((1,), "builtins.tuple")],
)
def test_spec_rejects_non_buffers_naming_the_argument(value: object, type_name: str) -> None:
    with pytest.raises(TypeError, match=r"^my_tensor must be a numpy\.ndarray") as info:
        spec(value, "my_tensor")
    assert type_name in str(info.value)


@pytest.mark.parametrize(
    "value",
    [
        np.zeros(3, np.complex64),
        torch.zeros(3, dtype=torch.complex64),
        np.zeros(3, np.int16),
        torch.zeros(3, dtype=torch.float8_e4m3fn),
        np.array(["a", "b"]),
    ],
    ids=["numpy-complex64", "torch-complex64", "numpy-int16", "torch-float8", "numpy-str"],
)
def test_spec_rejects_unsupported_dtypes(value: object) -> None:
    with pytest.raises(TypeError, match=r"^recv_buf has unsupported dtype \w+; supported: "):
        spec(value, "recv_buf")


def test_spec_rejects_big_endian_arrays() -> None:
    big = np.zeros(3, dtype=">f4")
    with pytest.raises(TypeError, match=r"^arr must have native byte order, got >f4"):
        spec(big, "arr")
    native = big.astype("=f4")
    assert spec(native, "arr").dtype == "float32"
    assert spec(np.zeros(3, "|u1"), "arr").dtype == "uint8"  # one byte has no byte order


def test_float16_is_supported() -> None:
    assert spec(np.zeros(2, np.float16), "x").dtype == "float16"
    assert spec(torch.zeros(2, dtype=torch.float16), "x").dtype == "float16"


# --- memory_span and overlaps ---------------------------------------------------------------


def test_memory_span_of_contiguous_buffers() -> None:
    a = np.zeros((3, 4), np.float64)
    assert memory_span(a) == (address(a), address(a) + a.nbytes)
    t = torch.zeros(3, 4, dtype=torch.int16)
    assert memory_span(t) == (t.data_ptr(), t.data_ptr() + 24)
    assert memory_span(t[1:]) == (t.data_ptr() + 8, t.data_ptr() + 24)


def test_memory_span_of_strided_views() -> None:
    a = np.zeros((3, 4), np.float32)
    # a[:, ::2] touches elements 0 .. 2 * 4 + 2 = 10, so 11 elements from the start.
    assert memory_span(a[:, ::2]) == (address(a), address(a) + 11 * 4)
    assert memory_span(a.T) == memory_span(a)
    t = torch.zeros(3, 4, dtype=torch.float64)
    assert memory_span(t.t()) == memory_span(t)
    assert memory_span(t[:, 1]) == (t.data_ptr() + 8, t.data_ptr() + 8 + (2 * 4 + 1) * 8)


def test_memory_span_of_negative_strides() -> None:
    a = np.arange(10, dtype=np.int32)
    assert memory_span(a[::-1]) == memory_span(a)
    assert memory_span(a[8:2:-2]) == (address(a) + 4 * 4, address(a) + 9 * 4)
    grid = np.zeros((4, 5), np.float64)
    assert memory_span(grid[::-1, ::-1]) == memory_span(grid)


def test_memory_span_of_zero_size_buffers_is_empty() -> None:
    a = np.zeros((0, 5), np.float32)
    start, end = memory_span(a)
    assert start == end
    t = torch.zeros(4, 0)
    assert memory_span(t)[0] == memory_span(t)[1]


def test_overlaps_same_and_disjoint() -> None:
    a = np.arange(10.0)
    assert overlaps(a, a)
    assert not overlaps(a[:5], a[5:])
    assert not overlaps(a[5:], a[:5])
    assert overlaps(a[:6], a[4:])
    assert overlaps(a[2:3], a)
    assert not overlaps(a, np.arange(10.0))
    t = torch.arange(10.0)
    assert overlaps(t, t.view(2, 5))
    assert not overlaps(t[:5], t[5:])
    assert overlaps(t[:6], t[5:])


def test_overlaps_with_negative_strides() -> None:
    a = np.arange(10.0)
    assert overlaps(a[::-1], a)
    assert overlaps(a[4::-1], a[4:])  # both hold element 4
    assert not overlaps(a[4::-1], a[5:])
    assert not overlaps(a[:5][::-1], a[5:][::-1])


def test_overlaps_is_conservative_for_interleaved_views() -> None:
    # The spans of the even and odd columns intersect, though no element is shared.
    t = torch.zeros(3, 4)
    assert overlaps(t[:, ::2], t[:, 1::2])


def test_zero_size_buffers_never_overlap() -> None:
    a = np.arange(10.0)
    empty = a[3:3]
    assert not overlaps(empty, a)
    assert not overlaps(a, empty)
    assert not overlaps(empty, empty)
    t = torch.zeros(4)
    assert not overlaps(t[2:2], t)


def test_overlaps_with_strides_that_are_no_multiple_of_the_item_size() -> None:
    records = np.zeros(4, dtype=[("a", "<i4"), ("b", "i1")])  # itemsize 5
    field = records["a"]  # int32 with a 5-byte stride: last element in bytes 15..18
    assert field.strides == (5,)
    tail = np.ndarray(buffer=records, dtype=np.int32, offset=16, shape=(1,))  # bytes 16..19
    assert memory_span(field)[1] - address(field) == 19
    assert overlaps(field, tail)


# --- CpuBuffer ------------------------------------------------------------------------------


@pytest.mark.parametrize("writable", [True, False])
def test_contiguous_numpy_array_is_shared(writable: bool) -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    buf = CpuBuffer(a, "x", writable)
    assert isinstance(buf, CpuBuffer)
    assert buf.tensor.data_ptr() == address(a)
    assert buf.tensor.is_contiguous() and buf.tensor.dtype == torch.float32
    buf.tensor.fill_(7.0)
    assert a.tolist() == [[7.0] * 3] * 2
    a[0, 0] = 1.0  # commit is a no-op: it does not copy anything back over this
    buf.commit()
    assert a[0, 0] == 1.0 and buf.tensor[0, 0] == 1.0


@pytest.mark.parametrize("writable", [True, False])
def test_contiguous_torch_tensor_is_used_as_is(writable: bool) -> None:
    t = torch.arange(6, dtype=torch.int64)
    buf = CpuBuffer(t, "x", writable)
    assert buf.tensor is t
    buf.commit()
    assert t.tolist() == list(range(6))


@pytest.mark.parametrize("dtype", sorted(DTYPES - {"bfloat16"}))
def test_numpy_dtypes_map_to_torch(dtype: str) -> None:
    buf = CpuBuffer(np.ones(3, dtype=dtype), "x", writable=True)
    assert str(buf.tensor.dtype) == f"torch.{dtype}"


def test_strided_numpy_view_is_staged_and_committed() -> None:
    base = np.arange(12, dtype=np.int64).reshape(3, 4)
    view = base[:, ::2]
    buf = CpuBuffer(view, "x", writable=True)
    assert buf.tensor.is_contiguous()
    assert buf.tensor.tolist() == view.tolist()
    buf.tensor.mul_(-1)
    assert base[0, 2] == 2, "the staged copy must not write through before commit"
    buf.commit()
    expected = np.arange(12).reshape(3, 4)
    expected[:, ::2] *= -1
    assert base.tolist() == expected.tolist()


def test_reversed_and_fortran_numpy_arrays_are_staged() -> None:
    a = np.arange(5.0)
    view = a[::-1]
    buf = CpuBuffer(view, "x", writable=True)
    assert buf.tensor.tolist() == [4.0, 3.0, 2.0, 1.0, 0.0]
    buf.tensor.add_(10)
    buf.commit()
    assert a.tolist() == [10.0, 11.0, 12.0, 13.0, 14.0]

    f = np.asfortranarray(np.arange(6.0).reshape(2, 3))
    buf = CpuBuffer(f, "x", writable=True)
    assert buf.tensor.data_ptr() != address(f)
    assert buf.tensor.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    buf.tensor.fill_(1.0)
    buf.commit()
    assert f.tolist() == [[1.0] * 3] * 2


def test_transposed_torch_tensor_is_staged_and_committed() -> None:
    base = torch.arange(6.0).reshape(2, 3)
    view = base.t()
    buf = CpuBuffer(view, "x", writable=True)
    assert buf.tensor.is_contiguous()
    assert buf.tensor.data_ptr() != base.data_ptr()
    buf.tensor.fill_(-1.0)
    assert base[0, 0] == 0.0
    buf.commit()
    assert base.tolist() == [[-1.0] * 3] * 2


def test_read_only_staging_never_writes_back() -> None:
    base = np.arange(8.0)
    buf = CpuBuffer(base[::2], "x", writable=False)
    buf.tensor.fill_(99.0)
    buf.commit()
    assert base.tolist() == list(np.arange(8.0))

    t = torch.arange(6.0).reshape(2, 3)
    buf = CpuBuffer(t.t(), "x", writable=False)
    buf.tensor.fill_(99.0)
    buf.commit()
    assert t.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_read_only_numpy_array_is_written_in_place_as_ray_does() -> None:
    a = np.arange(4.0)
    a.flags.writeable = False
    buf = CpuBuffer(a, "out", writable=True)
    assert buf.tensor.data_ptr() == address(a)  # no copy; the public functions decide
    buf.tensor.fill_(5.0)
    buf.commit()
    assert a.tolist() == [5.0] * 4 and not a.flags.writeable
    buf = CpuBuffer(a, "inp", writable=False)
    assert buf.tensor.data_ptr() == address(a)  # inputs are shared too, without a copy


def test_read_only_strided_numpy_array_is_committed_through_a_writable_view() -> None:
    base = np.zeros((3, 4))
    base.flags.writeable = False
    view = base[:, ::2]
    buf = CpuBuffer(view, "out", writable=True)
    assert buf.tensor.data_ptr() != address(view)
    buf.tensor.fill_(2.0)
    buf.commit()
    assert base[:, ::2].tolist() == [[2.0] * 2] * 3 and base[:, 1::2].sum() == 0.0


def test_self_overlapping_outputs_raise() -> None:
    expanded = torch.ones(1).expand(4)
    with pytest.raises(ValueError, match=r"^out has overlapping memory"):
        CpuBuffer(expanded, "out", writable=True)
    with pytest.raises(ValueError, match=r"overlapping memory"):
        CpuBuffer(torch.zeros(3, 1).expand(3, 2), "out", writable=True)
    broadcast = np.broadcast_to(np.arange(3.0), (2, 3))
    with pytest.raises(ValueError, match=r"overlapping memory"):
        CpuBuffer(broadcast, "out", writable=True)
    assert CpuBuffer(torch.ones(1).expand(1), "out", writable=True).tensor.tolist() == [1.0]


def test_self_overlapping_inputs_are_copied() -> None:
    buf = CpuBuffer(torch.full((1,), 3.0).expand(4), "inp", writable=False)
    assert buf.tensor.tolist() == [3.0] * 4 and buf.tensor.stride() == (1,)
    buf = CpuBuffer(np.broadcast_to(np.arange(3.0), (2, 3)), "inp", writable=False)
    assert buf.tensor.tolist() == [[0.0, 1.0, 2.0]] * 2 and buf.tensor.is_contiguous()


def test_outputs_overlapping_through_positive_strides_raise() -> None:
    windows = torch.arange(6.0).as_strided((3, 3), (1, 1))  # rows [0,1,2], [1,2,3], [2,3,4]
    with pytest.raises(ValueError, match="overlapping memory"):
        CpuBuffer(windows, "out", writable=True)


# --- read-only, grad and aliasing helpers ----------------------------------------------------


def test_write_hazards() -> None:
    frozen = np.ones(3)
    frozen.flags.writeable = False
    assert write_hazards(frozen) == READ_ONLY
    assert write_hazards(np.ones(3)) == 0 and write_hazards(torch.ones(3)) == 0
    assert write_hazards(np.broadcast_to(np.arange(3.0), (2, 3))) == READ_ONLY | OVERLAPPING
    assert write_hazards(torch.ones(1).expand(4)) == OVERLAPPING
    leaf = torch.ones(3, requires_grad=True)
    assert write_hazards(leaf) == GRAD_LEAF
    strided = torch.zeros(3, 4).t().requires_grad_()
    assert write_hazards(strided) == GRAD_LEAF and not strided.is_contiguous()
    assert write_hazards(leaf * 2) == 0 and write_hazards(leaf.detach()) == 0
    # torch keeps no read-only flag: a tensor over a frozen array outside Ray's object store
    # cannot be told apart from any other tensor over foreign memory
    with pytest.warns(UserWarning, match="not writable"):
        assert write_hazards(torch.from_numpy(frozen)) == 0


def test_aliasing_and_copy_of() -> None:
    chunks = [np.ones(3), np.ones(3)]
    assert aliasing(chunks[1], chunks) == [0, SAME]
    flat = np.zeros(6)
    assert aliasing(flat[3:], [flat[:3], flat[3:], flat[2:5]]) == [0, SAME, PARTIAL]
    assert aliasing(flat[::2], [flat[:3], flat[1::2]]) == [PARTIAL, PARTIAL]
    t = torch.arange(4.0)
    assert aliasing(t, [t.view(4), t.view(2, 2), torch.zeros(4)]) == [SAME, PARTIAL, 0]
    copied = copy_of(t)
    assert copied.tolist() == t.tolist() and copied.data_ptr() != t.data_ptr()
    assert copy_of(chunks[0]).tolist() == [1.0] * 3 and copy_of(chunks[0]) is not chunks[0]


def test_spec_errors_are_runtime_errors_too() -> None:
    with pytest.raises(RuntimeError) as info:
        spec([1.0, 2.0], "x")
    assert isinstance(info.value, TypeError) and isinstance(info.value, ArgumentTypeError)


@pytest.fixture
def plasma(tmp_path: Any) -> Iterator[mmap.mmap]:
    """Map a file under Ray's object store name: it stands in for the store itself."""
    path = tmp_path / "plasmaTEST"
    path.write_bytes(bytes(4096))
    with path.open("r+b") as file:
        mapped = mmap.mmap(file.fileno(), 4096)
    yield mapped
    mapped.close()


def test_torch_tensor_over_a_plasma_mapping_is_read_only(plasma: mmap.mmap) -> None:
    array = np.frombuffer(plasma, dtype=np.float32)
    inside = torch.from_numpy(array)
    time.sleep(objectstore.REFRESH_S)  # the mappings are read again at most this often
    assert objectstore.holds(inside.data_ptr(), reread=True)
    assert write_hazards(inside[8:]) == READ_ONLY
    assert write_hazards(torch.from_numpy(np.ones(4, np.float32))) == 0
    assert write_hazards(torch.ones(4)) == 0
    del array, inside


def test_plain_flat_views_plain_buffers_and_declines_the_rest() -> None:
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    flat = plain_flat(array)
    assert flat is not None and flat.shape == (6,)
    flat[0] = 9
    assert array[0, 0] == 9
    tensor = torch.arange(4, dtype=torch.int64)
    view = plain_flat(tensor)
    assert view is not None
    view[1] = 7
    assert tensor[1].item() == 7
    frozen = np.ones(3)
    frozen.setflags(write=False)
    for declined in (frozen, array.T, torch.ones(2, dtype=torch.bfloat16), [1.0]):
        assert plain_flat(declined) is None
    assert plain_dtype(np.dtype("float16")) == "float16"
    assert plain_dtype(np.dtype(">f4")) is None
    assert plain_dtype(np.dtype("complex64")) is None


def test_a_torch_storage_keeps_its_object_store_verdict(plasma: mmap.mmap) -> None:
    inside = torch.from_numpy(np.frombuffer(plasma, dtype=np.float32))
    outside = torch.from_numpy(np.ones(4, np.float32))
    time.sleep(objectstore.REFRESH_S)
    assert plain_flat(inside) is None
    assert plain_flat(inside[4:]) is None
    for _ in range(2):  # the first sight may come before the next reading
        assert plain_flat(outside) is not None
        time.sleep(objectstore.REFRESH_S)
    assert tensor_memory._verdicts.get(outside.untyped_storage()) is False
    assert plain_flat(inside) is None
    del inside


TINY_STRIDED = {
    "empty slice past the end": lambda: torch.zeros(4)[4::2],
    "one column of one row": lambda: torch.ones(1, 4)[:, 0],
    "empty torch from numpy": lambda: torch.from_numpy(np.zeros(0)),
    "one element of a 2-d block": lambda: torch.arange(12.0).reshape(3, 4)[1:2, 2:3],
    "empty numpy": lambda: np.zeros(0),
    "one numpy column": lambda: np.arange(8.0).reshape(2, 4)[1:, 1:2],
}


@pytest.mark.parametrize("make", TINY_STRIDED.values(), ids=TINY_STRIDED.keys())
def test_tiny_buffers_with_any_stride_are_written_in_place(make: Any) -> None:
    x = make()
    buf = CpuBuffer(x, "x", True)
    nbytes = x.nbytes if isinstance(x, np.ndarray) else x.numel() * x.element_size()
    assert buf.bytes.size == nbytes
    buf.bytes[:] = np.arange(buf.bytes.size, dtype=np.uint8)
    buf.tensor.reshape(-1).view(torch.uint8)  # gloo's and the exchanges' byte view
    buf.commit()
    raw = x.reshape(-1).tobytes() if isinstance(x, np.ndarray) else x.numpy().tobytes()
    assert raw == bytes(range(buf.bytes.size))
