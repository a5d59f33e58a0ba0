"""`ft model …`: models in the cluster's object store, which jobs fetch into the shared cache once
per cluster and copy to node-local disk once per node (toolkit/models/cache.py)."""

from __future__ import annotations

import re
from pathlib import Path

import typer

from toolkit.base.errors import FtError, UsageError
from toolkit.cli.output import console, plain, task_spinner

app = typer.Typer(help="Models in the cluster's object store (profile s3_models).", no_args_is_help=True)


@app.command()
def push(
    folder: Path = typer.Argument(..., help="A whole model folder: config.json, safetensors weights, tokenizer."),
    name: str = typer.Option(..., "--name", help="The id recipes name in model.base (org/name), @revision to pin"),
    cluster: str = typer.Option(None, "--cluster", "-c", help="Cluster profile (default: this site's)."),
) -> None:
    """Upload a model to the cluster's object store, files first and its manifest (sha256 of each
    file) last: until the manifest is there no job takes it. Then record on the shared filesystem who
    pushed which manifest (toolkit/models/records.py): jobs take only that one, and nobody else may
    push the same name."""
    from toolkit.checkpoint import manifest
    from toolkit.checkpoint.remote import put_folder
    from toolkit.cluster.profile import load_profile
    from toolkit.models.cache import entry_name
    from toolkit.models.folder import model_folder_problems

    profile = load_profile(cluster)
    if not profile.s3_models:
        raise UsageError(f"cluster profile {profile.name} has no s3_models",
                         hint="set s3_models: s3://bucket/prefix in the profile (Ansible: ft_profile_s3_models)")
    from pydantic import ValidationError

    from toolkit.recipe.schema import ModelSpec

    base, _, revision = name.partition("@")
    try:
        ModelSpec(base=base, revision=revision or None)  # the revision rule recipes follow
        named = bool(re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._@+-]{0,250}", entry_name(base, revision or None)))
    except ValidationError:
        named = False
    if not named:
        raise UsageError(f"--name {name!r} is not a model id", hint="use org/name, or org/name@revision")
    problems = model_folder_problems(folder)
    if problems:
        raise FtError(f"{folder} is not a whole model folder: {'; '.join(problems)}",
                      hint="push a folder that loads with transformers' from_pretrained (safetensors weights)")
    from toolkit.models import records as model_records

    entry = entry_name(base, revision or None)
    record = model_records.claim(profile.shared_root, entry)  # another user's name: refused before any upload
    url = f"{profile.s3_models.rstrip('/')}/{entry}"
    filesystem, key = profile.object_store.filesystem(url)
    with task_spinner("model push") as on_task:
        on_task("hashing the files")
        described = manifest.describe(folder, 0, "")
        on_task(f"uploading {described.total_bytes / 1e6:.0f} MB")
        try:
            put_folder(filesystem, folder, described, key)
        except Exception as exc:  # noqa: BLE001 - the store's trouble: named, with where it was going
            raise FtError(f"uploading to {url} failed: {type(exc).__name__}: {exc}",
                          hint="check the object store and its credentials (AWS_* in the environment)") from None
        model_records.write(record, entry, described.to_json().encode())  # what put_folder uploaded last
    console.print(f"pushed {len(described.files)} files, {described.total_bytes / 1e6:.0f} MB, to {plain(url)}; "
                  f"recipes use it as model.base: {plain(base)}" + (f", model.revision: {plain(revision)}"
                                                                    if revision else ""), soft_wrap=True)
