"""Runs: one directory per run on the shared filesystem, with its recipe, script, jobs and logs
(layout.py names every file in it), the store of runs, their records, timelines and status, and how
a run's processes end (exits.py)."""
