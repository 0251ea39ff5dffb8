"""Recognise numpy arrays, torch tensors and cupy arrays; the only package that knows them.

``kinds`` tells them apart and describes them, ``memory`` says where their elements
lie, ``cpu`` wraps CPU buffers for the CPU backend and ``cuda`` GPU buffers for NCCL.
"""

from collective.tensor.cpu import CpuBuffer, plain_flat, torch_view
from collective.tensor.cuda import (
    NCCL_DTYPES,
    CudaBuffer,
    cuda_buffer,
    current_stream,
    record_stream,
    synchronize_device,
)
from collective.tensor.kinds import (
    DTYPES,
    TensorSpec,
    array_bytes,
    byte_array,
    chunks,
    copy_of,
    dtype_name,
    int64_array,
    is_buffer,
    is_contiguous,
    plain_dtype,
    spec,
    split_rows,
)
from collective.tensor.memory import (
    GRAD_LEAF,
    OVERLAPPING,
    PARTIAL,
    READ_ONLY,
    SAME,
    aliasing,
    memory_span,
    overlap_message,
    overlaps,
    self_overlapping,
    spans_overlap,
    write_hazards,
)

__all__ = [
    "DTYPES",
    "GRAD_LEAF",
    "NCCL_DTYPES",
    "OVERLAPPING",
    "PARTIAL",
    "READ_ONLY",
    "SAME",
    "CpuBuffer",
    "CudaBuffer",
    "TensorSpec",
    "aliasing",
    "array_bytes",
    "byte_array",
    "chunks",
    "copy_of",
    "cuda_buffer",
    "current_stream",
    "dtype_name",
    "int64_array",
    "is_buffer",
    "is_contiguous",
    "memory_span",
    "overlap_message",
    "overlaps",
    "plain_dtype",
    "plain_flat",
    "record_stream",
    "self_overlapping",
    "spans_overlap",
    "spec",
    "split_rows",
    "synchronize_device",
    "torch_view",
    "write_hazards",
]
