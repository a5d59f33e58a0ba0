"""sacct's answers for unit tests, written as the rows `sacct --format` would print and turned into the
JSON `sacct --json` gives on the lab's Slurm 22.05 (the shape recorded from it: job_id, name, user,
account, partition, qos, state.current, time.elapsed/start/eligible/end as Unix times, 0 where unset,
tres.allocated as typed counts, comment.job)."""

from __future__ import annotations

import json
from datetime import datetime

COLUMNS = ("job_id", "name", "user", "account", "partition", "qos", "state", "elapsed", "alloc_tres", "start",
           "end", "eligible", "comment")


def unix(text: str) -> int:
    return int(datetime.fromisoformat(text).timestamp()) if text not in ("", "Unknown") else 0


def tres(text: str) -> list[dict]:
    """billing=2,cpu=2,gres/gpu=2,mem=8G,node=2 as Slurm's JSON lists it."""
    found = []
    for item in filter(None, text.split(",")):
        name, _, count = item.partition("=")
        kind, _, sub = name.partition("/")
        count = int(count.rstrip("GM")) * (1024 if count.endswith("G") else 1)
        found.append({"type": kind, "name": sub or None, "id": 0, "count": count})
    return found


def job(row: str) -> dict:
    """One `|`-separated row of COLUMNS (the comment may be left off: none kept)."""
    fields = dict(zip(COLUMNS, row.split("|"), strict=False))
    return {
        "job_id": int(fields["job_id"]), "name": fields["name"], "user": fields["user"],
        "account": fields["account"], "partition": fields["partition"], "qos": fields["qos"],
        "state": {"current": fields["state"].split()[0], "reason": "None"},
        "time": {"elapsed": int(fields["elapsed"]), "start": unix(fields["start"]), "end": unix(fields["end"]),
                 "eligible": unix(fields["eligible"]), "limit": 60, "suspended": 0},
        "tres": {"allocated": tres(fields["alloc_tres"]), "requested": tres(fields["alloc_tres"])},
        "comment": {"administrator": None, "job": fields.get("comment") or None, "system": None},
    }


def sacct_json(rows: str) -> str:
    return json.dumps({"jobs": [job(row) for row in rows.strip().splitlines()]})
