"""The step loop of one rank: batches, forward and backward through DeepSpeed, the loss window read
every few steps (toolkit/train/step_signals.py), checkpoints on the step and time cadences, and a
stop every rank takes at the same step."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from toolkit.recipe.run_spec import BatchPlan
from toolkit.recipe.schema import Recipe
from toolkit.runs import exits
from toolkit.runs.exits import RunEnds
from toolkit.train.data import batch_indices, collate, rank_slice
from toolkit.train.engine import seed_step, step_seed
from toolkit.train.faults import Faults
from toolkit.train.objectives import Objective
from toolkit.train.step_signals import Agreement, LossWindow
from toolkit.train.tracking import Tracker

if TYPE_CHECKING:
    from toolkit.train.checkpoint import Checkpointer


@dataclass
class Loop:
    engine: object
    dist: object
    rank: int
    world: int
    recipe: Recipe
    plan: BatchPlan
    units: list
    objective: Objective
    pad_id: int
    tracker: Tracker
    checkpointer: Checkpointer
    progress: object
    faults: Faults
    log: Callable[[str], None]
    stop_requested: Callable[[], bool]
    backend: str
    tokens: int = 0  # this rank's, since this start
    window: LossWindow = field(init=False)
    agreement: Agreement = field(init=False)

    def __post_init__(self) -> None:
        self.window = LossWindow(self.recipe.tracking.log_every_steps, self.world)
        self.agreement = Agreement(self.dist, self.backend)

    def run(self, start: int, steps: int) -> int:
        """Steps start+1..steps; the last step done. Raises RunEnds on a NaN, running out of memory,
        or a stop on request (after its checkpoint)."""
        self.log(f"training steps {start}..{steps} world={self.world} micro batch {self.plan.micro_batch} "
                 f"accumulation={self.plan.gradient_accumulation} backend={self.backend}")
        step = start
        for step in range(start + 1, steps + 1):
            losses, accuracies = self.step(step)
            self.progress.report("step", step)
            self.window.add(step, losses, accuracies, self.engine.get_lr()[0], self.tokens * self.world,
                            self.grad_norm())
            # The clock may differ between ranks: they agree, or one would save alone and wait forever.
            stop_now, clock_due = self.agreement.agree(self.stop_requested(), self.checkpointer.due_by_clock())
            save_now = self.checkpointer.due_by_steps(step) or clock_due or stop_now or step == steps
            if save_now or self.window.due(step) or step == start + 1:
                self.read_losses(start, steps)
            if save_now:
                self.checkpointer.save(step)
            if stop_now and step < steps:
                raise RunEnds(exits.STOPPED, f"stopping at step {step} on request (checkpoint saved); "
                                             "the job continues after requeue")
        return step

    def step(self, step: int):
        """One optimizer step: its micro batches on this rank; the mean loss (and DPO accuracy),
        left on the device."""
        import torch

        indices = batch_indices(step - 1, self.recipe.training.seed, len(self.units), self.recipe.training.global_batch)
        seed_step(step_seed(self.recipe.training.seed, step, self.rank), self.engine.device)
        losses, accuracies = [], []
        try:
            for micro in range(self.plan.gradient_accumulation):
                chosen = rank_slice(indices, self.rank, self.world, self.plan.micro_batch, micro)
                batch = collate(self.objective.micro_batch([self.units[i] for i in chosen]), self.pad_id)
                self.tokens += int(batch["attention_mask"].sum())
                batch = {key: value.to(self.engine.device) for key, value in batch.items()}  # DeepSpeed moves no inputs
                self.faults.before_micro_step(step, self.rank)
                loss, accuracy = self.objective.loss(self.engine, batch)
                self.engine.backward(loss)
                self.checkpointer.before_optimizer_step()
                self.engine.step()
                losses.append(loss.detach())
                if accuracy is not None:
                    accuracies.append(accuracy)
        except torch.OutOfMemoryError as exc:
            raise RunEnds(exits.OUT_OF_MEMORY, f"out of memory at step {step} with micro batch "
                                               f"{self.plan.micro_batch}: {exc}") from None
        return torch.stack(losses).mean(), torch.stack(accuracies).mean() if accuracies else None

    @property
    def checks_grad_norm(self) -> bool:
        """fp16's loss scaling skips a step whose gradients overflow and reports its norm as inf: that
        is its normal course, not the run's end. bf16 and fp32 skip nothing (engine.py)."""
        return self.recipe.training.precision != "fp16"

    def grad_norm(self):
        """The step's global gradient norm (before clipping) as DeepSpeed computed it, left on the
        device; None where it computes none (no clipping configured)."""
        import torch

        norm = self.engine.get_global_grad_norm()
        if norm is None:
            return None
        if torch.is_tensor(norm):
            return norm.detach().reshape(())
        return torch.tensor(float(norm), device=self.engine.device)

    def read_losses(self, start: int, steps: int) -> None:
        """The pending steps' losses: NaN check, metrics, the log line every 10 steps."""
        records = self.window.read(self.dist)
        for record in records:
            loss = self.faults.loss_read(record.step, record.loss)
            # bf16 runs without DeepSpeed's overflow check (engine.py): a gradient gone NaN or
            # infinite is caught here, before the checkpoint of that step is written.
            if not math.isfinite(loss) or (self.checks_grad_norm and record.grad_norm is not None
                                           and not math.isfinite(record.grad_norm)):
                what = f"loss is {loss}" if not math.isfinite(loss) else f"the gradient norm is {record.grad_norm}"
                self.tracker.log([r for r in records if r.step < record.step])
                raise RunEnds(exits.USER_ERROR, f"{what} at step {record.step}: stopping. Try a lower "
                                                f"learning rate (now {self.recipe.training.learning_rate}), "
                                                "gradient clipping (max_grad_norm), and `ft validate` on the data.")
            if self.rank == 0 and (record.step % 10 == 0 or record.step == start + 1):
                self.log(f"step {record.step}/{steps} loss {loss:.4f}")
        self.tracker.log(records)
