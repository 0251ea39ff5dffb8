"""Many tensors in one call: state dicts and lists of tensors, broadcast or reduced."""
