"""The shapes of names a user gives ft or ft gives a run, spelled once: recipes, profiles, the run
store, Slurm's job comment and the site's daemons check them against these."""

from __future__ import annotations

import re

# A recipe's, a profile's or a registry adapter's name: safe in a path, a Slurm field and a metric label.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
# An environment variable's name (the profile's nccl_env, a recipe's env).
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
# A run's id: <recipe name>-<date>-<random>, or one a user chose; a folder name under runs/.
RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,100}$")
# Characters a path on an #SBATCH line cannot carry: sbatch reads those lines without a shell, and
# expands '%' itself.
SBATCH_UNSAFE = "\n\r\"'\\ \t%"


def slurm_name(value: str | None) -> str | None:
    """Slurm names (partitions, QOS, accounts, clusters) reach #SBATCH lines: checked, not quoted,
    by the same rule as a recipe's names."""
    if value is not None and not re.fullmatch(NAME_PATTERN, value):
        raise ValueError(f"{value!r} is not a usable name: 1-63 letters, digits, '.', '_' or '-'")
    return value
