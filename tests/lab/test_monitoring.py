"""A real Prometheus (Debian's, started by `ft lab up` through ansible/roles/prometheus) finds a real
run through the targets file its watchdog writes, and scrapes its metrics while it trains. The run
is the session's uninterrupted tiny run (tests/lab/conftest.py): what Prometheus kept of it is read
back from its own storage once the run has ended."""

from __future__ import annotations

import getpass
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.support.prometheus import query, query_range
from tests.support.slurm import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prometheus(lab) -> str:
    if not lab.prometheus:
        pytest.fail("the lab has no Prometheus: bring it up again with `ft lab up`")
    status = json.loads(subprocess.run([sys.executable, "-m", "toolkit", "lab", "status", "--json"],
                                       capture_output=True, text=True).stdout)
    assert status["prometheus"] == {"url": lab.prometheus, "answering": True}
    return lab.prometheus


@pytest.mark.slurm_matrix
def test_a_run_was_scraped_while_it_trained(lab, prometheus, tiny_baseline):
    run_id, run_dir = tiny_baseline["run_id"], Path(tiny_baseline["run_dir"])
    assert not list((Path(lab.shared_dir) / "monitoring" / "targets").glob(f"{run_id}*.json"))  # gone with the run
    steps = query(prometheus, f'ft_run_step{{run="{run_id}"}}[1h]')
    assert steps, f"Prometheus kept no ft_run_step of {run_id}"
    labels = steps[0]["metric"]
    assert labels["job"] == "ft-runs" and labels["cluster"] == "lab" and labels["slurm_job"] == tiny_baseline["job_id"]
    assert labels["run"] == run_id and labels["user"] == getpass.getuser()  # Slurm's word (run_targets.py)
    assert not any(name.startswith("exported_") for name in labels)  # no label of ours renamed
    samples = [(float(at), float(step)) for at, step in steps[0]["values"]]
    assert all(1 <= step <= 120 for _, step in samples)
    first_step = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["time"]
    # Reported, not asserted (timings belong in benchmarks): the lab scrapes every 5 s.
    print(f"{run_id}: first step at {first_step:.1f}, first scraped {samples[0][0] - first_step:.1f} s later, "
          f"{len(samples)} samples")
    exposed = {series["metric"]["__name__"] for series in query(prometheus, f'{{run="{run_id}"}}[1h]')}
    assert {"ft_run_info", "ft_run_step", "ft_run_loss", "ft_run_learning_rate", "ft_run_tokens_per_second",
            "ft_run_step_seconds", "ft_run_tokens_total", "ft_node_heartbeat_age_seconds",
            "ft_run_last_step_timestamp_seconds", "ft_run_restarts_total"} <= exposed, exposed


def test_the_clusters_nodes_and_queues_are_scraped(lab, prometheus):
    nodes = {node.name for node in lab.nodes}

    def every_node_up():
        found = query(prometheus, "ft_node_up")
        return found if nodes <= {series["metric"]["node"] for series in found} else None

    up = wait_for("ft_node_up of every lab node", every_node_up, timeout=60, interval=1)
    assert all(series["metric"]["job"] == "ft-cluster" for series in up)
    assert query(prometheus, "ft_cluster_slurm_up")[0]["value"][1] == "1"
    # Another lab slice's partitions are no tier of the site profile's: they carry no tier label.
    tiers = {series["metric"].get("tier") for series in query(prometheus, "ft_queue_pending_jobs")}
    assert {"free", "standard", "premium"} <= tiers
    rules = json.loads(urllib.request.urlopen(f"{prometheus}/api/v1/rules", timeout=10).read())["data"]["groups"]
    assert {"ft-runs", "ft-cluster"} <= {group["name"] for group in rules}  # ft's alert rules are loaded


DASHBOARDS = Path(__file__).resolve().parents[2] / "monitoring" / "dashboards"


