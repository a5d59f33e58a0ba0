"""The gates of a recipe (eval.gates) judged on the evaluation's results: each gate passes or fails
with what it saw, and an adapter is promoted only when every gate asked passed.

Results, as the evaluation writes them (toolkit/train/evaluation.py), per model ("base", "adapter"):
    {"held_out": {"loss", "perplexity", "tokens", "examples"} | None,
     "golden": {"loss", "perplexity", "tokens", "examples", "metrics": {name: value}} | None}
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from toolkit.recipe.schema import GateSpec


@dataclass(frozen=True)
class GateResult:
    name: str
    passed: bool
    detail: str


def judge(gates: GateSpec, base: dict, adapter: dict) -> list[GateResult]:
    """Each gate asked, judged; a gate whose numbers are missing fails (it could not be shown)."""
    found = []
    if gates.held_out_loss_drop is not None:
        found.append(loss_drop(base.get("held_out"), adapter.get("held_out"), gates.held_out_loss_drop))
    if gates.golden_loss_rise is not None:
        found.append(loss_rise(base.get("golden"), adapter.get("golden"), gates.golden_loss_rise))
    if gates.golden_metric_drop is not None:
        metrics = sorted((base.get("golden") or {}).get("metrics") or {})
        found.extend(metric_drop(name, base.get("golden"), adapter.get("golden"), gates.golden_metric_drop)
                     for name in metrics or ["(none measured)"])
    return found


def loss_drop(base: dict | None, adapter: dict | None, at_least: float) -> GateResult:
    name = "held_out_loss_drop"
    if not base or not adapter:
        return GateResult(name, False, "the held-out loss was not measured for both models")
    drop = base["loss"] - adapter["loss"]
    passed = drop > 0 if at_least == 0 else drop >= at_least  # 0: any drop, but a drop
    change = f"{drop:.4f} lower" if drop >= 0 else f"{-drop:.4f} higher"
    asked = "any drop" if at_least == 0 else f"a drop of at least {at_least:g}"
    return GateResult(name, passed, f"held-out loss {adapter['loss']:.4f} vs the base's {base['loss']:.4f}: "
                                    f"{change} (the gate asks for {asked})")


def loss_rise(base: dict | None, adapter: dict | None, at_most: float) -> GateResult:
    name = "golden_loss_rise"
    if not base or not adapter:
        return GateResult(name, False, "the golden loss was not measured for both models")
    rise = adapter["loss"] - base["loss"]
    allowed = "no rise" if at_most == 0 else f"a rise of at most {at_most:g}"
    return GateResult(name, rise <= at_most, f"golden loss {adapter['loss']:.4f} vs the base's "
                                             f"{base['loss']:.4f}: {rise:+.4f} (the gate allows {allowed})")


def metric_drop(metric: str, base: dict | None, adapter: dict | None, at_most: float) -> GateResult:
    name = f"golden_{metric}_drop"
    before = ((base or {}).get("metrics") or {}).get(metric)
    after = ((adapter or {}).get("metrics") or {}).get(metric)
    if before is None or after is None:
        return GateResult(name, False, f"{metric} was not measured on the golden set for both models")
    drop = before - after
    allowed = "no drop" if at_most == 0 else f"a drop of at most {at_most:g}"
    return GateResult(name, drop <= at_most, f"{metric} {after:.3f} vs the base's {before:.3f}: "
                                             f"{after - before:+.3f} (the gate allows {allowed})")


def verdict(results: list[GateResult], promote: bool) -> tuple[str, str]:
    """(state, why): "promoted" when gates were asked and every one passed (and the recipe promotes),
    else "draft" with the reason a person reads in `ft status`."""
    failed = [result for result in results if not result.passed]
    if failed:
        return "draft", "failed " + "; ".join(f"{result.name}: {result.detail}" for result in failed)
    if not results:
        return "draft", "no gate asked (eval.gates): promote it by hand with `ft adapters promote`"
    if not promote:
        return "draft", "every gate passed; eval.promote is off: promote it by hand with `ft adapters promote`"
    return "promoted", "every gate passed: " + "; ".join(result.detail for result in results)


def as_dicts(results: list[GateResult]) -> list[dict]:
    return [asdict(result) for result in results]
