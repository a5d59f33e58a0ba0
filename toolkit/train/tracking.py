"""Where a run's numbers go: metrics.jsonl in the run directory (rank 0), W&B (offline on the lab),
and the summary of a finished run."""

from __future__ import annotations

import json
import os
from pathlib import Path

from toolkit.recipe.schema import Recipe
from toolkit.runs.layout import RunLayout
from toolkit.train.step_signals import StepRecord


class Tracker:
    def __init__(self, layout: RunLayout, recipe: Recipe, rank: int):
        self.enabled = rank == 0
        self.layout = layout
        self.wandb = None
        wandb_spec = recipe.tracking.wandb
        if self.enabled and wandb_spec.mode != "disabled":
            import wandb

            run_id = os.environ.get("FT_RUN_ID")
            self.wandb = wandb.init(project=wandb_spec.project or "ft", entity=wandb_spec.entity,
                                    mode=wandb_spec.mode, dir=str(layout.root), tags=wandb_spec.tags,
                                    name=run_id, id=run_id, resume="allow", config=recipe.model_dump(mode="json"))
            link = getattr(self.wandb, "url", None) or str(Path(self.wandb.dir).parent)
            layout.tracking.write_text(json.dumps({"wandb": link, "mode": wandb_spec.mode}) + "\n")

    def log(self, records: list[StepRecord]) -> None:
        """Several steps at once: one append to metrics.jsonl (see step_signals for why batched)."""
        if not self.enabled or not records:
            return
        metrics = [{"loss": r.loss, "lr": r.lr, "tokens": r.tokens}
                   | ({"reward_accuracy": r.accuracy} if r.accuracy is not None else {}) for r in records]
        with open(self.layout.metrics, "a") as handle:
            handle.write("".join(json.dumps({"step": r.step, "time": round(r.time, 3), **m}) + "\n"
                                 for r, m in zip(records, metrics, strict=True)))
        if self.wandb:
            try:
                for record, values in zip(records, metrics, strict=True):
                    self.wandb.log(values, step=record.step)
            except Exception as exc:  # noqa: BLE001 - W&B failing (its service killed, say) never stops training
                print(f"warning: W&B stopped taking metrics ({type(exc).__name__}: {exc}); they go on in "
                      f"{self.layout.metrics} only", flush=True)
                self.wandb = None

    def artifact(self, folder: Path) -> None:
        if self.wandb:
            import wandb

            artifact = wandb.Artifact(f"{os.environ.get('FT_RUN_ID', 'ft')}-adapter", type="model")
            artifact.add_dir(str(folder))
            self.wandb.log_artifact(artifact)

    def finish(self) -> None:
        if self.wandb:
            try:
                self.wandb.finish()
            except Exception as exc:  # noqa: BLE001 - as in log()
                print(f"warning: W&B did not finish cleanly ({type(exc).__name__}: {exc})", flush=True)


def write_summary(layout: RunLayout, recipe: Recipe, step: int, tokens: int, timing: dict) -> None:
    """What the finished run did and cost (`ft status`), then the mark that it is done: a requeue
    after this point never reruns the run."""
    curve = []
    if layout.metrics.exists():
        curve = [(m["step"], m["loss"]) for m in map(json.loads, layout.metrics.read_text().splitlines())]
    gpus = int(os.environ.get("SLURM_GPUS_ON_NODE", "0") or 0) * int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))
    summary = {"steps": step, "tokens": tokens, **timing, "gpu_hours": round(gpus * timing["wall_seconds"] / 3600, 4),
               "final_loss": curve[-1][1] if curve else None,
               "loss_curve": curve, "output": str(layout.output), "method": recipe.method.kind}
    layout.summary.write_text(json.dumps(summary, indent=2) + "\n")
    layout.done.write_text(f"{step}\n")
