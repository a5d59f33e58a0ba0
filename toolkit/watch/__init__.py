"""ft's watchdog inside every job: the per-node launchers heartbeat to a supervisor on the batch
host, which notices a lost node within seconds (not Slurm's SlurmdTimeout) and restarts training
from the latest checkpoint inside the same allocation, on a spare node when one is held; each
launcher notices its own dead or hung ranks. No torch here: it runs beside the training."""
