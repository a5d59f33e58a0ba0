"""`ft doctor`: whether this user's setup of a cluster can run ft, and the command that fixes each
thing that is wrong (toolkit/doctor/)."""

from __future__ import annotations

import typer

from toolkit.cli.output import console, plain, print_json, task_spinner

MARK = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "blocker": "[bold red]BLOCKER[/]"}


def doctor(
    cluster: str = typer.Option(None, "--cluster", "-c", help="Cluster profile (default: this site's)."),
    nodes: int = typer.Option(2, "--nodes", min=1, help="Compute nodes the preflight step runs on."),
    login_only: bool = typer.Option(False, "--login-only", help="Skip the preflight step on compute nodes."),
    wait: int = typer.Option(120, "--wait", min=1, help="Seconds the preflight step may wait for nodes."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Check a cluster profile from the login node and, through a short preflight step, from compute
    nodes: Slurm, partitions, QOS, account, GPUs as GRES, the shared root on every node, ft and the
    training stack on compute nodes (the same ft as here), NCCL's variables, the object store, W&B.
    Exits 1 when anything blocks a run."""
    from toolkit.cluster.discover import discover
    from toolkit.cluster.profile import load_profile
    from toolkit.doctor.login import login_checks, slurm_answers
    from toolkit.doctor.preflight import compute_checks

    profile = load_profile(cluster)
    with task_spinner(f"doctor {profile.name}") as on_task:
        on_task("asking Slurm")
        found = discover()
        findings = login_checks(profile, found)
        if not login_only and slurm_answers(found):
            on_task(f"preflight step on {nodes} compute node(s)")
            findings += compute_checks(profile, nodes=nodes, wait_s=wait)
    blockers = [f for f in findings if f.level == "blocker"]
    if json_out:
        print_json({"cluster": profile.name, "ok": not blockers, "findings": [f.to_dict() for f in findings]})
    else:
        from rich.table import Table

        console.print(f"[bold]ft doctor[/]: cluster {plain(profile.name)}")
        table = Table(box=None, show_header=False, pad_edge=False)
        for column in ("mark", "check", "finding"):
            table.add_column(column, overflow="fold", no_wrap=column != "finding")
        for f in findings:
            where = "" if f.where == "login" else f" [dim](on {plain(f.where)})[/]"
            fix = f"\n[cyan]fix:[/] {plain(f.fix)}" if f.fix else ""
            table.add_row(MARK.get(f.level, plain(f.level)), f.check, plain(f.detail) + where + fix)
        console.print(table)
        console.print(f"[bold red]{len(blockers)} blocker(s)[/]: fix them before `ft submit`" if blockers
                      else "[green]ready[/]: `ft submit RECIPE --cluster " + plain(profile.name) + "`")
    if blockers:
        raise typer.Exit(1)
