"""The site's daemons, run on its service host (or the controller), never inside a job nor by `ft` on
the login node: the receipt signer (signer.py), the run-target claims Prometheus scrapes
(run_targets.py) and the cluster exporter that publishes them (cluster_metrics.py). Ansible starts
them (roles ft_signer and monitoring); nothing in ft imports this package."""