def test_every_dashboard_panel_returns_data_for_a_real_run(lab, prometheus, tiny_baseline):
    """Each panel's query, as Grafana would send it for the time the run trained (its variable set
    to the run), answered by the lab's Prometheus with data."""
    run_id = tiny_baseline["run_id"]
    times = [json.loads(line)["time"] for line in
             (Path(tiny_baseline["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    empty = []
    for board in sorted(DASHBOARDS.glob("*.json")):
        for panel in json.loads(board.read_text())["panels"]:
            for target in panel["targets"]:
                expr = target["expr"].replace("$run", run_id).replace("$user", getpass.getuser())
                if not query_range(prometheus, expr, times[0] - 2, times[-1] + 10):
                    empty.append(f"{board.name}: {panel['title']}: {expr}")
    assert empty == []


def clusters(rows: list[int], gap: int = 12) -> list[list[int]]:
    """Runs of rows with no more than `gap` rows between them."""
    found: list[list[int]] = []
    for row in rows:
        if found and row - found[-1][-1] <= gap:
            found[-1].append(row)
        else:
            found.append([row])
    return found


def test_the_run_report_shows_its_plots_in_a_real_browser(tiny_baseline, tmp_path):
    """`ft report` on the session's real run, rendered by Chromium's headless shell (Debian's; it may
    reach nothing: every name resolves to nowhere). The screenshot shows the curves and the timeline:
    rows of the series' colour in separate bands, each curve drawn across its chart."""
    from PIL import Image

    from tests.support.training import ft
    from toolkit.report.charts import LINE, MARGIN_LEFT, MARGIN_RIGHT, WIDTH

    page = tmp_path / "report.html"
    made = ft("report", tiny_baseline["run_id"], "-o", str(page), runs_dir=Path(tiny_baseline["run_dir"]).parent)
    assert made.returncode == 0, made.stderr
    shot = tmp_path / "report.png"
    browser = subprocess.run(["chromium-headless-shell", "--headless", "--no-sandbox", "--disable-gpu",
                              "--no-first-run", "--disable-background-networking", "--disable-component-update",
                              "--host-resolver-rules=MAP * ~NOTFOUND", f"--screenshot={shot}",
                              "--window-size=800,1400", page.as_uri()],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert shot.exists(), browser.stderr[-2000:]
    image = Image.open(shot).convert("RGB")
    colour = tuple(int(LINE[i:i + 2], 16) for i in (1, 3, 5))
    pixels = image.load()
    width, height = image.size
    near = {(x, y) for y in range(height) for x in range(width)
            if all(abs(pixels[x, y][i] - colour[i]) < 40 for i in range(3))}
    bands = clusters(sorted({y for _, y in near}))
    assert len(bands) >= 3, f"expected the loss and throughput curves and the timeline, found {len(bands)} bands"
    for band in bands[:2]:  # the two curves: each drawn across most of its chart's width
        xs = [x for x, y in near if band[0] <= y <= band[-1]]
        assert max(xs) - min(xs) > 0.6 * (WIDTH - MARGIN_LEFT - MARGIN_RIGHT), (band[0], band[-1], min(xs), max(xs))


def published_targets(prometheus: str) -> Path:
    """The file Prometheus reads the runs from (its ft-runs job's file_sd), as its configuration says."""
    import yaml

    with urllib.request.urlopen(f"{prometheus}/api/v1/status/config", timeout=10) as answer:
        config = yaml.safe_load(json.loads(answer.read())["data"]["yaml"])
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "ft-runs"]
    (files,) = [sd["files"] for sd in job["file_sd_configs"]]
    return Path(files[0])


def test_prometheus_scrapes_a_run_only_under_slurms_word_of_who_it_is(lab, prometheus, tmp_path):
    """The claims folder is every user's (like runs/). A claim is scraped only when Slurm runs its job
    for the file's owner at the address's host, for the run the file names, and labelled with Slurm's
    word: a file naming another user's job, another host, another run, a job that does not run, or
    with labels of its own, changes nothing; nor does a job whose batch script, as Slurm holds it,
    is not ft's (a plain `sleep` whose comment names a run). A published job is scraped per scope:
    its run's own series, and each of its nodes' under Slurm's node name. The exporter that checks
    them runs as its own unprivileged user, a Slurm operator (it reads other users' batch scripts)."""
    import os
    import pwd
    import uuid

    from tests.support.prometheus import active_targets
    from tests.support.slurm import cancel, hostnames, job_fields

    bob = "ftlab-bob"
    if bob not in lab.users:
        pytest.fail(f"the lab has no account {bob}: bring it up again with `ft lab up`")
    account = pwd.getpwnam(bob)
    tag = uuid.uuid4().hex[:8]
    partition = os.environ.get("FT_TEST_PARTITION", "standard")
    # A script of ft's shape (header naming his run, ending by handing over to ft's job controller);
    # and a plain `sleep` whose comment names a run too.
    script = Path(lab.shared_dir) / "tests" / f"bobs-{tag}.sbatch"  # where bob may read it
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(f"#!/bin/bash\n# ft job script: run bobs-{tag} of recipe tiny on cluster lab.\nsleep 300\n"
                      "exec python3 -m toolkit.job\n")
    script.chmod(0o644)
    jobs = []
    for argv in ([str(script)], ["--wrap=sleep 300"]):
        submitted = subprocess.run(["runuser", "-u", bob, "--", "sbatch", "--parsable", f"--partition={partition}",
                                    f"--comment=ft-run=bobs-{tag}", "--output=/dev/null", *argv],
                                   capture_output=True, text=True, cwd="/tmp", timeout=60)
        assert submitted.returncode == 0, submitted.stderr
        jobs.append(submitted.stdout.strip().split(";")[0])
    job, plain = jobs
    claims = Path(lab.shared_dir) / "monitoring" / "targets"
    made: list[Path] = []

    def claim(name: str, address: str, owner: int, labels: dict | None = None) -> None:
        path = claims / name
        path.write_text(json.dumps([{"targets": [address], **({"labels": labels} if labels else {})}]))
        os.chown(path, owner, owner)
        made.append(path)

    try:
        host = wait_for(f"bob's job {job} to start", lambda: job_fields(job).get("BatchHost")
                        if job_fields(job).get("JobState") == "RUNNING" else None, timeout=60)
        claim(f"bobs-{tag}.{job}.json", f"{host}:9", account.pw_uid)  # his, for his job: scraped, as his
        claim(f"bobs-{tag}.{job}-0000000a.json", f"{host}:10", 0)  # another user's file naming his job
        claim(f"bobs-{tag}.{job}-0000000b.json", "127.0.0.1:11", account.pw_uid)  # not his job's host
        claim(f"alices-run.{job}.json", f"{host}:13", account.pw_uid)  # not the run his job runs
        claim(f"bobs-{tag}.{job}-0000000c.json", f"{host}:14", account.pw_uid, labels={  # labels of its own
            "run": "alices-run", "user": "ftlab-alice", "__metrics_path__": "/admin/steal"})
        claim(f"nojob-{tag}.999999.json", f"{host}:12", account.pw_uid)  # no such job
        plain_host = wait_for(f"bob's plain job {plain} to start", lambda: job_fields(plain).get("BatchHost")
                              if job_fields(plain).get("JobState") == "RUNNING" else None, timeout=60)
        claim(f"bobs-{tag}.{plain}.json", f"{plain_host}:15", account.pw_uid)  # his, but his job is not ft's

        def bobs_target():
            return next((t for t in active_targets(prometheus) if t["labels"].get("slurm_job") == job
                         and t["labels"].get("scope") == "job"), None)

        target = wait_for("Prometheus to scrape bob's claim", bobs_target, timeout=60, interval=1)
        ours = [t for t in active_targets(prometheus) if t["labels"]["job"] == "ft-runs" and
                t["discoveredLabels"]["__address__"].rsplit(":", 1)[-1] in {"9", "10", "11", "12", "13", "14", "15"}]
        nodes = hostnames(job_fields(job)["NodeList"])
    finally:
        cancel(job, plain)
        script.unlink(missing_ok=True)
        for path in made:
            path.unlink(missing_ok=True)
    assert {t["discoveredLabels"]["__address__"] for t in ours} == {f"{host}:9"}
    assert sorted(t["labels"].get("node", "") for t in ours) == sorted(["", *nodes])  # the run's, each node's
    assert target["scrapeUrl"] == f"http://{host}:9/metrics?scope=job"
    assert target["labels"] == {"instance": f"{host}:9", "job": "ft-runs", "run": f"bobs-{tag}", "user": bob,
                                "slurm_job": job, "scope": "job"}
    published = published_targets(prometheus)
    exporter = pwd.getpwuid(published.stat().st_uid).pw_name
    assert exporter not in {"root", bob} and published.parent.stat().st_uid == published.stat().st_uid
    said = {line.split("': ", 1)[0].rsplit("/", 1)[-1]: line.split("': ", 1)[1]
            for line in (published.parent.parent / "ft-cluster-metrics.log").read_text().splitlines()
            if line.startswith("not published: ") and (tag in line or f".{job}." in line)}
    assert "owned by root" in said[f"bobs-{tag}.{job}-0000000a.json"]
    assert "names host '127.0.0.1'" in said[f"bobs-{tag}.{job}-0000000b.json"]
    assert f"names run alices-run; job {job} runs bobs-{tag}" in said[f"alices-run.{job}.json"]
    assert "the one shape a claim has" in said[f"bobs-{tag}.{job}-0000000c.json"]
    assert f"is not ft's job script of run bobs-{tag}" in said[f"bobs-{tag}.{plain}.json"]
