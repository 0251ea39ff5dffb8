"""The backend's name; imports nothing, so registering it imports no torch."""

BACKEND_NAME = "collective"
"""The backend's name, as ``torch.distributed.init_process_group`` takes it."""
