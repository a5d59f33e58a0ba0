"""Base models on the cluster: the cache tiers a job loads from (node-local disk, the shared
filesystem, the site's object store), what a whole model folder is, and who pushed which model."""
