"""The shared-memory transport of CPU groups: an arena per node, its waits, its algorithms."""
