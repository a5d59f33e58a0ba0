"""Where a run's numbers go: metrics.jsonl in the run directory (rank 0), W&B (offline on the lab),
and the summary of a finished run."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from toolkit.recipe.schema import Recipe
from toolkit.runs.layout import RunLayout
from toolkit.train.step_signals import StepRecord

STEP_AXIS = "train/step"  # the x-axis of every train/ chart in W&B


class Tracker:
    """Rank 0's metrics: every step in metrics.jsonl at once; W&B as soon as it has started. W&B's
    start (its service process: 1-3 s) runs in a thread beside the model load and the resume, so a
    restart's first step never waits for it; what is logged meanwhile waits in a queue."""

    WANDB_START_WAIT_S = 120.0  # at the end of a run, for the queue to reach W&B

    def __init__(self, layout: RunLayout, recipe: Recipe, rank: int):
        self.enabled = rank == 0
        self.layout = layout
        self.wandb = None
        self.queued: list[dict] = []
        self.total_steps: int | None = None  # the run's plan, once the data's size is known: each line says it
        self.method, self.base = str(recipe.method.kind), recipe.model.base
        self.starting: threading.Thread | None = None
        wandb_spec = recipe.tracking.wandb
        if self.enabled and wandb_spec.mode != "disabled":
            self.starting = threading.Thread(target=self._start_wandb, args=(recipe,), name="ft-wandb", daemon=True)
            self.starting.start()

    def _start_wandb(self, recipe: Recipe) -> None:
        wandb_spec = recipe.tracking.wandb
        try:
            import wandb

            run_id = os.environ.get("FT_RUN_ID")
            run = wandb.init(project=wandb_spec.project or "ft", entity=wandb_spec.entity, mode=wandb_spec.mode,
                             dir=str(self.layout.root), tags=wandb_spec.tags, name=run_id, id=run_id,
                             resume="allow", config=recipe.model_dump(mode="json"))
            # Charts run along the training step, not W&B's own counter: a start after a fault redoes
            # the steps since its checkpoint, and W&B drops a `step=` lower than one it has seen.
            # Logged along `train/step`, the redone steps are kept, drawn over the first attempt's.
            run.define_metric(STEP_AXIS)
            run.define_metric("train/*", step_metric=STEP_AXIS)
            link = getattr(run, "url", None) or str(Path(run.dir).parent)
            self.layout.tracking.write_text(json.dumps({"wandb": link, "mode": wandb_spec.mode}) + "\n")
            self.wandb = run
        except Exception as exc:  # noqa: BLE001 - W&B failing never stops training
            print(f"warning: W&B did not start ({type(exc).__name__}: {exc}); metrics go to "
                  f"{self.layout.metrics} only", flush=True)

    def log(self, records: list[StepRecord]) -> None:
        """Several steps at once: one append to metrics.jsonl (see step_signals for why batched)."""
        if not self.enabled or not records:
            return
        metrics = [{"loss": r.loss, "lr": r.lr, "tokens": r.tokens}
                   | ({"reward_accuracy": r.accuracy} if r.accuracy is not None else {})
                   | ({"grad_norm": r.grad_norm} if r.grad_norm is not None else {}) for r in records]
        with open(self.layout.metrics, "a") as handle:
            planned = {"of": self.total_steps} if self.total_steps else {}
            handle.write("".join(json.dumps({"step": r.step, "time": round(r.time, 3), **m, **planned}) + "\n"
                                 for r, m in zip(records, metrics, strict=True)))
        if self.starting is not None:
            self.queued += [{STEP_AXIS: record.step, **{f"train/{key}": value for key, value in values.items()}}
                            for record, values in zip(records, metrics, strict=True)]
            self._to_wandb(wait=0)

    def _to_wandb(self, wait: float) -> None:
        """The queue to W&B, once it has started (waiting up to `wait` seconds for that)."""
        self.starting.join(timeout=wait)
        if self.starting.is_alive():
            return
        queued, self.queued = self.queued, []
        if not self.wandb:
            return
        try:
            for values in queued:
                self.wandb.log(values)
        except Exception as exc:  # noqa: BLE001 - W&B failing (its service killed, say) never stops training
            print(f"warning: W&B stopped taking metrics ({type(exc).__name__}: {exc}); they go on in "
                  f"{self.layout.metrics} only", flush=True)
            self.wandb = None

    def artifact(self, folder: Path) -> None:
        if self.starting is not None:
            self._to_wandb(wait=self.WANDB_START_WAIT_S)
        if self.wandb:
            import wandb

            artifact = wandb.Artifact(artifact_name(os.environ.get("FT_RUN_ID", "ft"), self.method), type="model",
                                      metadata={"method": self.method, "base_model": self.base})
            # By reference, not copied to a staging folder in $HOME: the output on the shared filesystem
            # is final once written, and `ft sync` uploads it from there on the login node (a whole
            # model's weights are not written twice).
            artifact.add_dir(str(folder), skip_cache=True, policy="immutable")
            self.wandb.log_artifact(artifact)

    def evaluation(self, results: dict) -> None:
        """The evaluation in the W&B summary: eval/<base|adapter>/<held_out|golden>/<number>, the
        verdict (eval/state) and each gate (eval/gates/<name>: 1 passed, 0 failed)."""
        if self.starting is not None:
            self._to_wandb(wait=self.WANDB_START_WAIT_S)
        if not self.wandb:
            return
        numbers = {f"eval/{model}/{split}/{name}": value
                   for model in ("base", "adapter") for split, found in (results.get(model) or {}).items()
                   for name, value in flat(found or {}).items()}
        gates = {f"eval/gates/{gate['name']}": int(gate["passed"]) for gate in results.get("gates", [])}
        try:
            self.wandb.summary.update(numbers | gates | {"eval/state": results.get("state")})
        except Exception as exc:  # noqa: BLE001 - as in log()
            print(f"warning: W&B did not take the evaluation ({type(exc).__name__}: {exc})", flush=True)

    def faults(self) -> None:
        """The run's restarts and faults so far (the watchdog's timeline), in its W&B summary: the
        restart count and goodput, and each fault (when, what, which node, why). A summary, not a
        table: a table is an artifact, which an offline run's sync to a self-hosted W&B may refuse."""
        from toolkit.runs.timeline import timeline

        try:
            spent = timeline(self.layout.root)
        except (OSError, ValueError):
            return
        if not spent:
            return
        self.wandb.summary["ft/restarts"] = spent["starts"] - 1
        self.wandb.summary["ft/goodput"] = spent["goodput"]
        self.wandb.summary["ft/faults"] = [
            {"time": fault["time"], "event": fault["event"], "node": str(fault.get("node", "")),
             "why": str(fault.get("reason") or fault.get("after") or "")} for fault in spent["faults"][-100:]]

    def finish(self) -> None:
        if self.starting is not None:
            self._to_wandb(wait=self.WANDB_START_WAIT_S)
        if self.wandb:
            try:
                self.faults()
                self.wandb.finish()
            except Exception as exc:  # noqa: BLE001 - as in log()
                print(f"warning: W&B did not finish cleanly ({type(exc).__name__}: {exc})", flush=True)


def flat(found: dict) -> dict:
    """A set's numbers with its task metrics beside them (golden: {"loss", "metrics": {"exact_match"}})."""
    return {key: value for key, value in found.items() if key != "metrics"} | dict(found.get("metrics") or {})


def artifact_name(run_id: str, method: str) -> str:
    """What the output is: a LoRA/QLoRA run's adapter (it needs its base model), a full fine-tune's
    whole model. W&B names allow letters, digits, '-', '_' and '.'."""
    what = "adapter" if method in ("lora", "qlora") else "model"
    return f"{run_id}-{method}-{what}"


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
