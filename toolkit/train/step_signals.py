"""What the ranks tell each other each step, without making the host wait for the GPU.

Reading a loss on the host (`.item()`) waits for every kernel queued before it, and a collective on
it waits for the slowest rank: done each step, it keeps the host from queueing the next step while
the GPU is still busy with this one. So:

- each step's loss (and DPO reward accuracy) stays on the device in a `LossWindow`; every
  `tracking.log_every_steps` steps one collective reduces all of them and one read brings them to the
  host, where the NaN check runs. A checkpoint, a stop and the last step read the window first, so
  no checkpoint is ever written after a NaN the check has not seen;
- the decisions every rank must take at the same step (stop now, the save clock is due) travel each
  step in `agree`, a collective of two numbers over a CPU (gloo) group that no GPU work waits on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class StepRecord:
    step: int
    time: float  # wall clock when the host finished queueing the step
    lr: float
    tokens: int  # over all ranks, since this start
    loss: float  # mean over ranks
    accuracy: float | None  # DPO: mean reward accuracy over ranks
    grad_norm: float | None = None  # the global gradient norm before clipping (the same on every rank)


class LossWindow:
    """Steps whose losses are still on the device, read in one batch."""

    def __init__(self, every: int, world: int):
        self.every, self.world = every, world
        self._pending: list[tuple[int, float, float, int, object, object | None, object | None]] = []

    def add(self, step: int, loss, accuracy, lr: float, tokens: int, grad_norm=None) -> None:
        """`loss`, `accuracy` and `grad_norm` are 0-d tensors on the rank's device, left there."""
        self._pending.append((step, time.time(), lr, tokens, loss.detach(), accuracy, grad_norm))

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def read(self, dist) -> list[StepRecord]:
        """Every pending step, reduced over the ranks: a collective every rank joins at the same step."""
        if not self._pending:
            return []
        import torch

        losses = [entry[4] for entry in self._pending]
        accuracies = [entry[5] for entry in self._pending if entry[5] is not None]
        norms = [entry[6] for entry in self._pending if entry[6] is not None]
        values = torch.stack([value.float() for value in losses + accuracies + norms]).to(torch.float64)
        dist.all_reduce(values)
        host = (values / self.world).tolist()  # the one host synchronisation
        count = len(losses)
        with_accuracy, with_norm = len(accuracies) == count, len(norms) == count
        norm_at = count + len(accuracies)
        records = [StepRecord(step, stamp, lr, tokens, host[index],
                              host[count + index] if with_accuracy else None,
                              host[norm_at + index] if with_norm else None)
                   for index, (step, stamp, lr, tokens, *_) in enumerate(self._pending)]
        self._pending.clear()
        return records


class Agreement:
    """Per-step flags every rank must act on at the same step, summed over the ranks on the CPU."""

    def __init__(self, dist, backend: str):
        self._dist = dist
        # Under NCCL a collective needs GPU tensors, and reading one back waits for the GPU; a gloo
        # group of the same ranks carries two floats in microseconds and waits for nothing queued.
        self._group = dist.new_group(backend="gloo") if backend != "gloo" else None

    def agree(self, stop_requested: bool, save_clock_due: bool) -> tuple[bool, bool]:
        import torch

        flags = torch.tensor([float(stop_requested), float(save_clock_due)], dtype=torch.float64)
        self._dist.all_reduce(flags, group=self._group)
        stop, save = flags.tolist()
        return stop > 0, save > 0
