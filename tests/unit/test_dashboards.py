"""The Grafana dashboards in monitoring/dashboards: well-formed, their variables defined, their
queries naming only metrics ft exposes. tests/lab/test_monitoring.py runs every query against the
lab's Prometheus during a real run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
BOARDS = sorted((MONITORING / "dashboards").glob("*.json"))
# Every ft_ metric a run's exporter (toolkit/watch/metrics.py, gpus.py) and the site's cluster exporter
# (toolkit/services/cluster_metrics.py) document.
DOCUMENTED = set(re.findall(r"\b(ft_[a-z_]+)", "".join(
    (MONITORING.parent / "toolkit" / name).read_text()
    for name in ("watch/metrics.py", "watch/gpus.py", "services/cluster_metrics.py"))))


@pytest.mark.parametrize("board", BOARDS, ids=lambda path: path.name)
def test_a_dashboard_is_well_formed_and_asks_only_for_ft_metrics(board):
    data = json.loads(board.read_text())
    variables = {variable["name"] for variable in data["templating"]["list"]}
    ids = [panel["id"] for panel in data["panels"]]
    assert data["uid"] == board.stem and len(ids) == len(set(ids)) and ids
    for panel in data["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\$(\w+)", target["expr"]))
            assert used <= variables, (panel["title"], used - variables)
            assert set(re.findall(r"\b(ft_[a-z_]+)", target["expr"])) <= DOCUMENTED, panel["title"]


def test_three_dashboards_and_their_provisioning():
    assert [board.name for board in BOARDS] == ["ft-cluster.json", "ft-run.json", "ft-tiers.json"]
    import yaml

    providers = yaml.safe_load((MONITORING / "grafana" / "dashboards.yml").read_text())["providers"]
    sources = yaml.safe_load((MONITORING / "grafana" / "datasources.yml").read_text())["datasources"]
    assert providers[0]["type"] == "file" and sources[0]["type"] == "prometheus"
