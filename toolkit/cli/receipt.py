"""`ft receipt verify RUN` and `ft receipt show RUN`: a run's signed, hash-linked receipt (toolkit/receipts).

verify exits 0 when the receipt verifies, 3 when it does not (each finding listed: an entry changed,
removed, inserted or reordered; a signature missing, another key's or over another chain; a file
changed or missing), 2 on a usage error (no such run), 1 when ft cannot check (a broken profile)."""

from __future__ import annotations

import json
from datetime import datetime

import typer

from toolkit.cli.output import console, plain, print_json
from toolkit.runs.layout import RunLayout

app = typer.Typer(help="A run's signed, hash-linked receipt: what it used and made.", no_args_is_help=True)


def _run_dir(run_id: str, cluster: str | None):
    """The run's folder, and the cluster profile whose signer key checks its receipt."""
    from toolkit.cluster.profile import load_profile
    from toolkit.runs.store import RunNotFound, RunStore

    profile = load_profile(cluster)
    store = RunStore.for_shared_root(profile.shared_root)
    run_dir = store.run_dir(run_id)
    if not run_dir.is_dir():
        raise RunNotFound(f"no run {run_id!r} in {store.root}", hint="see `ft ls`")
    return run_dir, profile


@app.command()
def verify(run_id: str = typer.Argument(...), cluster: str = typer.Option(None, "--cluster", "-c"),
           as_json: bool = typer.Option(False, "--json")) -> None:
    """Check every entry, the signature and every recorded file; exit 3 unless all hold."""
    from toolkit.receipts import verify as receipts

    run_dir, profile = _run_dir(run_id, cluster)
    verdict = receipts.verify(run_dir, profile.receipts)
    if as_json:
        print_json(verdict.to_dict())
    else:
        signed = verdict.signed
        by = (f"; signed with key {plain(signed['key_id'])} for {plain(signed['user'])}'s job {plain(signed['job_id'])}"
              f" at {_when(signed['signed_at'])}" if signed else "")
        state = "[green]verified[/]" if verdict.verified else f"[bold red]NOT verified[/] ({len(verdict.findings)} " \
                                                              f"finding{'s' * (len(verdict.findings) != 1)})"
        console.print(f"receipt of run [bold]{plain(run_id)}[/]: {verdict.entries} entries{by}: {state}",
                      soft_wrap=True)
        for finding in verdict.findings:
            console.print(f"  {plain(finding)}", soft_wrap=True)
        if verdict.vouched:
            console.print(f"  {plain(verdict.vouched['says'])}", soft_wrap=True)
        pruned = [note for note in verdict.notes if "may be pruned" in note]
        if pruned:  # keep_last at work: said once, not a line per checkpoint
            console.print(f"  [dim]note: {len(pruned)} recorded checkpoint manifest(s) since pruned, as "
                          "checkpoint.keep_last allows (--json lists them)[/]", soft_wrap=True)
        for note in verdict.notes:
            if note not in pruned:
                console.print(f"  [dim]note: {plain(note)}[/]", soft_wrap=True)
    if not verdict.verified:
        raise typer.Exit(receipts.FAILED_EXIT)


@app.command()
def show(run_id: str = typer.Argument(...), cluster: str = typer.Option(None, "--cluster", "-c"),
         as_json: bool = typer.Option(False, "--json")) -> None:
    """Print a run's receipt as recorded (nothing checked: `ft receipt verify` checks)."""
    run_dir, _ = _run_dir(run_id, cluster)
    entries, signature = _recorded(RunLayout(run_dir))
    if as_json:
        print_json({"run_id": run_id, "entries": entries, "signature": signature})
        return
    from rich.table import Table

    table = Table(title=f"receipt of run {plain(run_id)}", title_justify="left")
    for column in ("seq", "kind", "time", "artifacts", "body"):
        table.add_column(column, overflow="fold")
    for entry in entries:
        if "unreadable" in entry:
            table.add_row("?", "[red]unreadable[/]", "", "", plain(f"line {entry['line']}: {entry['unreadable']}"))
            continue
        body = json.dumps(entry["body"], sort_keys=True)
        table.add_row(plain(entry["seq"]), plain(entry["kind"]), _when(entry["time"]),
                      plain(", ".join(map(str, entry["artifacts"]))), plain(body[:200] + "…" * (len(body) > 200)))
    console.print(table)
    payload = (signature or {}).get("payload")
    console.print(f"signed: {plain(payload['entries'])} entries, key {plain(payload['key_id'])}, for "
                  f"{plain(payload['user'])}'s job {plain(payload['job_id'])} at {_when(payload['signed_at'])}"
                  if isinstance(payload, dict) and {"entries", "key_id", "user", "job_id", "signed_at"} <= set(payload)
                  else "not signed", soft_wrap=True)


def _recorded(layout: RunLayout) -> tuple[list[dict], dict | None]:
    """The receipt's entries as they parse (a line that does not: {line, unreadable}), and its signature."""
    from toolkit.base.errors import FtError
    from toolkit.base.shared_dirs import open_regular
    from toolkit.receipts.chain import parse_entry, read_receipt
    from toolkit.receipts.verify import MAX_SIGNATURE_BYTES

    try:
        data = read_receipt(layout.receipt)
    except FileNotFoundError:
        data = b""
    except OSError as exc:
        raise FtError(f"{layout.receipt} cannot be read: {exc}") from None
    entries = []
    for number, line in enumerate(data.split(b"\n")[:-1] if data.endswith(b"\n") else data.split(b"\n"), 1):
        try:
            entries.append(parse_entry(line))
        except ValueError as exc:
            entries.append({"line": number, "unreadable": str(exc)})
    try:
        with open_regular(layout.receipt_signature) as handle:
            signature = json.loads(handle.read(MAX_SIGNATURE_BYTES + 1))
    except (OSError, ValueError, RecursionError):
        signature = None
    return entries, signature if isinstance(signature, dict) else None


def _when(stamp: object) -> str:
    try:
        return datetime.fromtimestamp(float(stamp)).strftime("%Y-%m-%d %H:%M:%S")
    except (TypeError, ValueError, OverflowError, OSError):
        return plain(stamp)

