"""`ft cluster …`: the user's cluster profiles (~/.config/ft/clusters.yaml): add one from what the
login node discovers, change or remove one, prepare the compute nodes' training environment."""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path

import typer

from toolkit.base.errors import UsageError
from toolkit.cli.output import console, plain, print_json, task_spinner

app = typer.Typer(help="Cluster profiles: add (discovered), ls, show, set, rm, prepare.", no_args_is_help=True)


def _ask(question: str, choices: list[str], interactive: bool) -> str | None:
    if not interactive:
        return None
    shown = f" ({', '.join(choices)})" if choices else ""
    return typer.prompt(f"{question}{shown}", default=choices[0] if choices else None) or None


def _tier_options(tier: list[str]) -> dict[str, str]:
    tiers = {}
    for item in tier:
        key, sep, value = item.partition("=")
        if not sep or not value:
            raise UsageError(f"--tier {item!r}: expected TIER=PARTITION[:QOS]", hint="e.g. --tier standard=gpu:normal")
        tiers[key] = value
    return tiers


def _ask_missing(proposal, found, interactive: bool) -> None:
    """What discovery could not tell, asked at a terminal; with --yes or no terminal, an error
    naming the flags to give."""
    questions = {"shared_root": ("Shared filesystem folder for runs, checkpoints and the training environment",
                                 found.shared_candidates),
                 "default_account": ("Slurm account", found.accounts)}
    for missing in list(proposal.missing):
        if missing in questions:
            value = _ask(*questions[missing], interactive)
            if value:
                proposal.set(missing, value.rstrip("/") if missing == "shared_root" else value, "asked")
                proposal.missing.remove(missing)
    if proposal.missing:
        flags = {"shared_root": "--shared-root DIR" + (f" (candidates: {', '.join(found.shared_candidates)})"
                                                       if found.shared_candidates else ""),
                 "default_account": f"--account ({', '.join(found.accounts)})", "tiers": "--tier standard=PARTITION"}
        raise UsageError(f"{', '.join(proposal.missing)} not discovered",
                         hint="give " + "; ".join(flags[m] for m in proposal.missing))


def _check_shared_root(body: dict) -> None:
    """A shared root that is not there or not writable is refused now, not at the first job."""
    from toolkit.base.shared_dirs import unusable_root

    root = body.get("shared_root")
    if not root:
        return
    problem = unusable_root(Path(root).expanduser())
    if problem:
        raise UsageError(f"--shared-root {root} {problem}",
                         hint="give a folder on the shared filesystem that you may write (e.g. under your "
                              "project or scratch space), or make it first: mkdir -p " + root)


def _print_proposal(name: str, proposal, found, path) -> None:
    from rich.table import Table

    table = Table(title=f"cluster profile {name} ({plain(path)})", title_justify="left")
    for column in ("field", "value", "from"):
        table.add_column(column, style="dim" if column == "from" else None)
    for field, value in proposal.body.items():
        if field == "tiers":
            value = ", ".join(f"{tier}={target['partition']}" + (f":{target['qos']}" if target.get("qos") else "")
                              for tier, target in value.items())
        table.add_row(field, plain(value), plain(proposal.sources.get(field, "")))
    console.print(table)
    if found.unread:
        console.print("[yellow]not read:[/] " + plain("; ".join(f"{k}: {v}" for k, v in found.unread.items())))
    console.print(f"next: [bold]ft cluster prepare {plain(name)}[/] (the compute nodes' training environment), "
                  f"then [bold]ft doctor --cluster {plain(name)}[/]")


