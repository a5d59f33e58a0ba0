"""The site's receipt key as Ansible makes it (role ft_signer's public_key tasks) and hands it to the
cluster profile (role ft_profile), run for real through ansible-playbook against localhost with
temporary paths: the lab's own playbook is not run here."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

from toolkit.cluster.profile import load_profile
from toolkit.lab.provision import run_playbook
from toolkit.receipts.keys import key_id, load_private_key, raw_public

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(os.geteuid() != 0, reason="ft_profile writes its file as root's")
def test_the_key_is_made_once_and_its_public_half_reaches_the_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the checkout's own toolkit, for the key's command
    monkeypatch.setenv("FT_STATE_HOME", str(tmp_path / "state"))  # the playbook's log
    key, profile = tmp_path / "signing" / "receipt.key", tmp_path / "cluster.yaml"
    playbook = tmp_path / "play.yml"
    playbook.write_text(yaml.safe_dump([{
        "name": "receipt key", "hosts": "localhost", "gather_facts": False,
        "vars": {"ft_signer_key": str(key), "ft_signer_key_host": "localhost", "ft_signer_python": sys.executable,
                 "ft_signer_socket": "/run/ft-signer-test/receipt.sock", "ft_profile_path": str(profile),
                 "ft_profile_name": "lab"},
        "tasks": [{"name": "key", "ansible.builtin.import_role": {"name": "ft_signer", "tasks_from": "public_key"}},
                  {"name": "profile", "ansible.builtin.import_role": {"name": "ft_profile"}}]}]))

    def apply():
        result = run_playbook(str(playbook), inventory="localhost,",
                              extra_vars={"ansible_connection": "local", "ansible_python_interpreter": sys.executable})
        assert result.ok, result.error
        return result

    first = apply()
    assert "ft_signer : The site's receipt key (made once, on the key host)" in first.changed_tasks
    made = key.read_bytes()
    assert key.stat().st_mode & 0o777 == 0o600 and key.parent.stat().st_mode & 0o777 == 0o700
    second = apply()
    assert second.changed_tasks == []  # the key, and so the profile, as they were
    assert key.read_bytes() == made  # never made again

    monkeypatch.setenv("FT_SITE_PROFILE", str(profile))
    receipts = load_profile("lab").receipts
    raw = raw_public(load_private_key(key))
    assert receipts is not None and receipts.key_id == key_id(raw)
    assert receipts.socket == "/run/ft-signer-test/receipt.sock"
    assert "PRIVATE" not in profile.read_text()
