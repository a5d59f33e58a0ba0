"""What every other part of ft stands on, and imports nothing of ft above it: errors, file and
folder safety on the shared filesystem (shared_dirs, cache_entries, privileges), digests, names,
located YAML, and which ft this is (build). Safe on the login node, in a job, and on the site's
service host: nothing here imports a third-party package at module level but PyYAML."""
