"""The watchdog's parts, inside every job: the per-node launchers heartbeat to the supervisor on the
batch host (heartbeat.py), which notices a lost node within seconds (not Slurm's SlurmdTimeout);
each launcher notices its own dead or hung ranks (progress.py, stacks.py); silence.py keeps a lost
node down, requeue.py asks Slurm to requeue, metrics.py serves a run's metrics. The supervisor that
puts them together is the job's (toolkit/job/supervise.py). No torch here: it runs beside the
training. (supervise.py here is only the entry an older job script runs.)"""
