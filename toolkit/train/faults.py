"""Faults injected on purpose, for tests of paths a CPU cannot reach for real (set in the recipe's
env; the schema lets FT_FAULT_* through):

  FT_FAULT_OOM_AT_STEP=N   rank 0 runs out of memory at step N (first attempt only)
  FT_FAULT_NAN_AT_STEP=N   the step's loss reads as NaN at step N
  FT_FAULT_SLOW_CHECKPOINT_S=S   each checkpoint file takes S s more to write, and to upload: a slow
                           filesystem and object store, so that a kill lands in the middle of both
  FT_FAULT_SLOW_STEP_S=S   each micro step takes S s more (a slower GPU): a test has time between two
                           faults; the weights are those of a run without it
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Faults:
    oom_at_step: int = 0
    nan_at_step: int = 0
    out_of_memory_retry: bool = False  # the job script's one retry: FT_OOM_RETRY=1
    slow_checkpoint_s: float = 0.0
    slow_step_s: float = 0.0

    @classmethod
    def from_env(cls) -> Faults:
        return cls(int(os.environ.get("FT_FAULT_OOM_AT_STEP", "0")), int(os.environ.get("FT_FAULT_NAN_AT_STEP", "0")),
                   os.environ.get("FT_OOM_RETRY") == "1", float(os.environ.get("FT_FAULT_SLOW_CHECKPOINT_S", "0")),
                   float(os.environ.get("FT_FAULT_SLOW_STEP_S", "0")))

    def checkpoint_file(self) -> None:
        """Before each checkpoint file is written or uploaded."""
        if self.slow_checkpoint_s:
            import time

            time.sleep(self.slow_checkpoint_s)

    def before_micro_step(self, step: int, rank: int) -> None:
        if self.slow_step_s:
            import time

            time.sleep(self.slow_step_s)
        if rank == 0 and step == self.oom_at_step and not self.out_of_memory_retry:
            import torch

            raise torch.OutOfMemoryError(f"injected by FT_FAULT_OOM_AT_STEP={self.oom_at_step}")

    def loss_read(self, step: int, loss: float) -> float:
        return float("nan") if step == self.nan_at_step else loss
