"""A rank's side of checkpoints (the tiers are toolkit/checkpoint/): save (a snapshot, written in the
background: toolkit/train/snapshot.py), resume (the newest copy that verifies, from whichever tier has
it), and the end of the run (the last write waited for, the last upload for a bounded time)."""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from toolkit.checkpoint import manifest
from toolkit.checkpoint.cadence import Cadence
from toolkit.checkpoint.manifest import lineage_of, step_of, tag_for
from toolkit.checkpoint.mirror import Mirror
from toolkit.checkpoint.remote import RemoteProblem, RemoteTier, mirror_url
from toolkit.checkpoint.seal import Sealer
from toolkit.checkpoint.shared import SharedTier
from toolkit.checkpoint.status import StatusBoard
from toolkit.storage.object_store import ObjectStore, within
from toolkit.train.snapshot import BackgroundWriter, SnapshotEngine

# How long a resume may spend listing the object store before it settles for the shared copy.
REMOTE_LIST_WAIT_S = 60.0
# How long the end of a run waits for its last upload; a stop on request (preemption: Slurm's grace
# time is short) waits less, and the next start's mirror uploads what was left.
END_UPLOAD_WAIT_S, STOP_UPLOAD_WAIT_S = 300.0, 10.0


@dataclass
class Tiers:
    shared: SharedTier
    remote: RemoteTier | None


