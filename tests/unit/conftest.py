"""Unit tests see only ft's built-in cluster profiles, whatever this machine's /etc/ft holds."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def builtin_profiles_only(monkeypatch, tmp_path_factory):
    empty = tmp_path_factory.mktemp("no-profiles")
    monkeypatch.setenv("FT_SITE_PROFILE", str(empty / "cluster.yaml"))
    monkeypatch.setenv("FT_CLUSTERS_FILE", str(empty / "clusters.yaml"))
