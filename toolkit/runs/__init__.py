"""Runs: one directory per run on the shared filesystem, with its recipe, script, jobs and logs."""
