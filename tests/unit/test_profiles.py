"""Cluster profiles: built in, this site's file (from ft's Ansible), and the user's own."""

from __future__ import annotations

import os

import pytest
import yaml

from toolkit.cluster.profile import ProfileError, available_profiles, default_profile_name, load_profile


def test_builtin_profiles():
    assert {"lab", "hyperpod", "coreweave", "oci"} <= set(available_profiles())
    assert load_profile("hyperpod").srun_extra_args == ["--auto-resume=1"]
    assert load_profile("lab").distributed_backend == "gloo"
    assert load_profile("oci").distributed_backend == "nccl"
    assert default_profile_name() == "lab"  # no site file


def test_unknown_profile_suggests_the_nearest(monkeypatch):
    with pytest.raises(ProfileError) as raised:
        load_profile("hyperpd")
    assert "did you mean 'hyperpod'?" in raised.value.hint


def test_site_file_names_the_default_and_overrides_builtin_values(tmp_path, monkeypatch):
    site = tmp_path / "cluster.yaml"
    site.write_text(yaml.safe_dump({"name": "oci", "shared_root": "/mnt/lustre/ours", "price_per_gpu_hour": 7.5}))
    monkeypatch.setenv("FT_SITE_PROFILE", str(site))
    assert default_profile_name() == "oci"
    profile = load_profile(None)
    assert profile.shared_root == "/mnt/lustre/ours" and profile.price_per_gpu_hour == 7.5
    assert profile.fabric == "roce"  # the rest from the built-in profile


def test_a_site_file_from_an_older_ft_profile_role_still_loads(tmp_path, monkeypatch):
    site = tmp_path / "cluster.yaml"  # slurm_cluster and gpu_model: written once, never read
    site.write_text(yaml.safe_dump({"name": "oci", "slurm_cluster": "oci", "gpu_model": "h100"}))
    monkeypatch.setenv("FT_SITE_PROFILE", str(site))
    assert load_profile(None).name == "oci"
    site.write_text(yaml.safe_dump({"name": "oci", "gpu_modle": "h100"}))  # a typo is still an error
    with pytest.raises(ProfileError, match="gpu_modle"):
        load_profile(None)


def test_user_profile_extends_a_builtin(tmp_path, monkeypatch):
    user = tmp_path / "clusters.yaml"
    user.write_text(yaml.safe_dump({"mylab": {"extends": "hyperpod", "tiers": {
        "free": {"partition": "cheap"}, "standard": {"partition": "gpu"}, "premium": {"partition": "gpu",
                                                                                     "qos": "high"}}}}))
    monkeypatch.setenv("FT_CLUSTERS_FILE", str(user))
    profile = load_profile("mylab")
    assert profile.fabric == "efa" and profile.tiers["premium"].qos == "high"


def test_bad_user_profile_is_located(tmp_path, monkeypatch):
    user = tmp_path / "clusters.yaml"
    user.write_text(yaml.safe_dump({"x": {"extends": "lab", "gpus_per_node": "many"}}))
    monkeypatch.setenv("FT_CLUSTERS_FILE", str(user))
    with pytest.raises(ProfileError, match=r"clusters.yaml \(x\): cluster profile field gpus_per_node"):
        load_profile("x")


@pytest.mark.parametrize("field,value", [("name", "lab\n#SBATCH --wrap=id"), ("fabric", "efa$(id)"),
                                         ("default_account", "a b"), ("tiers", {"standard": {"partition": "p\nx"}}),
                                         ("tiers", {"standard": {"partition": "p", "qos": "q;id"}})])
def test_profile_strings_that_would_reach_an_sbatch_line_are_checked(tmp_path, monkeypatch, field, value):
    clusters = tmp_path / "clusters.yaml"
    name = value if field == "name" else "mine"  # a user profile's name is its key
    clusters.write_text(yaml.safe_dump({name: {"extends": "lab"} | ({} if field == "name" else {field: value})}))
    monkeypatch.setenv("FT_CLUSTERS_FILE", str(clusters))
    with pytest.raises(ProfileError) as raised:
        load_profile(name)
    assert str(clusters) in str(raised.value)


def test_the_profile_is_its_parts_each_typed_beside_its_reader():
    """One flat file section (the format users write is unchanged), made of the parts each reader
    needs: every field belongs to exactly one part, and a reader of one part takes that part alone."""
    from toolkit.account.prices import PriceSite
    from toolkit.checkpoint.cadence import CadenceSite
    from toolkit.cluster.profile import ClusterProfile, base_profiles
    from toolkit.receipts.site import MonitoringSite
    from toolkit.recipe.resolve import rank_budget
    from toolkit.slurm.runtime import RuntimeSite
    from toolkit.slurm.site import SchedulerSite
    from toolkit.storage.site import StorageSite

    parts = [SchedulerSite, StorageSite, RuntimeSite, MonitoringSite, PriceSite, CadenceSite]
    owned = [name for part in parts for name in part.model_fields]
    assert len(owned) == len(set(owned))  # no field in two parts
    assert set(ClusterProfile.model_fields) == {*owned, "name"}
    lab = base_profiles()["lab"]
    for part in parts:  # each part's view of a real profile validates on its own
        alone = part.model_validate({name: getattr(lab, name) for name in part.model_fields})
        dumped = lab.model_dump()
        assert alone.model_dump() == {name: dumped[name] for name in part.model_fields}
    scheduler = SchedulerSite(gpus_per_node=0, cpu_workers_per_node=2, memory_per_node_mb=4096,
                              tiers={"standard": {"partition": "cpu"}})
    assert rank_budget(scheduler, 2) == int(4096 * 2**20 / 2 * 0.9)
    assert StorageSite(s3_endpoint="http://127.0.0.1:8333").object_store.endpoint in (
        "http://127.0.0.1:8333", os.environ.get("AWS_ENDPOINT_URL"))
    with pytest.raises(ValueError, match="is not an S3 prefix"):
        StorageSite(s3_prefix="s3://bucket/x?versionId=2")


def test_a_profile_is_shown_name_first_then_part_by_part():
    from toolkit.cluster.profile import ClusterProfile

    fields = list(ClusterProfile.model_fields)
    assert fields[0] == "name" and fields[1] == "gpus_per_node" and fields[-1] == "node_mtbf_hours"
    assert fields.index("tiers") < fields.index("shared_root") < fields.index("fabric") < fields.index("receipts")
