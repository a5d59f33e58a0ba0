"""Checkpoints in tiers: the run's folder on the shared filesystem (Lustre in production) and an
object store mirror (S3). Each tier holds whole checkpoints only, each with its manifest; a resume
takes the newest copy that verifies, from whichever tier has it. No torch here: `ft status` reads
the tiers' state, and the ranks' side (a snapshot in host memory, written in the background through
DeepSpeed's checkpoint engine) is toolkit/train/snapshot.py and toolkit/train/checkpoint.py.

    manifest.py   what makes a checkpoint whole: files, sizes, sha256, step, lineage
    shared.py     the shared filesystem's tier: staged, published by rename, keep-last-K
    remote.py     the object store's tier: uploaded files first and the manifest last
    mirror.py     rank 0's uploader: retries with backoff, catches up, reports its lag
    status.py     what `ft status` shows of the tiers (checkpoints.json in the run directory)
"""
