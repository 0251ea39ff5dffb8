"""Many tensors in one call: state dicts and lists of tensors, broadcast or reduced."""

from collective.bulk.api import allreduce_tensors, broadcast_state_dict, broadcast_tensors

__all__ = ["allreduce_tensors", "broadcast_state_dict", "broadcast_tensors"]
