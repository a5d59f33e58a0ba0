"""`ft adapters …` as a user types it (python -m toolkit, in a subprocess): JSON for scripts, exit 2 on
refusals and bad input with nothing changed, a mirror that fails said without failing the command, and
no training stack imported on the login node. The registry is a cluster profile's, whose shared root is
a temporary folder; its mirror, where one is set, an S3 endpoint on loopback where nothing listens."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import yaml

from tests.support.adapters import record, write_adapter
from toolkit.registry.store import Registry

HEAVY = ("torch", "transformers", "peft", "deepspeed", "s3fs")


@pytest.fixture
def site(tmp_path):
    """A profile `mine` whose shared root is a temporary folder; its registry with three versions of
    tiny-lora-sft: two that passed their evaluation, one that did not."""
    (tmp_path / "shared").mkdir()
    profiles = tmp_path / "clusters.yaml"
    profiles.write_text(yaml.safe_dump({"mine": {"extends": "lab", "shared_root": str(tmp_path / "shared"),
                                                 "s3_prefix": "", "s3_endpoint": ""}}))
    registry = Registry.for_shared_root(str(tmp_path / "shared"))
    versions = [registry.register(write_adapter(tmp_path / f"adapter-{seed}", seed), record(passed=seed < 2))
                for seed in range(3)]
    return profiles, registry, versions


def ft(profiles, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolkit", "adapters", *args, "--cluster", "mine"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "FT_CLUSTERS_FILE": str(profiles), **(env or {})})


def test_ls_lists_every_version_and_filters_by_name_and_state(site):
    profiles, registry, versions = site
    listed = json.loads(ft(profiles, "ls", "--json").stdout)
    assert sorted(entry["id"] for entry in listed) == sorted(version.id for version in versions)
    assert {entry["state"] for entry in listed} == {"draft"}
    registry.promote(versions[0].id)
    promoted = json.loads(ft(profiles, "ls", "--state", "promoted", "--json").stdout)
    assert [entry["id"] for entry in promoted] == [versions[0].id]
    assert json.loads(ft(profiles, "ls", "--name", "another", "--json").stdout) == []
    table = ft(profiles, "ls", env={"COLUMNS": "200"})
    assert table.returncode == 0 and versions[0].short_id in table.stdout and "promoted" in table.stdout


def test_show_names_a_version_by_a_prefix_with_its_evaluation_files_and_history(site):
    profiles, registry, versions = site
    registry.promote(versions[0].id, reason="beats the base")
    shown = json.loads(ft(profiles, "show", versions[0].id[:7], "--json").stdout)
    assert shown["id"] == versions[0].id and shown["state"] == "promoted"
    assert shown["eval"]["gates"][0]["name"] == "beats_base"
    assert set(shown["files"]) == {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json",
                                   "tokenizer_config.json"}
    assert shown["serving"].endswith(f"versions/{versions[0].id}/serving.json")
    assert [(move["from"], move["to"], move["reason"]) for move in shown["history"]] == [
        ("draft", "promoted", "beats the base")]
    text = ft(profiles, "show", versions[2].short_id, env={"COLUMNS": "200"})
    assert text.returncode == 0 and "beats_base: failed eval loss 1.70 >= base 1.60" in text.stdout


def test_promote_and_deprecate_say_what_moved(site):
    profiles, _, versions = site
    first = json.loads(ft(profiles, "promote", versions[0].short_id, "--json").stdout)
    assert first["state"] == "promoted" and len(first["transitions"]) == 1
    second = ft(profiles, "promote", versions[1].short_id, "--reason", "better eval", "--json")
    moves = json.loads(second.stdout)["transitions"]
    assert [(move["version"], move["to"]) for move in moves] == [(versions[0].id, "deprecated"),
                                                                 (versions[1].id, "promoted")]
    again = ft(profiles, "promote", versions[1].short_id)
    assert again.returncode == 0 and "was promoted already" in again.stdout
    gone = ft(profiles, "deprecate", versions[1].short_id, "-m", "retired")
    assert gone.returncode == 0 and "promoted -> deprecated (retired)" in gone.stdout


def test_refusals_exit_2_and_change_nothing(site):
    profiles, registry, versions = site
    failed = ft(profiles, "promote", versions[2].short_id)
    assert failed.returncode == 2
    assert f"version {versions[2].short_id} of tiny-lora-sft is never promoted: it failed 1 gate(s)" in failed.stderr
    assert "it stays a draft" in failed.stderr
    assert not registry.layout.log("tiny-lora-sft").exists()
    ft(profiles, "deprecate", versions[0].short_id)
    deprecated = ft(profiles, "promote", versions[0].short_id)
    assert deprecated.returncode == 2 and "it is never promoted again" in deprecated.stderr
    for args, said in ((["show", "nothex"], "is not a version id"), (["show", "0" * 64], "no version 0000"),
                       (["ls", "--state", "live"], "'live' is not one of")):
        result = ft(profiles, *args)
        assert result.returncode == 2 and said in result.stderr, result.stderr
    assert [move.to_state for move in registry.history("tiny-lora-sft").transitions] == ["deprecated"]


def test_a_mirror_that_fails_is_said_and_the_promotion_stands(site, tmp_path):
    profiles, registry, versions = site
    with socket.socket() as probe:  # a loopback port where nothing listens
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mirrored = tmp_path / "mirrored.yaml"
    mirrored.write_text(yaml.safe_dump({"mine": {**yaml.safe_load(profiles.read_text())["mine"],
                                                 "s3_prefix": "s3://ft-test-registry"}}))
    store = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
             "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    promoted = ft(mirrored, "promote", versions[0].short_id, env=store)
    assert promoted.returncode == 0, promoted.stderr
    assert "the log of tiny-lora-sft is not in the mirror s3://ft-test-registry/registry yet" in promoted.stderr
    assert "`ft adapters sync` uploads it" in promoted.stderr
    assert registry.version(versions[0].id).state == "promoted"
    synced = ft(mirrored, "sync", "--json", env=store)
    assert synced.returncode == 1
    problems = json.loads(synced.stdout)["problems"]
    assert "Could not connect" in problems[0] and problems[1].startswith("the store is failing")


def test_the_adapters_commands_never_import_the_training_stack(site):
    profiles, _, versions = site
    for argv in (["ls", "--json"], ["show", versions[0].short_id], ["promote", versions[0].short_id]):
        probe = ("import sys\nfrom toolkit.cli.app import app\n"
                 f"sys.argv = ['ft', 'adapters', *{argv!r}, '--cluster', 'mine']\n"
                 "try:\n    app()\nexcept (SystemExit, Exception):\n    pass\n"
                 f"print('HEAVY=' + ','.join(m for m in {HEAVY!r} if m in sys.modules))\n")
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                                env={**os.environ, "FT_CLUSTERS_FILE": str(profiles)})
        assert "HEAVY=\n" in result.stdout, result.stdout + result.stderr
