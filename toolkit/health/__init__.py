"""Node health: light checks of a compute node's GPUs, its checkpoint filesystem and its memory,
each finding mapped to an action by one table (toolkit/health/actions.py). Run by Slurm's
HealthCheckProgram (ft-healthcheck) as `python -m toolkit.health`; no torch, well under Slurm's 60 s."""
