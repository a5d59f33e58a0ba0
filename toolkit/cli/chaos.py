"""`ft chaos`: break a running run on the lab on purpose, to see what ft does about it."""

from __future__ import annotations

import typer

from toolkit.cli.output import console, plain

app = typer.Typer(help="Break a running run on the local lab on purpose (root): see what ft does.",
                  no_args_is_help=True)

RUN = typer.Argument(..., help="The run (see `ft ls`).")
RANK = typer.Option(1, "--rank", "-r", help="Which rank.")


@app.command()
def hang(run_id: str = RUN, rank: int = RANK) -> None:
    """Stop a rank (SIGSTOP), as a rank stuck in a driver call would hang."""
    from toolkit.lab.chaos import hang_rank, run_folder

    found = hang_rank(run_folder(run_id), rank)
    console.print(f"rank {rank} (pid {found.pid} on {plain(found.node)}) stopped")


@app.command()
def kill(run_id: str = RUN, rank: int = RANK) -> None:
    """Kill a rank (SIGKILL)."""
    from toolkit.lab.chaos import kill_rank, run_folder

    found = kill_rank(run_folder(run_id), rank)
    console.print(f"rank {rank} (pid {found.pid} on {plain(found.node)}) killed")


@app.command()
def crash(run_id: str = RUN, rank: int = RANK,
          batch_host: bool = typer.Option(False, "--batch-host", help="The node of the job script instead "
                                          "(a requeue, whatever the spares).")) -> None:
    """Crash the node a rank runs on, as a power loss would (`ft lab up` brings it back)."""
    from toolkit.lab.chaos import crash_batch_host, crash_rank_node, run_folder

    if batch_host:
        console.print(f"{plain(crash_batch_host(run_folder(run_id)))} (the job's batch host) crashed")
        return
    found = crash_rank_node(run_folder(run_id), rank)
    console.print(f"{plain(found.node)} (running rank {rank}) crashed")


@app.command("gpu-bad")
def gpu_bad(run_id: str = RUN, rank: int = RANK) -> None:
    """A GPU of the node a rank runs on falls off the bus: the node's health check drains it."""
    from toolkit.lab.chaos import fail_gpu, run_folder

    found, device = fail_gpu(run_folder(run_id), rank)
    console.print(f"{plain(found.node)} (running rank {rank}) lost GPU {plain(device.name)}: its health check "
                  "drains it within seconds; `ft lab up` puts the GPU back")


@app.command("gpu-xid")
def gpu_xid(run_id: str = RUN, rank: int = RANK,
            code: int = typer.Option(94, "--code", help="The XID: 94 asks for a restart, 79 for a drain.")) -> None:
    """An XID in the kernel log of the node a rank runs on: its health check acts on it."""
    from toolkit.health.actions import XID
    from toolkit.lab.chaos import gpu_xid as record_xid
    from toolkit.lab.chaos import run_folder

    found = record_xid(run_folder(run_id), rank, code)
    meaning, action = XID.get(code, ("not in ft's table", "warn"))
    console.print(f"{plain(found.node)} (running rank {rank}) logged XID {code} ({meaning}): its health check "
                  f"acts on it within seconds ({action})")


@app.command("disk-full")
def disk_full(run_id: str = RUN,
              seconds: float = typer.Option(30.0, "--seconds", min=1, help="How long the disk stays full.")) -> None:
    """Fill the filesystem a run checkpoints to, for a while: its saves fail, its training goes on.
    Only a small filesystem made for it (a tmpfs named in the recipe's checkpoint.staging)."""
    import signal
    import time

    from toolkit.lab.chaos import checkpoint_disk_full, run_folder

    def interrupted(signum, _frame):  # TERM or HUP as Ctrl-C: the space is given back on the way out
        raise KeyboardInterrupt

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, interrupted)
    run_dir = run_folder(run_id)
    with checkpoint_disk_full(run_dir) as folder, console.status(f"{plain(str(folder))} is full for {seconds:.0f} s"):
        time.sleep(seconds)
    console.print(f"{plain(str(folder))} has room again")
