"""The evaluation inside the allocation, on every rank at once: each rank takes its share of a set's
examples and the sums are added up across ranks (one all_reduce per set), so a large held-out set
costs 1/world of it. The same suite measures the base model (before the first step) and the trained
one (after the export).

    held_out  the training file's held-out share (data.eval_fraction), or the eval file (data.eval)
    golden    eval.golden: its loss, and the task metrics of greedy completions of its prompts

Every rank runs the same number of forward passes (a short share is padded with a zero-weight
repeat): under ZeRO-3 each forward gathers parameters from every rank, and a rank that stopped early
would leave the others waiting for good.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from toolkit.evaluate import gates
from toolkit.evaluate.scores import SCORES
from toolkit.recipe.schema import EvalSpec, Recipe
from toolkit.runs.layout import RunLayout
from toolkit.train.data import IGNORE, Example, collate


@dataclass(frozen=True)
class EvalSets:
    held_out: list[Example]
    golden: list[Example]


@dataclass(frozen=True)
class Ranks:
    dist: object
    rank: int
    world: int
    device: object

    def share(self, items: list) -> list[tuple[object, float]]:
        """This rank's items with their weight (1), padded with weight-0 repeats to the longest share."""
        longest = math.ceil(len(items) / self.world)
        mine = items[self.rank::self.world]
        return [(item, 1.0) for item in mine] + [(items[0], 0.0)] * (longest - len(mine))

    def total(self, values: list[float]) -> list[float]:
        import torch

        summed = torch.tensor(values, dtype=torch.float64, device=self.device)
        self.dist.all_reduce(summed)
        return summed.tolist()


@dataclass
class Evaluator:
    """The run's evaluation: the base model before the first step, the trained one after the export,
    then the gates (rank 0 writes the results)."""
    layout: RunLayout
    recipe: Recipe
    engine: object
    objective: object
    tokenizer: object
    sets: EvalSets
    ranks: Ranks
    micro_batch: int
    progress: object
    log: Callable[[str], None]

    @property
    def synced(self) -> bool:
        return self.engine.zero_optimization_stage() == 3  # generate() steps every rank together

    def measure(self) -> dict:
        return measure(self.engine, self.objective, self.sets, self.recipe.eval, self.tokenizer, self.ranks,
                       self.micro_batch, self.synced)

    def base_before(self, start: int) -> None:
        """The base model's numbers, once, before the first step (a LoRA adapter starts as a no-op;
        a full fine-tune's weights are still the base's). A resumed run has them already."""
        if start != 0 or not self.everyone(not self.layout.eval_base.exists()):
            return
        self.progress.report("eval", 0)
        began = time.monotonic()
        base = self.measure()
        if self.ranks.rank == 0:
            with contextlib.suppress(OSError):  # not written: the end measures the base itself (LoRA)
                write_json(self.layout.eval_base, base)
            self.log(f"evaluated the base model in {time.monotonic() - began:.1f} s: {brief(base)}")

    def after(self, step: int) -> dict | None:
        """The trained model's numbers beside the base's, the gates and the verdict (rank 0's; None
        on the other ranks)."""
        self.progress.report("eval", step)
        began = time.monotonic()
        adapter = self.measure()
        base = None
        if self.everyone(self.layout.eval_base.exists()):
            from toolkit.runs.status import read_json

            base = read_json(self.layout.eval_base)  # bounded, a regular file only; None: not measured
        elif self.recipe.method.kind in ("lora", "qlora"):  # a run resumed from before evaluations: the
            with self.engine.module.disable_adapter():      # base is the model with its adapter off
                base = self.measure()
        if self.ranks.rank != 0:
            return None
        judged = gates.judge(self.recipe.eval.gates, base or {}, adapter)
        state, why = gates.verdict(judged, self.recipe.eval.promote)
        # passed: no gate failed (what the registry asks before any promotion, by hand too).
        results = {"step": step, "time": time.time(), "seconds": round(time.monotonic() - began, 2),
                   "base": base, "adapter": adapter, "gates": gates.as_dicts(judged),
                   "passed": all(result.passed for result in judged), "state": state, "why": why}
        try:
            write_json(self.layout.evaluation, results)
        except OSError as exc:  # a full disk: the results go on to the summary, W&B and the log
            self.log(f"eval.json not written: {exc}")
        self.log(f"evaluated the trained model: {brief(adapter)}; base: {brief(base)}; {state}: {why}")
        return results

    def everyone(self, true_here: bool) -> bool:
        """Whether it holds on every rank (each takes the same branch: a collective follows)."""
        return self.ranks.total([1.0 if true_here else 0.0])[0] == self.ranks.world