@app.command()
def add(
    name: str = typer.Argument(..., help="A name for this cluster (what --cluster will take)."),
    shared_root: str = typer.Option(None, "--shared-root", help="A folder on the filesystem every node shares."),
    account: str = typer.Option(None, "--account", help="Slurm account (default: your default account)."),
    tier: list[str] = typer.Option([], "--tier", help="TIER=PARTITION[:QOS] (free, standard, premium); repeat."),
    extends: str = typer.Option(None, "--extends", help="Take unset fields from this profile (e.g. lab, hyperpod)."),
    gpus_per_node: int = typer.Option(None, "--gpus-per-node", min=0, help="Default: the partition's GRES."),
    cpu_workers_per_node: int = typer.Option(None, "--cpu-workers-per-node", min=1,
                                             help="Train on CPUs with this many workers per node (gloo)."),
    fabric: str = typer.Option(None, "--fabric", help="efa, infiniband, roce or none (default: guessed)."),
    s3_prefix: str = typer.Option(None, "--s3-prefix", help="s3://bucket/prefix for checkpoint mirrors."),
    s3_endpoint: str = typer.Option(None, "--s3-endpoint", help="An S3-compatible endpoint URL."),
    price: float = typer.Option(None, "--price-per-gpu-hour", min=0),
    yes: bool = typer.Option(False, "--yes", "-y", help="Ask nothing: fail naming what is missing."),
    force: bool = typer.Option(False, "--force", help="Replace a profile of this name."),
    json_out: bool = typer.Option(False, "--json", help="Print the profile and what was discovered as JSON."),
) -> None:
    """Write a cluster profile from what this login node discovers (Slurm version, partitions and
    their limits, GPU GRES, QOS, your accounts, shared filesystems); asks only for the rest."""
    from toolkit.cluster.discover import discover
    from toolkit.cluster.profile import ProfileError, update_user_entry, user_profiles_path
    from toolkit.cluster.propose import Answers, check_name, propose

    check_name(name)
    answers = Answers(shared_root=shared_root, account=account, tiers=_tier_options(tier), extends=extends,
                      gpus_per_node=gpus_per_node, cpu_workers_per_node=cpu_workers_per_node, fabric=fabric,
                      s3_prefix=s3_prefix, s3_endpoint=s3_endpoint, price_per_gpu_hour=price)
    with task_spinner("discovering") as on_task:
        on_task("asking Slurm (sinfo, scontrol, sacctmgr)")
        found = discover()
    if not found.slurm_version and not extends:
        raise UsageError(f"Slurm does not answer on this host: {found.unread.get('slurm', '')}",
                         hint="run ft cluster add on the cluster's login node (Slurm's tools loaded)")
    proposal = propose(found, answers)
    _ask_missing(proposal, found, interactive=not yes and not json_out and sys.stdin.isatty())
    _check_shared_root(proposal.body)

    def write(entry: dict | None) -> dict:
        if entry is not None and not force:
            raise ProfileError(f"{user_profiles_path()} already has a profile {name!r}",
                               hint=f"`ft cluster set {name} FIELD=VALUE` changes it; --force replaces it")
        return proposal.body

    profile = update_user_entry(name, write)
    if json_out:
        print_json({"profile": profile.model_dump(mode="json"), "sources": proposal.sources,
                    "discovered": found.to_dict(), "file": str(user_profiles_path())})
    else:
        _print_proposal(name, proposal, found, user_profiles_path())


def environment_label(profile) -> str:
    if profile.environment == "venv":
        return "venv"
    if profile.in_container:
        return f"container {profile.container_image}"
    return "site: " + (profile.python or "this login's python")


@app.command("ls")
def list_profiles(json_out: bool = typer.Option(False, "--json")) -> None:
    """Every cluster profile ft knows: built in, this site's, yours (and yours that are broken)."""
    from toolkit.cluster.profile import default_profile_name, load_all, read_user_entries

    (profiles, errors), mine, default = load_all(), read_user_entries(), default_profile_name()
    rows = [{"name": name, "yours": name in mine, "default": name == default, "shared_root": p.shared_root,
             "environment": environment_label(p), "gpus_per_node": p.gpus_per_node,
             "error": errors[name].message if name in errors else None}
            for name, p in sorted(profiles.items())]
    rows += [{"name": name, "yours": True, "default": False, "error": error.message}
             for name, error in sorted(errors.items()) if name not in profiles]
    if json_out:
        print_json(rows)
        return
    from rich.table import Table

    table = Table()
    for column in ("name", "source", "shared root", "environment", "GPUs/node"):
        table.add_column(column)
    for row in rows:
        if row["error"]:
            table.add_row(plain(row["name"]), "yours", f"[red]broken:[/] {plain(row['error'])}", "", "")
            continue
        table.add_row(plain(row["name"]) + (" (default)" if row["default"] else ""),
                      "yours" if row["yours"] else "built in / site", plain(row["shared_root"]),
                      plain(row["environment"]), str(row["gpus_per_node"]))
    console.print(table)


@app.command()
def show(name: str = typer.Argument(...), json_out: bool = typer.Option(False, "--json")) -> None:
    """One profile, with every field resolved."""
    import yaml

    from toolkit.cluster.profile import load_profile

    data = load_profile(name).model_dump(mode="json")
    if json_out:
        print_json(data)
    else:
        console.print(plain(yaml.safe_dump(data, sort_keys=False).rstrip()))


def typed_value(keys: list[str], raw: str) -> object:
    """FIELD=VALUE's value as the field wants it: text stays text (an account named 12345, a
    partition named 0700, NCCL's values), lists, mappings and numbers are read as YAML."""
    import yaml

    from toolkit.cluster.profile import ClusterProfile

    field = ClusterProfile.model_fields.get(keys[0])
    if keys[0] == "extends" or len(keys) > 1:
        return raw
    if field is None:
        raise UsageError(f"{keys[0]!r} is not a cluster profile field",
                         hint="fields: " + ", ".join(sorted(ClusterProfile.model_fields)))
    origin = typing.get_origin(field.annotation)
    optional_text = origin in (typing.Union, types.UnionType) and str in typing.get_args(field.annotation)
    if field.annotation is str or optional_text or origin is typing.Literal:
        return raw
    try:
        return yaml.safe_load(raw) if raw else None
    except yaml.YAMLError as exc:
        raise UsageError(f"{'.'.join(keys)}={raw!r} is not a valid value: {exc}".splitlines()[0],
                         hint="lists as [a, b], mappings as {key: value}") from None


