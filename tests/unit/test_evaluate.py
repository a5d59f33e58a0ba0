"""The evaluation after training (toolkit/evaluate/): the task metrics, the gates and their verdict,
the recipe's eval section, and the suite measured on a tiny random Llama (built here, no hub) the way
a rank measures it, base model first, then the trained one."""

from __future__ import annotations

import json
import math

import pytest

from tests.support.tiny_peft import Engine, lora_model
from toolkit.evaluate import gates
from toolkit.evaluate.scores import exact_match, token_f1
from toolkit.recipe.schema import EvalSpec, GateSpec, Recipe
from toolkit.train.data import IGNORE, Example


def test_exact_match_forgives_whitespace_and_case_and_f1_gives_partial_credit():
    assert exact_match("  Chien ", "chien") == 1.0 and exact_match("chien!", "chien") == 0.0
    assert token_f1("le chien noir", "le chien") == pytest.approx(0.8)  # precision 2/3, recall 1
    assert token_f1("", "") == 1.0 and token_f1("chat", "") == 0.0 and token_f1("chat", "chien") == 0.0


BASE = {"held_out": {"loss": 5.0}, "golden": {"loss": 4.0, "metrics": {"exact_match": 0.25, "token_f1": 0.5}}}


def trained(held_out: float, golden: float, em: float) -> dict:
    return {"held_out": {"loss": held_out}, "golden": {"loss": golden, "metrics": {"exact_match": em,
                                                                                 "token_f1": 0.6}}}


def test_an_adapter_that_beats_the_base_by_the_asked_margin_is_promoted():
    asked = GateSpec(held_out_loss_drop=1.0, golden_loss_rise=0.1, golden_metric_drop=0.0)
    results = gates.judge(asked, BASE, trained(3.5, 4.05, 0.25))
    assert [r.name for r in results] == ["held_out_loss_drop", "golden_loss_rise", "golden_exact_match_drop",
                                         "golden_token_f1_drop"]
    assert all(r.passed for r in results)
    state, why = gates.verdict(results, promote=True)
    assert state == "promoted" and "held-out loss 3.5000 vs the base's 5.0000: 1.5000 lower (the gate asks for a " \
        "drop of at least 1)" in why
    assert "exact_match 0.250 vs the base's 0.250: +0.000 (the gate allows no drop)" in why


def test_each_failed_gate_keeps_a_draft_and_says_why():
    asked = GateSpec(held_out_loss_drop=1.0, golden_metric_drop=0.1)
    results = gates.judge(asked, BASE, trained(4.5, 3.0, 0.0))  # too little gain; exact match lost
    failed = {r.name for r in results if not r.passed}
    assert failed == {"held_out_loss_drop", "golden_exact_match_drop"}
    state, why = gates.verdict(results, promote=True)
    assert state == "draft" and why.startswith("failed held_out_loss_drop: held-out loss 4.5000")
    assert "exact_match 0.000 vs the base's 0.250: -0.250 (the gate allows a drop of at most 0.1)" in why
    # "0: any drop" still asks for a drop: an unchanged adapter is no better than its base.
    (same,) = gates.judge(GateSpec(held_out_loss_drop=0.0), BASE, trained(5.0, 4.0, 0.25))
    assert not same.passed and same.detail.endswith("0.0000 lower (the gate asks for any drop)")
    (worse,) = gates.judge(GateSpec(held_out_loss_drop=0.0), BASE, trained(5.5, 4.0, 0.25))
    assert not worse.passed and "0.5000 higher" in worse.detail


def test_a_gate_whose_numbers_are_missing_fails_and_no_gate_or_no_promotion_keeps_a_draft():
    (missing,) = gates.judge(GateSpec(held_out_loss_drop=0.1), {}, trained(1.0, 1.0, 1.0))
    assert not missing.passed and "not measured" in missing.detail
    assert gates.verdict([], promote=True)[0] == "draft"
    assert "promote it by hand" in gates.verdict([], promote=True)[1]
    passed = gates.judge(GateSpec(held_out_loss_drop=0.1), BASE, trained(1.0, 1.0, 1.0))
    assert gates.verdict(passed, promote=False) == ("draft", "every gate passed; eval.promote is off: promote it "
                                                             "by hand with `ft adapters promote`")


