"""The alert rules in monitoring/alerts, checked and unit-tested by Prometheus's own promtool
(Debian's prometheus package, which `ft lab up` installs through ansible/roles/prometheus)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ALERTS = Path(__file__).resolve().parents[2] / "monitoring" / "alerts"
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (`ft lab up` installs it)")


def test_rules_are_valid():
    rules = sorted(str(path) for path in ALERTS.glob("*.rules.yml"))
    checked = subprocess.run([PROMTOOL, "check", "rules", *rules], capture_output=True, text=True)
    assert rules and checked.returncode == 0, checked.stdout + checked.stderr


def test_every_alert_fires_in_its_unit_test_and_the_healthy_series_stay_quiet():
    tests = sorted(str(path) for path in (ALERTS / "tests").glob("*.yml"))
    done = subprocess.run([PROMTOOL, "test", "rules", *tests], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    alerts = {rule["alert"] for path in ALERTS.glob("*.rules.yml")
              for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"] if "alert" in rule}
    fired = {case["alertname"] for path in (ALERTS / "tests").glob("*.yml")
             for test in yaml.safe_load(path.read_text())["tests"] for case in test.get("alert_rule_test", [])
             if case.get("exp_alerts")}
    assert alerts == fired  # every alert has a test in which it fires
