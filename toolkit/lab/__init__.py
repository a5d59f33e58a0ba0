"""ft's local lab: a real multi-node Slurm cluster on one machine, provisioned by ft's Ansible."""