def recipe(**changes) -> dict:
    base = {"name": "r", "model": {"base": "tiny-llama"}, "data": {"train": "t.jsonl"}}
    return base | changes


@pytest.mark.parametrize("changes,message", [
    ({"eval": {"metrics": ["exact_match"]}}, "metrics are measured on the golden set"),
    ({"eval": {"gates": {"golden_loss_rise": 0.1}}}, "a golden-set gate needs the golden set"),
    ({"eval": {"golden": "g.jsonl", "gates": {"golden_metric_drop": 0.1}}}, r"name them \(eval.metrics"),
    ({"data": {"train": "t.jsonl", "eval_fraction": 0}, "eval": {"gates": {"held_out_loss_drop": 0.1}}},
     "needs held-out data"),
    ({"eval": {"metrics": ["bleu"], "golden": "g.jsonl"}}, "exact_match"),
])
def test_an_eval_section_that_cannot_be_measured_is_refused_with_the_fix(changes, message):
    with pytest.raises(ValueError, match=message):
        Recipe.model_validate(recipe(**changes))


def test_the_recipe_names_its_golden_file_among_its_data_files():
    parsed = Recipe.model_validate(recipe(eval={"golden": "g.jsonl"}))
    assert parsed.data_files() == {"train": "t.jsonl", "golden": "g.jsonl"}


# -- the suite on a tiny model -----------------------------------------------------------------

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return lora_model(tmp_path_factory.mktemp("tiny"))


class OneRank:
    """torch.distributed for a world of one (the sums are this rank's)."""

    def all_reduce(self, tensor) -> None:
        pass


class Tokenizer:
    pad_token_id, eos_token_id = 0, 2

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(str(int(i)) for i in ids if not skip_special_tokens or int(i) not in (0, 1, 2))


def examples(count: int = 6) -> list[Example]:
    # bos, a two-token prompt, a two-token answer, eos: the answer and eos are labelled
    return [Example([1, 10 + i, 20 + i, 30 + i, 40 + i, 2], [IGNORE, IGNORE, IGNORE, 30 + i, 40 + i, 2])
            for i in range(count)]


def ranks(world: int = 1, rank: int = 0):
    from toolkit.train.evaluation import Ranks

    return Ranks(OneRank(), rank, world, torch.device("cpu"))


def test_every_example_is_measured_once_across_ranks_each_running_as_many_batches():
    items = list(range(7))
    shares = [ranks(3, r).share(items) for r in range(3)]
    assert {len(share) for share in shares} == {3}  # the same number of forward passes on every rank
    counted = sorted(item for share in shares for item, weight in share if weight == 1.0)
    assert counted == items and sum(weight == 0.0 for share in shares for _, weight in share) == 2


def test_the_held_out_loss_is_the_mean_per_labelled_token_in_any_batch_size(model):
    from toolkit.train.evaluation import losses
    from toolkit.train.objectives import Sft

    model.eval()
    rows = examples()
    with torch.no_grad():
        nll, tokens = 0.0, 0
        for row in rows:  # one row at a time, with the model's own loss: the reference
            ids, labels = torch.tensor([row.input_ids]), torch.tensor([row.labels])
            count = int((labels[:, 1:] != IGNORE).sum())
            nll += float(model(input_ids=ids, labels=labels).loss) * count
            tokens += count
    for micro_batch in (1, 4):
        found = losses(Engine(model), Sft(), rows, ranks(), micro_batch, pad_id=0)
        assert found["loss"] == pytest.approx(nll / tokens, rel=1e-5) and found["tokens"] == tokens
        assert found["perplexity"] == pytest.approx(math.exp(nll / tokens), rel=1e-5) and found["examples"] == 6
    assert losses(Engine(model), Sft(), [], ranks(), 4, pad_id=0) is None
    unlabelled = [Example(row.input_ids, [IGNORE] * len(row.labels)) for row in rows]  # answers cut off
    assert losses(Engine(model), Sft(), unlabelled, ranks(), 4, pad_id=0) is None  # not a loss of 0


