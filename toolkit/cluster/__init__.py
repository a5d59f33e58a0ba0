"""Cluster profiles: what ft must know about a site to write a good job script for it."""
