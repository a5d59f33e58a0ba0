"""Queries to the lab's Prometheus (its HTTP API), for the lab tests."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request


def query(base: str, promql: str) -> list[dict]:
    return _get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))


def query_range(base: str, promql: str, start: float, end: float, step: str = "1") -> list[dict]:
    return _get(f"{base}/api/v1/query_range?" + urllib.parse.urlencode(
        {"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": step}))


def _get(url: str) -> list[dict]:
    with urllib.request.urlopen(url, timeout=10) as answer:
        body = json.loads(answer.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def active_targets(base: str) -> list[dict]:
    """Prometheus's targets now: each with its labels, its discovered labels and its scrape URL."""
    with urllib.request.urlopen(f"{base}/api/v1/targets?state=active", timeout=10) as answer:
        body = json.loads(answer.read())
    assert body["status"] == "success", body
    return body["data"]["activeTargets"]
