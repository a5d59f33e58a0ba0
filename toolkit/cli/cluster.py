"""`ft cluster …`: the user's cluster profiles (~/.config/ft/clusters.yaml): add one from what the
login node discovers, change a field, prepare the compute nodes' training environment."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from toolkit.cli.output import console, plain, print_json, task_spinner
from toolkit.errors import UsageError

app = typer.Typer(help="Cluster profiles: add (discovered), ls, show, set, prepare.", no_args_is_help=True)


def _ask(question: str, choices: list[str], interactive: bool) -> str | None:
    if not interactive:
        return None
    shown = f" ({', '.join(choices)})" if choices else ""
    return typer.prompt(f"{question}{shown}", default=choices[0] if choices else None) or None


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
    from toolkit.cluster.profile import save_user_entry, user_profiles_path
    from toolkit.cluster.propose import Answers, check_name, propose

    check_name(name)
    tiers = {}
    for item in tier:
        key, sep, value = item.partition("=")
        if not sep or not value:
            raise UsageError(f"--tier {item!r}: expected TIER=PARTITION[:QOS]", hint="e.g. --tier standard=gpu:normal")
        tiers[key] = value
    with task_spinner("discovering") as on_task:
        on_task("asking Slurm (sinfo, scontrol, sacctmgr)")
        found = discover()
    if not found.slurm_version and not extends:
        raise UsageError(f"Slurm does not answer on this host: {found.unread.get('slurm', '')}",
                         hint="run ft cluster add on the cluster's login node (Slurm's tools loaded)")
    answers = Answers(shared_root=shared_root, account=account, tiers=tiers, extends=extends,
                      gpus_per_node=gpus_per_node, cpu_workers_per_node=cpu_workers_per_node, fabric=fabric,
                      s3_prefix=s3_prefix, s3_endpoint=s3_endpoint, price_per_gpu_hour=price)
    proposal = propose(found, answers)
    interactive = not yes and not json_out and sys.stdin.isatty()
    for missing in list(proposal.missing):
        if missing == "shared_root":
            value = _ask("Shared filesystem folder for runs, checkpoints and the training environment",
                         found.shared_candidates, interactive)
            if value:
                proposal.set("shared_root", value.rstrip("/"), "asked")
        elif missing == "default_account":
            value = _ask("Slurm account", found.accounts, interactive)
            if value:
                proposal.set("default_account", value, "asked")
        if missing in proposal.body:
            proposal.missing.remove(missing)
    if proposal.missing:
        flags = {"shared_root": "--shared-root DIR" + (f" (candidates: {', '.join(found.shared_candidates)})"
                                                       if found.shared_candidates else ""),
                 "default_account": f"--account ({', '.join(found.accounts)})", "tiers": "--tier standard=PARTITION"}
        raise UsageError(f"cannot write profile {name}: {', '.join(proposal.missing)} not discovered",
                         hint="give " + "; ".join(flags[m] for m in proposal.missing))
    profile = save_user_entry(name, proposal.body, replace=force)
    if json_out:
        print_json({"profile": profile.model_dump(mode="json"), "sources": proposal.sources,
                    "discovered": found.to_dict(), "file": str(user_profiles_path())})
        return
    from rich.table import Table

    table = Table(title=f"cluster profile {name} ({plain(user_profiles_path())})", title_justify="left")
    table.add_column("field")
    table.add_column("value")
    table.add_column("from", style="dim")
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


@app.command("ls")
def list_profiles(json_out: bool = typer.Option(False, "--json")) -> None:
    """Every cluster profile ft knows: built in, this site's, yours."""
    from toolkit.cluster.profile import available_profiles, default_profile_name, read_user_entries

    profiles, mine, default = available_profiles(), read_user_entries(), default_profile_name()
    rows = [{"name": name, "yours": name in mine, "default": name == default, "shared_root": p.shared_root,
             "environment": p.environment or "site", "gpus_per_node": p.gpus_per_node}
            for name, p in sorted(profiles.items())]
    if json_out:
        print_json(rows)
        return
    from rich.table import Table

    table = Table()
    for column in ("name", "source", "shared root", "environment", "GPUs/node"):
        table.add_column(column)
    for row in rows:
        source = "yours" if row["yours"] else "built in / site"
        table.add_row(plain(row["name"]) + (" (default)" if row["default"] else ""), source,
                      plain(row["shared_root"]), row["environment"], str(row["gpus_per_node"]))
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


