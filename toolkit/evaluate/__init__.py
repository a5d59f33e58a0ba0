"""After training: the task metrics and the gates an adapter must pass against its base model (the
measuring itself runs in the allocation: toolkit/train/evaluation.py)."""
