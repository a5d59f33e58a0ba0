"""What runs on each node of the allocation: ft's per-node launcher (`python -m toolkit.launch`)."""