def apply_change(body: dict, resolved: dict, change: str) -> None:
    path, sep, raw = change.partition("=")
    keys = path.split(".")
    if not sep or not all(keys):
        raise UsageError(f"{change!r}: expected FIELD=VALUE", hint="e.g. default_account=research")
    value = typed_value(keys, raw)
    if len(keys) == 1:
        body[keys[0]] = value
        return
    node = body.get(keys[0], resolved.get(keys[0]))
    if not isinstance(node, dict):
        raise UsageError(f"{change!r}: {keys[0]} is not a mapping here", hint=f"set {keys[0]} as a whole")
    body[keys[0]] = node = dict(node)
    for key in keys[1:-1]:
        child = node.get(key) or {}
        if not isinstance(child, dict):
            raise UsageError(f"{change!r}: {key} is not a mapping", hint=f"set {'.'.join(keys[:-1])} as a whole")
        node[key] = child = dict(child)
        node = child
    node[keys[-1]] = value


@app.command("set")
def set_fields(
    name: str = typer.Argument(...),
    changes: list[str] = typer.Argument(..., help="FIELD=VALUE; nested with dots: tiers.standard.partition=gpu"),
) -> None:
    """Change fields of one of your profiles (a built-in or site profile gets an entry of yours that
    extends it)."""
    from toolkit.cluster.profile import load_profile, update_user_entry

    resolved = load_profile(name).model_dump(mode="json")

    def change(entry: dict | None) -> dict:
        body = dict(entry) if entry is not None else {"extends": name}
        for item in changes:
            apply_change(body, resolved, item)
        return body

    update_user_entry(name, change)
    console.print(f"profile {plain(name)} updated: " + plain(", ".join(changes)))


@app.command("rm")
def remove(name: str = typer.Argument(...)) -> None:
    """Remove one of your profiles (its training environments stay until the next prepare prunes them)."""
    from toolkit.cluster.profile import read_user_entries, update_user_entry, user_profiles_path

    if name not in read_user_entries():
        raise UsageError(f"{user_profiles_path()} has no profile {name!r}", hint="yours: ft cluster ls")
    update_user_entry(name, lambda entry: None)
    console.print(f"profile {plain(name)} removed")


@app.command()
def prepare(
    name: str = typer.Argument(None, help="Cluster profile (default: this site's)."),
    container: str = typer.Option(None, "--container", help="Use this image (it holds ft[train]) instead of a venv."),
    base_python: str = typer.Option("python3", "--base-python", help="The compute nodes' Python for the venv."),
    online: bool = typer.Option(False, "--online", help="Let the compute node use the package index too."),
    keep_old: bool = typer.Option(False, "--keep-old", help="Keep your earlier environments of this cluster."),
    timeout_minutes: int = typer.Option(60, "--timeout-minutes", min=5, max=1440),
) -> None:
    """Prepare the compute nodes' training environment: a venv on the shared filesystem built by a
    short job on a compute node, from wheels this login node gathers (compute nodes need no
    internet); or, with --container, an image with ft[train] (pyxis sites). The profile records
    which, and rendered scripts run the matching interpreter."""
    from toolkit.cluster import prepare as env
    from toolkit.cluster.profile import load_profile, update_user_entry

    profile = load_profile(name)
    if container:
        fields = {"environment": "container", "container_runtime": "pyxis", "container_image": container,
                  "python": ""}
        update_user_entry(profile.name, lambda entry: {**(entry or {"extends": profile.name}), **fields})
        console.print(f"profile {plain(profile.name)}: jobs run ft inside {plain(container)} (pyxis); "
                      f"`ft doctor --cluster {plain(profile.name)}` checks that the image holds it")
        return
    with task_spinner(f"preparing {profile.name}") as on_task:
        python = env.prepare_venv(profile, base_python=base_python, offline=not online, on_state=on_task,
                                  timeout_minutes=timeout_minutes)
    previous = profile.python if profile.environment == "venv" else ""
    # A venv runs on the host it was built on: an image the profile inherits is not used.
    fields = {"environment": "venv", "python": str(python), "container_runtime": "", "container_image": ""}
    update_user_entry(profile.name, lambda entry: {**(entry or {"extends": profile.name}), **fields})
    console.print(f"profile {plain(profile.name)}: jobs run {plain(python)} (ft {plain(env.ready_build(python))})")
    if not keep_old:
        kept, removed = env.prune(env.env_place(profile), python, previous)
        if removed:
            console.print(f"removed {len(removed)} older environment(s) of this profile")
        if kept:
            console.print(f"kept {len(kept)} older environment(s): jobs of yours are queued or running "
                          "(the next prepare prunes them)")
    console.print(f"next: [bold]ft doctor --cluster {plain(profile.name)}[/]")