@app.command("set")
def set_fields(
    name: str = typer.Argument(...),
    changes: list[str] = typer.Argument(..., help="FIELD=VALUE; nested with dots: tiers.standard.partition=gpu"),
) -> None:
    """Change fields of one of your profiles (a built-in or site profile gets an entry of yours that
    extends it)."""
    import yaml

    from toolkit.cluster.profile import load_profile, read_user_entries, save_user_entry

    entry = read_user_entries().get(name)
    resolved = load_profile(name).model_dump(mode="json")
    body = dict(entry) if entry is not None else {"extends": name}
    for change in changes:
        path, sep, raw = change.partition("=")
        keys = path.split(".")
        if not sep or not all(keys):
            raise UsageError(f"{change!r}: expected FIELD=VALUE", hint="e.g. default_account=research")
        value = yaml.safe_load(raw) if raw else ""
        if len(keys) == 1:
            body[keys[0]] = value
            continue
        top = body.get(keys[0], resolved.get(keys[0]))
        top = dict(top) if isinstance(top, dict) else {}
        node = top
        for key in keys[1:-1]:
            node[key] = dict(node.get(key) or {})
            node = node[key]
        node[keys[-1]] = value
        body[keys[0]] = top
    save_user_entry(name, body, replace=True)
    console.print(f"profile {plain(name)} updated: " + plain(", ".join(changes)))


@app.command()
def prepare(
    name: str = typer.Argument(None, help="Cluster profile (default: this site's)."),
    container: str = typer.Option(None, "--container", help="Use this image (it holds ft[train]) instead of a venv."),
    runtime: str = typer.Option("pyxis", "--runtime", help="Container runtime, with --container."),
    base_python: str = typer.Option("python3", "--base-python", help="The compute nodes' Python for the venv."),
    online: bool = typer.Option(False, "--online", help="Let the compute node use the package index too."),
    keep_old: bool = typer.Option(False, "--keep-old", help="Keep your earlier environments of this cluster."),
    timeout_minutes: int = typer.Option(60, "--timeout-minutes", min=1),
) -> None:
    """Prepare the compute nodes' training environment: a venv on the shared filesystem built by a
    short job on a compute node, from wheels this login node gathers (compute nodes need no
    internet); or, with --container, an image with ft[train] (pyxis/enroot sites). The profile
    records which, and rendered scripts run the matching interpreter."""
    from toolkit.cluster import prepare as env
    from toolkit.cluster.profile import load_profile, read_user_entries, save_user_entry

    profile = load_profile(name)
    entry = dict(read_user_entries().get(profile.name) or {"extends": profile.name})
    if container:
        entry.update({"environment": "container", "container_runtime": runtime, "container_image": container,
                      "python": ""})
        save_user_entry(profile.name, entry, replace=True)
        console.print(f"profile {plain(profile.name)}: jobs run ft inside {plain(container)} ({plain(runtime)}); "
                      f"`ft doctor --cluster {plain(profile.name)}` checks that the image holds it")
        return
    with task_spinner(f"preparing {profile.name}") as on_task:
        python = env.prepare_venv(profile, base_python=base_python, offline=not online, on_state=on_task,
                                  timeout_s=timeout_minutes * 60)
    previous = profile.python if profile.environment == "venv" else ""
    entry.update({"environment": "venv", "python": str(python)})
    save_user_entry(profile.name, entry, replace=True)
    # The venv recorded before may still run a queued or running job: kept until the next prepare.
    kept = {python.parent.parent} | ({Path(previous).parent.parent} if previous else set())
    removed = [] if keep_old else env.prune(env.env_place(profile), kept)
    console.print(f"profile {plain(profile.name)}: jobs run {plain(python)} (ft {plain(env.ready_build(str(python)))})"
                  + (f"; removed {len(removed)} older environment(s)" if removed else ""))
    console.print(f"next: [bold]ft doctor --cluster {plain(profile.name)}[/]")