def test_dpo_is_measured_per_pair_and_starts_at_log_2(model):
    from toolkit.train.evaluation import losses
    from toolkit.train.objectives import Dpo

    rows = examples(4)  # two pairs: chosen, rejected, chosen, rejected
    found = losses(Engine(model), Dpo(beta=0.1), rows, ranks(), 2, pad_id=0)
    assert found["pairs"] == 2 and found["loss"] == pytest.approx(math.log(2), rel=1e-5)
    assert found["reward_accuracy"] == 0.0


def test_the_prompt_and_reference_are_the_tokens_before_and_of_the_last_labelled_span():
    from toolkit.train.evaluation import prompt_and_reference

    assert prompt_and_reference(examples(1)[0]) == ([1, 10, 20], [30, 40, 2])
    chat = Example([1, 5, 6, 7, 8, 9], [IGNORE, 5, IGNORE, IGNORE, 8, 9])  # two assistant turns: the last
    assert prompt_and_reference(chat) == ([1, 5, 6, 7], [8, 9])
    assert prompt_and_reference(Example([1, 2], [IGNORE, IGNORE])) is None


def test_task_metrics_score_each_greedy_completion_against_its_reference():
    from toolkit.train.evaluation import task_metrics

    class Answers:
        """A model that answers the first half of the prompts right and the rest wrong."""

        def generate(self, input_ids, max_new_tokens, **_):
            prompt = input_ids[0].tolist()
            answer = [prompt[1] + 20, prompt[2] + 20, 2] if prompt[1] < 13 else [63, 2]
            return torch.tensor([prompt + answer[:max_new_tokens]])

    found = task_metrics(Answers(), examples(6), EvalSpec(golden="g", metrics=["exact_match", "token_f1"]),
                         Tokenizer(), ranks(), synced=False)
    assert found == {"exact_match": 0.5, "token_f1": 0.5}


def test_the_base_is_measured_before_the_first_step_and_the_trained_adapter_is_judged_against_it(
        model, tmp_path):
    from toolkit.runs.layout import RunLayout
    from toolkit.train.evaluation import EvalSets, Evaluator
    from toolkit.train.objectives import Sft

    class Progress:
        said: list = []

        def report(self, phase, step):
            self.said.append((phase, step))

    parsed = Recipe.model_validate(recipe(data={"train": "t.jsonl", "eval": "e.jsonl"},
                                          eval={"gates": {"held_out_loss_drop": 0.2}}))
    layout, progress, rows = RunLayout(tmp_path), Progress(), examples()
    evaluator = Evaluator(layout, parsed, Engine(model), Sft(), Tokenizer(), EvalSets(rows, []), ranks(), 4,
                          progress, lambda _: None)
    evaluator.base_before(start=0)
    base = json.loads(layout.eval_base.read_text())
    evaluator.base_before(start=0)  # measured once: a restart before the first checkpoint keeps it
    assert progress.said == [("eval", 0)]

    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
    batch = {"input_ids": torch.tensor([r.input_ids for r in rows]), "labels": torch.tensor([r.labels for r in rows])}
    model.train()
    for _ in range(60):  # train the adapter on the held-out answers themselves: it must beat the base
        optimizer.zero_grad()
        model(**batch).loss.backward()
        optimizer.step()

    results = evaluator.after(step=30)
    assert results["base"] == base and results["adapter"]["held_out"]["loss"] < base["held_out"]["loss"] - 0.2
    assert results["state"] == "promoted" and results["gates"][0]["passed"]
    assert json.loads(layout.evaluation.read_text()) == json.loads(json.dumps(results))
    assert model.training  # evaluation leaves the model as it found it

    strict = Recipe.model_validate(recipe(data={"train": "t.jsonl", "eval": "e.jsonl"},
                                          eval={"gates": {"held_out_loss_drop": 1000.0}}))
    evaluator.recipe = strict
    refused = evaluator.after(step=30)
    assert refused["state"] == "draft" and "failed held_out_loss_drop" in refused["why"]