class Checkpointer:
    def __init__(self, tiers: Tiers, engine, dist, rank: int, world: int, progress, log: Callable[[str], None],
                 frozen_excluded: bool, lineage: str, asynchronous: bool, board: StatusBoard,
                 cadence: Cadence | None = None,
                 before_file: Callable[[], None] = lambda: None, run_dir: Path | None = None):
        self.tiers, self.engine, self.dist, self.rank = tiers, engine, dist, rank
        self.run_dir = run_dir if rank == 0 else None  # where each whole checkpoint is recorded (receipt)
        self.progress, self.log, self.frozen_excluded, self.lineage = progress, log, frozen_excluded, lineage
        self.board = board
        self.mirror = Mirror(tiers.remote, tiers.shared, board, log, before_file=before_file) \
            if rank == 0 and tiers.remote else None
        zipfile = bool(getattr(getattr(engine, "checkpoint_engine", None), "zipfile_serialization", True))
        self.writer = BackgroundWriter(tiers.shared, rank, world, lineage, zipfile, self._published, log,
                                       asynchronous, before_file)
        self.snapshots = SnapshotEngine(self.writer, defer_copy=engine.device.type == "cpu")
        engine.checkpoint_engine = self.snapshots
        self.last_save = time.monotonic()
        self.seconds, self.written = 0.0, 0  # the time training stood still for saves, and how many
        self.cadence = cadence or Cadence()  # when to save (toolkit/checkpoint/cadence.py)
        self.stalls: list[float] = []
        self.told = ""

    def _published(self, published: manifest.Manifest) -> None:
        self.board.published(published.step)
        self.log(f"checkpoint step {published.step} written to {self.tiers.shared}")
        if self.run_dir:
            from toolkit.receipts import entries as receipt_entries

            receipt_entries.checkpoint(self.run_dir, published.step,
                                       self.tiers.shared.root / tag_for(published.step) / manifest.MANIFEST)
        if self.mirror:
            self.mirror.offer(published)

    # -- resume ---------------------------------------------------------------------------------

    def resume(self) -> int:
        """Load the newest checkpoint that verifies, from any tier; the step it holds (0: a fresh start)."""
        chosen = [self._choose() if self.rank == 0 else None]
        self.dist.broadcast_object_list(chosen, src=0)
        tag, source = chosen[0] or (None, None)
        if tag:
            self.engine.load_checkpoint(str(self.tiers.shared.root), tag=tag, load_module_strict=False)
            self.log(f"resumed from checkpoint {tag} (from {source})")
        if self.mirror:  # a checkpoint resumed from the shared copy may never have reached the store
            from_shared = tag and source == str(self.tiers.shared)
            self.mirror.start(manifest.read(self.tiers.shared.root / tag) if from_shared else None)
        self.last_save = time.monotonic()  # the time cadence counts from the start of training
        self._tell_cadence()
        return step_of(tag) if tag else 0

    def _choose(self) -> tuple[str, str] | None:
        """Rank 0: the checkpoint to resume from, brought to the shared filesystem when only the
        object store has it (downloaded, verified, then renamed into place)."""
        warn = lambda message: self.log(f"warning: {message}")  # noqa: E731
        shared = self.tiers.shared
        best = shared.newest_whole(self.lineage, warn)
        best_step = step_of(best) if best else 0
        for tag in self._remote_tags(warn):
            if step_of(tag) <= best_step:
                break
            try:
                self._restore(tag)
                return tag, str(self.tiers.remote)
            except RemoteProblem as exc:
                warn(f"checkpoint {tag} in {self.tiers.remote} is unusable ({exc}); trying the one before")
            except Exception as exc:  # noqa: BLE001 - the store's trouble, whatever its kind: the shared copy is taken
                # The store itself failing (not one damaged tag): an older tag would fail the same way.
                warn(f"could not fetch checkpoint {tag} from {self.tiers.remote} ({type(exc).__name__}: {exc})")
                break
        return (best, str(shared)) if best else None

    def _remote_tags(self, warn) -> list[str]:
        if self.tiers.remote is None:
            return []
        answer = within(self.tiers.remote.tags, REMOTE_LIST_WAIT_S)
        if not answer.in_time or answer.error:
            why = f"{type(answer.error).__name__}: {answer.error}" if answer.error else "no answer"
            warn(f"{self.tiers.remote} is unreachable ({why}): resuming from the shared filesystem only")
            return []
        return answer.value

    def _restore(self, tag: str) -> None:
        shared = self.tiers.shared
        shared.staging.mkdir(parents=True, exist_ok=True)
        landing = shared.staging / f"restore-{tag}"
        shutil.rmtree(landing, ignore_errors=True)
        started = time.monotonic()
        described = self.tiers.remote.download(tag, landing, self.lineage)
        shared.adopt(landing, tag)
        self.log(f"fetched checkpoint {tag} from {self.tiers.remote} ({described.total_bytes / 1e6:.0f} MB in "
                 f"{time.monotonic() - started:.1f} s, verified)")

    # -- save -----------------------------------------------------------------------------------

    def before_optimizer_step(self) -> None:
        """The last save's copy is taken before the optimizer changes the state (CPU training takes it
        in the background); the wait, if any, is training's pause for that save."""
        waited = self.snapshots.wait_copied()
        if waited:
            self.seconds += waited
            self.stalls[-1] += waited

    def since_last_save(self) -> float:
        return time.monotonic() - self.last_save

    def due_by_steps(self, step: int) -> bool:
        return self.cadence.steps_due(step)

    def due_by_clock(self) -> bool:
        """Whether this rank's clock says save (the loop has the ranks agree on it). Asked every step:
        without a clock (the default) it measures nothing."""
        return self.cadence.on_clock and self.cadence.clock_due(self.since_last_save(), self.save_cost(),
                                                                self.writer.last_write_s)

    def save_cost(self) -> float | None:
        """Training's pause per save, the median of the last five (None before the first)."""
        return statistics.median(self.stalls[-5:]) if self.stalls else None

    def _tell_cadence(self) -> None:
        told = self.cadence.describe(self.save_cost(), self.writer.last_write_s)
        if self.rank != 0 or told is None:
            return
        if told.split(":")[0] != self.told.split(":")[0]:  # the interval changed (to the 0.1 min)
            self.log(f"checkpoint cadence (auto): {told}")
        self.told = told

    def save(self, step: int) -> None:
        """Snapshot the state and return; the write goes on in the background."""
        started = time.monotonic()
        self.progress.report("save", step)
        waited = self.settle_previous()  # the previous save's write, if still going: saves never overlap
        if waited > 0.5:
            self.log(f"waited {waited:.1f} s for checkpoint writes before saving step {step}: checkpoints come "
                     "faster than the filesystem takes them (checkpoint.every_steps / every_minutes)")
        if self.rank == 0:
            self.tiers.shared.prepare()
        self.dist.barrier()
        self.engine.save_checkpoint(str(self.tiers.shared.staging), tag=tag_for(step), save_latest=False,
                                    exclude_frozen_parameters=self.frozen_excluded)
        self.last_save = time.monotonic()
        self.progress.report("step", step)  # the save is over: the hang rule's step clock again, from now
        self.seconds += self.last_save - started
        self.stalls.append(self.last_save - started)
        self.written += 1
        self.log(f"checkpoint step {step}: training paused {self.last_save - started:.2f} s"
                 + (" (the write goes on in the background)" if self.writer.asynchronous else ""))
        self._tell_cadence()

    def settle_previous(self) -> float:
        """Every rank: its part of the last save written; then (a barrier) rank 0's publish of it,
        which gives up at once on a part that is missing now, since it will never come. Seconds
        waited."""
        started = time.monotonic()
        self.writer.wait_marked()
        self.dist.barrier()
        self.writer.ranks_done.set()
        self.writer.wait()
        return time.monotonic() - started

    def close(self, upload_wait: float, together: bool = True) -> None:
        """The end of this process's checkpoints: the last write waited for, the last upload for at
        most `upload_wait` seconds. `together`: every rank closes (after which rank 0 has published);
        not after a failure, when another rank may never come."""
        if together:
            self.settle_previous()
        self.writer.close(abandon_unpublished=not together)
        if self.mirror:
            self.mirror.close(upload_wait)


