"""A rank's training examples: the token cache `ft validate` filled, in the user's cache on the
shared filesystem; built by rank 0 when the run was submitted without validation or the cache was
purged."""

from __future__ import annotations

from pathlib import Path

from toolkit.recipe.schema import Recipe
from toolkit.runs.layout import RunLayout
from toolkit.storage.object_store import ObjectStore
from toolkit.train.data import Example

# The store an s3:// data file is read from in a job: the one its script exports from the cluster
# profile (AWS_ENDPOINT_URL, which ObjectStore reads each time it makes a filesystem).
JOB_STORE = ObjectStore()


def cache_root(shared_root: str, run_dir: Path, warn) -> Path:
    """The user's cache on the shared filesystem; the run's own folder when that may not be used
    (another user made it, say): the run goes on, and only the reuse across runs is lost."""
    from toolkit.base.shared_dirs import SharedFolderError, private_dir, user_cache

    try:
        return user_cache(shared_root)
    except SharedFolderError as exc:
        fallback = private_dir(RunLayout(run_dir).cache)
        warn(f"{exc.message} ({exc.hint}); this run caches in {fallback} instead")
        return fallback


def load_examples(recipe: Recipe, model_path: Path, user_cache: Path, rank: int, dist, log) -> list[Example]:
    """The tokenized training set, every rank."""
    return load_split(recipe, model_path, user_cache, rank, dist, log, recipe.data.train, "train", held_out=False)


def load_eval_sets(recipe: Recipe, model_path: Path, user_cache: Path, rank: int, dist, log):
    """What the evaluation measures (toolkit/train/evaluation.py): the eval file, or the training file's
    held-out share; and the golden set."""
    from toolkit.train.evaluation import EvalSets

    if recipe.data.eval:
        held_out = load_split(recipe, model_path, user_cache, rank, dist, log, recipe.data.eval, "eval", False)
    elif recipe.data.eval_fraction:
        held_out = load_split(recipe, model_path, user_cache, rank, dist, log, recipe.data.train, "train", True)
    else:
        held_out = []
    golden = (load_split(recipe, model_path, user_cache, rank, dist, log, recipe.eval.golden, "golden", False)
              if recipe.eval.golden else [])
    return EvalSets(held_out, golden)


def load_split(recipe: Recipe, model_path: Path, user_cache: Path, rank: int, dist, log, path: str, role: str,
               held_out: bool) -> list[Example]:
    """A data file's tokenized examples (the held-out share of it, or the rest), every rank; rank 0
    checks the cache's digests (or builds it)."""
    from toolkit.data.recipe_data import dataset_key, token_cache
    from toolkit.data.tokenizer import load_length_counter

    counter = load_length_counter(str(model_path))
    try:
        key = dataset_key(recipe, path, counter, role, JOB_STORE)
    except (FileNotFoundError, PermissionError) as exc:  # every rank reads its digest: every rank stops
        from toolkit.runs import exits
        from toolkit.runs.exits import RunEnds

        raise RunEnds(exits.USER_ERROR, f"the {role} data {path} cannot be read ({exc.strerror or exc}): no "
                                        "restart can help; check the path (ft validate)") from None
    cache = token_cache(user_cache)
    if rank == 0 and cache.meta(key) is None:  # the digests, checked once for every rank
        build_cache(recipe, counter, cache, key, path, role)
    dist.barrier()
    dataset = cache.load(key, digests=False)
    if dataset is None:
        raise RuntimeError(f"the tokenized dataset {cache.path(key)} is missing after rank 0 built it")
    examples = [Example(ids, labels) for ids, labels in dataset.examples(held_out=held_out)]
    log(f"{len(examples)} {'held-out ' if held_out else ''}sequences of {role} from the token cache "
        f"{cache.path(key).name}")
    return examples


def build_cache(recipe: Recipe, counter, cache, key: str, path: str | None = None, role: str = "train") -> None:
    """Tokenize a data file the way validation does (a run submitted with --skip-validation)."""
    from toolkit.data.encode import encode_rows, sequences_per_row
    from toolkit.data.readers import open_rows
    from toolkit.data.recipe_data import held_out_fraction
    from toolkit.data.schemas import detect_format
    from toolkit.data.split import is_eval

    data, path = recipe.data, path or recipe.data.train
    rows = [row.data for row in open_rows(path, JOB_STORE)[0] if row.data is not None]
    fmt = data.format if data.format != "auto" else detect_format(rows[0])
    fraction, per_row = held_out_fraction(recipe, role), sequences_per_row(fmt)
    encoded = encode_rows(rows, fmt, counter, data.max_seq_len)
    writer = cache.writer(key)
    for index, row in enumerate(rows):
        held_out = is_eval(row, fraction, recipe.training.seed)
        for ids, labels, _ in encoded[index * per_row:(index + 1) * per_row]:
            writer.add(ids, labels, held_out)
    writer.finish({"key": key, "path": path, "format": fmt, "report": None})


def total_steps(recipe: Recipe, dataset_size: int) -> int:
    """The run's optimizer steps: as given, or the epochs over `dataset_size` units."""
    import math

    training = recipe.training
    if training.steps:
        return training.steps
    return max(1, math.ceil(training.epochs * dataset_size / training.global_batch))
