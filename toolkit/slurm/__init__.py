"""Talking to Slurm: every call goes through `toolkit.slurm.commands`."""