def staging_folder(staging: str | None) -> Path | None:
    """The recipe's checkpoint.staging, made the user's alone (0700) or found theirs: a folder another
    user made there first would read and move the run's checkpoints. None: the run's own folder."""
    if not staging:
        return None
    from toolkit.base.errors import FtError
    from toolkit.base.shared_dirs import folder_problem, private_dir
    from toolkit.runs import exits
    from toolkit.runs.exits import RunEnds

    path = Path(staging)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Every folder above it too, as it really is: the owner of any of them (a link to another
        # user's folder on the way) could swap the run's folder for one of theirs mid-run.
        real = Path(os.path.realpath(path.parent))
        for folder in (real, *real.parents):
            problem = folder_problem(folder)
            if problem:
                raise FtError(f"{folder} {problem}")
        return private_dir(real / path.name)
    except (OSError, FtError) as exc:
        raise RunEnds(exits.USER_ERROR, f"checkpoint.staging {path} cannot hold this run's checkpoints: {exc}") \
            from None


def owners_sealer(shared_root: str, scope: str) -> Sealer:
    """The run's owner's seal (toolkit/checkpoint/seal.py), from their key on the cluster's shared root.
    A run that cannot seal stops before training: it could not tell its checkpoints from planted ones."""
    from toolkit.base.errors import FtError
    from toolkit.runs import exits
    from toolkit.runs.exits import RunEnds

    try:
        return Sealer.for_shared_root(shared_root, scope)
    except (OSError, ValueError, FtError) as exc:
        raise RunEnds(exits.USER_ERROR, f"cannot read or make your checkpoint key ({exc}): it proves which "
                      f"checkpoints are yours (toolkit/checkpoint/seal.py)") from None


def checkpointer_for(layout, spec, engine, dist, progress, log: Callable[[str], None],
                     before_file: Callable[[], None] = lambda: None, store: ObjectStore | None = None) -> Checkpointer:
    """A rank's checkpointer, from the run spec (the recipe's mirror, or the cluster's s3_prefix) and
    `store` (by default the job's: AWS_ENDPOINT_URL, which its script exports from the profile, and
    the credentials of its environment)."""
    recipe = spec.recipe
    rank, world = dist.get_rank(), dist.get_world_size()
    url = mirror_url(recipe.checkpoint.s3_mirror, spec.site.s3_prefix,
                     os.environ.get("FT_RUN_ID") or layout.root.name)
    # Rank 0 publishes, mirrors and chooses: its seals are for this run's mirror (every run of a recipe
    # naming the same checkpoint.s3_mirror shares it, and continues from it).
    sealer = owners_sealer(spec.site.shared_root, url or "") if rank == 0 else None
    shared = SharedTier(staging_folder(recipe.checkpoint.staging) or layout.checkpoints, recipe.checkpoint.keep_last,
                        sealer=sealer)
    remote = (RemoteTier(url, recipe.checkpoint.keep_last, (store or ObjectStore()).filesystem(url)[0], sealer=sealer,
                         lineage=lineage_of(recipe)) if url else None)
    board = StatusBoard(layout.checkpoint_status if rank == 0 else None, url)

    def history() -> tuple[int, float]:
        from toolkit.runs.timeline import timeline

        spent = timeline(layout.root) or {}  # what this run met so far, over its requeues and restarts
        return len(spent.get("faults", [])), float(spent.get("wall_s", 0.0))

    cadence = Cadence.of(recipe.checkpoint.every_steps, recipe.checkpoint.every_minutes, spec.derived.job_mtbf_hours,
                         history)
    return Checkpointer(Tiers(shared, remote), engine, dist, rank, world, progress, log,
                        frozen_excluded=recipe.method.kind != "full", lineage=lineage_of(recipe),
                        asynchronous=recipe.checkpoint.asynchronous, board=board,
                        cadence=cadence,
                        before_file=before_file, run_dir=layout.root)
