"""Promotions at once, from separate processes (as from several login nodes and jobs: the lock is a
flock on the shared filesystem): exactly one version ends promoted, every promotion is in the log, in
an order that replays without a gap, and promoted.json names the last one."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.support.adapters import record, write_adapter
from toolkit.registry.states import State
from toolkit.registry.store import Registry

PROCESSES = 8
PROMOTE = """
import json, os, sys, time
from pathlib import Path
from toolkit.registry.store import Registry
root, version, go = sys.argv[1:]
while not os.path.exists(go):  # all start together
    time.sleep(0.001)
change = Registry(Path(root), common=True).promote(version, reason=f"process {os.getpid()}")
print(json.dumps([move.to_dict() for move in change.transitions]))
"""


def test_concurrent_promotions_of_one_name_end_with_exactly_one_promoted(tmp_path):
    (tmp_path / "shared").mkdir()
    registry = Registry.for_shared_root(str(tmp_path / "shared"))
    versions = [registry.register(write_adapter(tmp_path / f"adapter-{seed}", seed), record()).id
                for seed in range(PROCESSES)]
    go = tmp_path / "go"
    repo = Path(__file__).resolve().parents[2]
    workers = [subprocess.Popen([sys.executable, "-c", PROMOTE, str(registry.layout.root), version, str(go)],
                                cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for version in versions]
    time.sleep(0.5)  # every interpreter started and waiting
    go.touch()
    results = [worker.communicate(timeout=120) for worker in workers]
    assert [worker.returncode for worker in workers] == [0] * PROCESSES, [err for _, err in results]

    history = registry.history("tiny-lora-sft")
    assert history.skipped == []  # every line whole, each following from those before
    promotions = [move for move in history.transitions if move.to_state == State.promoted]
    assert sorted(move.version for move in promotions) == sorted(versions)  # nothing lost
    assert len(history.transitions) == 2 * PROCESSES - 1  # each later one superseded the one before
    last = promotions[-1].version
    states = {version.id: version.state for version in registry.versions()}
    assert [version for version, state in states.items() if state == State.promoted] == [last]
    assert sorted(version for version, state in states.items() if state == State.deprecated) == \
        sorted(set(versions) - {last})
    pointer = json.loads(registry.layout.promoted("tiny-lora-sft").read_text())
    assert pointer["version"] == last
    # What each process says it wrote is what the log holds.
    written = sorted(json.dumps(move, sort_keys=True) for out, _ in results for move in json.loads(out))
    assert written == sorted(move.to_json() for move in history.transitions)
