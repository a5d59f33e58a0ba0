"""The storage part of a cluster profile (toolkit/cluster/profile.py): ft's folder on the shared
filesystem, and the site's object store (its endpoint, the checkpoint and registry prefix, the
models). What data, checkpoints, models and the registry are reached through."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, field_validator

from toolkit.base.names import SBATCH_UNSAFE
from toolkit.storage.object_store import ObjectStore, parse_s3_url


class StorageSite(BaseModel):
    model_config = ConfigDict(extra="forbid")

    shared_root: str = ""
    s3_prefix: str = ""
    # Where the site keeps models in its object store: <s3_models>/<org>--<name>[@revision]/ with ft's
    # manifest (`ft model push`). Fetched into the shared cache once per cluster.
    s3_models: str = ""
    # An S3-compatible endpoint (MinIO, SeaweedFS, a site's gateway); empty: AWS S3 itself.
    # AWS_ENDPOINT_URL in the environment overrides it.
    s3_endpoint: str = ""

    @field_validator("shared_root")
    @classmethod
    def shared_root_path(cls, value: str) -> str:
        # Run directories live under it and reach #SBATCH lines, which sbatch reads without a shell
        # and where it expands '%' itself.
        if value and (not value.startswith(("/", "~")) or any(ch in value for ch in SBATCH_UNSAFE)):
            raise ValueError(f"{value!r}: the shared root is an absolute path without spaces, quotes or '%'")
        return value

    @field_validator("s3_prefix", "s3_models")
    @classmethod
    def s3_prefix_url(cls, value: str) -> str:
        if value:
            parse_s3_url(value, "an S3 prefix")
        return value

    @field_validator("s3_endpoint")
    @classmethod
    def endpoint_url(cls, value: str) -> str:
        if value and not re.fullmatch(r"https?://[A-Za-z0-9.:\[\]_-]+(/[A-Za-z0-9._~/-]*)?", value):
            raise ValueError(f"{value!r} is not an http(s):// endpoint URL (scheme, host, optional port and path)")
        return value

    @property
    def object_store(self) -> ObjectStore:
        """The site's object store, as every part of ft reaches it."""
        return ObjectStore(self.s3_endpoint)
