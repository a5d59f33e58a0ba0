"""Object storage: the one place an fsspec filesystem is made (toolkit/storage/object_store.py)."""
