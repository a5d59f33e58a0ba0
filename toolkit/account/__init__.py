"""Who used what: GPU-hours per run, user, account and tier, from Slurm's accounting (toolkit/account/usage.py)."""
