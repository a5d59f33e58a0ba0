"""The part of a cluster profile (toolkit/cluster/profile.py) that says how a job's steps start on
the nodes: the network fabric and NCCL's settings for it, a container through pyxis, environment
modules, srun's own options, and the interpreter that runs ft there (`ft cluster prepare`)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from toolkit.base.names import ENV_NAME_PATTERN


class RuntimeSite(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fabric: str = "none"
    nccl_env: dict[str, str] = {}
    container_runtime: str = ""
    container_image: str = ""
    modules: list[str] = []
    srun_extra_args: list[str] = []
    # How the compute nodes get ft and the training stack (`ft cluster prepare`):
    #   ""         the site's: ft installed where the login node's interpreter also runs (the lab,
    #              an admin's shared install); jobs run the login node's Python unless `python` says
    #   venv       a venv on the shared filesystem, built on a compute node; `python` is its interpreter
    #   container  `container_image` holds ft[train]; jobs run `python` (default python3) inside it
    environment: Literal["", "venv", "container"] = ""
    python: str = ""

    @field_validator("fabric")
    @classmethod
    def fabric_name(cls, value: str) -> str:
        if not re.fullmatch(r"[a-z0-9_-]{1,32}", value):
            raise ValueError(f"{value!r} is not a fabric name (efa, infiniband, roce, none...)")
        return value

    @field_validator("nccl_env")
    @classmethod
    def env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not re.fullmatch(ENV_NAME_PATTERN, name, re.ASCII):
                raise ValueError(f"{name!r} is not a valid environment variable name")
        return value

    @field_validator("python")
    @classmethod
    def python_path(cls, value: str) -> str:
        if value and any(ch in value for ch in "\n\r\0"):
            raise ValueError(f"{value!r}: an interpreter path is one line")
        return value

    @field_validator("container_runtime")
    @classmethod
    def known_runtime(cls, value: str) -> str:
        if value not in ("", "pyxis"):
            raise ValueError(f"{value!r}: ft runs containers through pyxis (srun --container-image); '' for none")
        return value

    @model_validator(mode="after")
    def container_has_image(self):
        if self.environment == "container" and not (self.container_runtime and self.container_image):
            raise ValueError("environment 'container' needs container_runtime (pyxis) and container_image")
        if self.environment == "venv" and not self.python:
            raise ValueError("environment 'venv' needs python: the venv's interpreter (`ft cluster prepare` sets it)")
        return self

    def training_python(self, login_python: str) -> str:
        """The interpreter a job runs ft with on the compute nodes: the recorded one, else the
        image's python3 inside a container (the login node's path does not exist there), else the
        login node's own (an install the compute nodes share)."""
        if self.python:
            return self.python
        return "python3" if self.in_container else login_python

    def batch_python(self, login_python: str) -> str:
        """The interpreter of the job script's own steps on the batch host (registering the run, the
        watchdog, the requeue helper): pyxis puts only srun's steps in the container, so there it is
        the login node's install, which must sit on a filesystem the compute nodes share."""
        return login_python if self.in_container else (self.python or login_python)

    @property
    def in_container(self) -> bool:
        """Whether srun's steps run in the profile's image: a venv of its own (`ft cluster prepare`
        on a profile that extends a container one) runs on the host, where it was built."""
        return self.environment != "venv" and bool(self.container_runtime and self.container_image)