def brief(results: dict | None) -> str:
    if not results:
        return "not measured"
    said = [f"{name} loss {found['loss']:.4f}" for name, found in results.items() if found]
    said += [f"{metric} {value:.3f}" for metric, value in ((results.get("golden") or {}).get("metrics") or {}).items()]
    return ", ".join(said) or "no data"


def write_json(path, value: dict) -> None:
    from toolkit.base.shared_dirs import write_atomically

    write_atomically(path, json.dumps(value, indent=2) + "\n", mode=0o644)


def measure(engine, objective, sets: EvalSets, spec: EvalSpec, tokenizer, ranks: Ranks,
            micro_batch: int, synced: bool) -> dict:
    """The suite's results for the model as it stands ({"held_out", "golden"}; None where no set)."""
    module = engine.module
    training = module.training
    module.eval()  # no dropout: the same model gives the same numbers
    try:
        held_out = losses(engine, objective, sets.held_out[: spec.max_examples], ranks, micro_batch,
                          tokenizer.pad_token_id)
        golden = losses(engine, objective, sets.golden[: spec.max_examples], ranks, micro_batch,
                        tokenizer.pad_token_id)
        if golden is not None and spec.metrics:
            # Completions of the chosen answer's prompt (DPO's units are pairs), or of the example's.
            units = objective.units(sets.golden[: spec.max_examples])
            references = [unit[0] if isinstance(unit, tuple) else unit for unit in units]
            golden["metrics"] = task_metrics(module, references, spec, tokenizer, ranks, synced)
    finally:
        module.train(training)
    return {"held_out": held_out, "golden": golden}


def losses(engine, objective, examples: list[Example], ranks: Ranks, micro_batch: int, pad_id: int) -> dict | None:
    """Mean loss per labelled token (SFT; with its perplexity) or per pair (DPO; with the share of
    pairs whose chosen answer the model prefers more than the base does)."""
    import torch

    units = objective.units(examples)
    if not units:
        return None
    mine = ranks.share(units)
    sums = [0.0, 0.0, 0.0, 0.0]  # loss, what it is over (tokens or pairs), units, accuracy
    paired = False
    with torch.no_grad():
        for start in range(0, len(mine), micro_batch):
            chunk = mine[start:start + micro_batch]
            batch = collate(objective.micro_batch([unit for unit, _ in chunk]), pad_id)
            batch = {key: value.to(ranks.device) for key, value in batch.items()}
            weights = torch.tensor([weight for _, weight in chunk], dtype=torch.float64, device=ranks.device)
            loss, over, accuracy = (None if value is None else value.to(torch.float64)
                                    for value in objective.unit_losses(engine, batch))
            paired = accuracy is not None
            for index, value in enumerate((loss, over, torch.ones_like(weights), accuracy)):
                sums[index] += 0.0 if value is None else float((value * weights).sum())
    loss_sum, over, count, accuracy_sum = ranks.total(sums)
    if over <= 0:  # no labelled token (every answer cut off at max_seq_len): nothing was measured
        return None
    loss = loss_sum / over
    if paired:
        return {"loss": loss, "pairs": int(count), "reward_accuracy": accuracy_sum / max(count, 1.0)}
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": int(over), "examples": int(count)}


def prompt_and_reference(example: Example) -> tuple[list[int], list[int]] | None:
    """The prompt (every token before the last labelled span) and the reference (that span): the
    completion, or the last assistant turn, whatever the data's format."""
    labelled = [i for i, label in enumerate(example.labels) if label != IGNORE]
    if not labelled:
        return None
    end = labelled[-1]
    begin = end
    while begin > 0 and example.labels[begin - 1] != IGNORE:
        begin -= 1
    if begin == 0:
        return None
    return example.input_ids[:begin], example.input_ids[begin:end + 1]


def task_metrics(module, examples: list[Example], spec: EvalSpec, tokenizer, ranks: Ranks, synced: bool) -> dict:
    """The golden set's task metrics: each prompt completed greedily, one at a time (no padding to
    get wrong), scored against its reference."""
    import torch

    pairs = [found for found in map(prompt_and_reference, examples) if found is not None]
    if not pairs:
        return {}
    names = [str(metric) for metric in spec.metrics]
    sums = [0.0] * (len(names) + 1)
    with torch.no_grad():
        for (prompt, reference), weight in ranks.share(pairs):
            ids = torch.tensor([prompt], device=ranks.device)
            out = module.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=spec.max_new_tokens, do_sample=False,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                  synced_gpus=synced)
            said = tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True)
            wanted = tokenizer.decode(reference, skip_special_tokens=True)
            for index, name in enumerate(names):
                sums[index] += weight * SCORES[name](said, wanted)
            sums[-1] += weight
    totals = ranks.total(sums)
    return {name: totals[index] / max(totals[-1], 1.0) for index, name in enumerate(names)}
