"""A run's Prometheus metrics (toolkit/watch/metrics.py): what a scrape reads from the run's own
files, exposed in Prometheus's text format by prometheus_client's real HTTP server, and the
targets file that file-based discovery reads. The lab test (tests/lab/test_monitoring.py) has a real
Prometheus scrape a real run."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.run_specs import run_spec, write_run_spec
from toolkit.runs.progress import tail_lines
from toolkit.watch.metrics import RunCollector, RunExporter

NAME_RULE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


@pytest.fixture
def run_dir(tmp_path) -> Path:
    folder = tmp_path / "runs" / "r1"
    folder.mkdir(parents=True)
    write_run_spec(folder, run_spec(nodes=2, site={"cluster": "lab"}))
    now = time.time()
    lines = [{"step": step, "time": now - 40 + step, "loss": 3.0 - step / 100, "lr": 1e-4, "tokens": 1000 * step}
             for step in range(1, 41)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"step": 41, "ti')
    (folder / "checkpoints.json").write_text(json.dumps({
        "shared": {"step": 40, "at": now - 30}, "remote": {"step": 30, "at": now - 50, "error": "timeout",
                                                            "failing_since": now - 30, "behind_since": now - 35}}))
    events = [{"time": now - 45, "event": "start", "nodes": ["n1", "n2"]},
              {"time": now - 20, "event": "restart", "restart": 1},
              {"time": now - 18, "event": "start", "nodes": ["n1", "n2"]}]
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return folder


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        return answer.read().decode()


def value(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{key}="{val}"' in line for key, val in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in the scrape")


def test_a_scrape_reads_the_runs_files_in_prometheus_format(run_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    targets = tmp_path / "targets"
    targets.mkdir()
    exporter = RunExporter(run_dir, lambda: {"n1": 0.4, "n2": 12.5}, host="node7", targets=str(targets),
                           listen="127.0.0.1")
    port = exporter.start()
    try:
        text = scrape(port)
        announced = json.loads((targets / "r1.77.json").read_text())
    finally:
        exporter.stop(final_wait_s=0)
    assert announced == [{"targets": [f"node7:{port}"]}]  # a claim: the address, no label
    assert not (targets / "r1.77.json").exists()  # gone with the exporter: Prometheus stops scraping
    assert value(text, "ft_run_step", cluster="lab", tier="standard") == 40  # a half-written line skipped
    # Who the run is comes from Slurm, as Prometheus's target labels (toolkit/services/run_targets.py).
    assert not any(f'{label}="' in text for label in ("run", "user", "slurm_job"))
    assert value(text, "ft_run_loss") == pytest.approx(2.6)
    assert value(text, "ft_run_tokens_per_second") == pytest.approx(1000.0)  # 19 steps of 1 s
    assert value(text, "ft_run_step_seconds") == pytest.approx(1.0)
    assert value(text, "ft_run_tokens_total") == 40000
    assert value(text, "ft_run_restarts_total") == 1
    assert value(text, "ft_run_checkpoint_step", tier="remote") == 30
    assert 34 <= value(text, "ft_run_checkpoint_upload_lag_seconds") <= 45
    assert value(text, "ft_run_checkpoint_upload_failing") == 1
    assert value(text, "ft_node_heartbeat_age_seconds", node="n2") == 12.5
    assert 0 < value(text, "ft_run_goodput_ratio") < 1
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    ours = {name for name in names if name.startswith("ft_")}
    assert len(ours) >= 12 and all(NAME_RULE.match(name) for name in ours)


def test_a_run_before_its_first_step_exposes_what_it_has(tmp_path):
    folder = tmp_path / "r2"
    folder.mkdir()
    write_run_spec(folder, run_spec())
    families = list(RunCollector(folder, {"run": "r2"}, dict).collect())
    assert [family.name for family in families] == ["ft_run_info", "ft_node_heartbeat_age_seconds"]


def test_the_tail_is_read_from_the_end_of_a_long_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": n, "time": n}) + "\n" for n in range(100_000)))
    lines = tail_lines(path)
    assert lines[-1]["step"] == 99_999 and 20 <= len(lines) < 1000 and lines[0]["step"] > 99_000


def test_a_claim_name_another_user_took_first_gets_a_name_of_its_own(run_dir, tmp_path, monkeypatch):
    """The claims folder is sticky and every user's: a file bob made under alice's run's name cannot be
    replaced by her watchdog, which claims under a name of its own instead (run_targets.CLAIM_NAME)."""
    from toolkit.base import shared_dirs
    from toolkit.services import run_targets

    monkeypatch.setenv("SLURM_JOB_ID", "77")
    targets = tmp_path / "targets"
    targets.mkdir()
    written = shared_dirs.write_atomically

    def squatted(path, text, mode=0o600):
        if path.name == "r1.77.json":
            raise PermissionError(1, "Operation not permitted")  # what rename over bob's file says
        written(path, text, mode)

    monkeypatch.setattr(shared_dirs, "write_atomically", squatted)
    exporter = RunExporter(run_dir, dict, host="node7", targets=str(targets), listen="127.0.0.1")
    port = exporter.start()
    try:
        (made,) = targets.iterdir()
        named = run_targets.CLAIM_NAME.fullmatch(made.name)
        assert named and (named["run"], named["job"]) == ("r1", "77") and made.name != "r1.77.json"
        assert json.loads(made.read_text()) == [{"targets": [f"node7:{port}"]}]
    finally:
        exporter.stop(final_wait_s=0)
    assert not list(targets.iterdir())


def test_the_end_waits_for_one_more_scrape_only_where_prometheus_scrapes(run_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    targets = tmp_path / "targets"
    targets.mkdir()
    unwatched = RunExporter(run_dir, dict, targets=str(targets), listen="127.0.0.1")
    unwatched.start()
    unwatched.stop(final_wait_s=600)  # never scraped: no wait (the test's timeout would end it)
    watched = RunExporter(run_dir, dict, targets=str(targets), listen="127.0.0.1")
    port = watched.start()
    scrape(port)
    seen = []

    def last_scrape():
        time.sleep(0.5)
        seen.append(((targets / "r1.77.json").exists(), "ft_run_step" in scrape(port)))

    scraper = threading.Thread(target=last_scrape)
    scraper.start()
    watched.stop(final_wait_s=600)
    scraper.join()
    assert seen == [(True, True)]  # the final state was served, still announced, before the end


def test_rates_after_a_restart_are_the_new_starts_own(run_dir):
    """A restart resumes from step 30's checkpoint and counts its tokens afresh: a window over the
    restart would give a negative rate."""
    now = time.time()
    resumed = [{"step": step, "time": now + 2 * (step - 30), "loss": 2.0, "tokens": 500 * (step - 30)}
               for step in range(31, 36)]
    with open(run_dir / "metrics.jsonl", "a") as metrics:
        metrics.write("\n" + "".join(json.dumps(line) + "\n" for line in resumed))
    families = {family.name: family for family in RunCollector(run_dir, {"run": "r1"}, dict).collect()}
    assert families["ft_run_step"].samples[0].value == 35
    assert families["ft_run_tokens_per_second"].samples[0].value == pytest.approx(250.0)  # 500 tokens per 2 s
    assert families["ft_run_step_seconds"].samples[0].value == pytest.approx(2.0)


def test_a_damaged_file_costs_its_own_metrics_not_the_scrape(run_dir, capsys, monkeypatch):
    (run_dir / "checkpoints.json").write_text(json.dumps({"shared": {"step": None, "at": "yesterday"},
                                                          "remote": {"step": "ten", "behind_since": [1]}}))
    (run_dir / "events.jsonl").write_text(json.dumps({"time": time.time(), "event": "start"})
                                          + '\n{"time": null, "event": 7}\n')
    collector = RunCollector(run_dir, {"run": "r1"}, lambda: {"n1": None, "n2": 3.0})  # an age gone wrong
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert "ft_run_checkpoint" not in text and 'node="n1"' not in text and 'node="n2"' in text
    assert value(text, "ft_run_step", run="r1") == 40  # the metrics file is sound
    # What no check foresaw (here: the timeline's reader failing) leaves its section out, said once.
    from toolkit.runs import timeline

    def unforeseen(run_dir):
        raise TypeError("'<' not supported between instances of 'NoneType' and 'int'")

    monkeypatch.setattr(timeline, "timeline", unforeseen)
    collector.goodput = (float("-inf"), None)
    for _ in range(2):
        names = [family.name for family in collector.collect()]
        assert "ft_run_goodput_ratio" not in names and "ft_run_step" in names and "ft_run_restarts" in names
    assert capsys.readouterr().err.count("left out") == 1


def test_ranks_per_phase_come_from_the_launchers_heartbeats(run_dir):
    beats = {"n1": {"ranks": {"0": ["save", 40], "1": ["step", 41]}}, "n2": {"ranks": {"2": ["start", -1],
                                                                                        "3": ["eval", 0]}},
             "n3": {"ranks": "junk"}, "n4": "junk"}
    families = {f.name: f for f in RunCollector(run_dir, {"run": "r1"}, dict, lambda: beats).collect()}
    phases = {s.labels["phase"]: s.value for s in families["ft_run_ranks"].samples}
    assert phases == {"eval": 1, "export": 0, "save": 1, "start": 1, "step": 1}


def test_values_no_number_can_hold_or_a_file_nested_without_end_cost_only_themselves(run_dir):
    with open(run_dir / "metrics.jsonl", "a") as metrics:
        metrics.write("\n" + json.dumps({"step": 41, "time": time.time(), "loss": 10**400, "tokens": float("inf")})
                      + "\n" + "[" * 5000 + "\n")
    (run_dir / "checkpoints.json").write_text("[" * 100_000)
    families = {f.name: f for f in RunCollector(run_dir, {"run": "r1"}, dict).collect()}
    assert families["ft_run_step"].samples[0].value == 41
    assert "ft_run_loss" not in families and "ft_run_checkpoint_step" not in families


def test_the_evaluation_after_training_is_scraped_per_model_split_and_gate(run_dir):
    (run_dir / "eval.json").write_text(json.dumps({
        "base": {"held_out": {"loss": 4.2}, "golden": {"loss": 4.0, "metrics": {"exact_match": 0.0}}},
        "adapter": {"held_out": {"loss": 0.3}, "golden": {"loss": 0.2, "metrics": {"exact_match": 0.875}}},
        "gates": [{"name": "held_out_loss_drop", "passed": True, "detail": ""},
                  {"name": "golden_exact_match_drop", "passed": "yes", "detail": ""}],  # not a true: failed
        "state": "promoted", "why": ""}))
    families = {family.name: family for family in RunCollector(run_dir, {"run": "r1"}, dict).collect()}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for name in ("ft_run_eval_loss", "ft_run_eval_metric", "ft_run_eval_gate_passed", "ft_run_eval_promoted")
               for s in families[name].samples}
    assert samples[("ft_run_eval_loss", (("model", "adapter"), ("run", "r1"), ("split", "held_out")))] == 0.3
    assert samples[("ft_run_eval_loss", (("model", "base"), ("run", "r1"), ("split", "golden")))] == 4.0
    assert samples[("ft_run_eval_metric", (("metric", "exact_match"), ("model", "adapter"), ("run", "r1")))] == 0.875
    assert samples[("ft_run_eval_gate_passed", (("gate", "golden_exact_match_drop"), ("run", "r1")))] == 0
    assert samples[("ft_run_eval_promoted", (("run", "r1"),))] == 1
    (run_dir / "eval.json").write_text('{"base": {"held_out": [1]}, "adapter": 7, "gates": [3]}')  # by hand
    names = [family.name for family in RunCollector(run_dir, {"run": "r1"}, dict).collect()]
    assert "ft_run_step" in names and "ft_run_eval_promoted" not in names  # costs its own section only


def test_a_nodes_scrape_reads_no_run_file_and_the_runs_scrape_no_nodes_state(run_dir, monkeypatch):
    """A job is scraped once per node (toolkit/services/run_targets.py): a node's scope reads only what
    the supervisor holds in memory, the run's scope only the run's files; together, all of them."""
    collector = RunCollector(run_dir, {"run": "r1"}, lambda: {"n1": 1.0, "n2": 2.0})
    read = []
    for section in ("step_metrics", "eval_metrics", "heartbeat_metrics", "gpu_metrics"):
        real = getattr(collector, section)
        monkeypatch.setattr(collector, section, lambda *a, _real=real, _name=section: read.append(_name) or _real(*a))
    node = {family.name for family in collector.collect(scope="node")}
    assert read == ["heartbeat_metrics", "gpu_metrics"] and node == {"ft_node_heartbeat_age_seconds"}
    read.clear()
    job = {family.name for family in collector.collect(scope="job")}
    assert read == ["step_metrics", "eval_metrics"]
    assert "ft_run_info" in job and "ft_node_heartbeat_age_seconds" not in job
    whole = {family.name for family in collector.collect()}
    assert whole == node | job
