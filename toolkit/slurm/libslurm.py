"""The one call ft makes into libslurm itself: ending a job as COMPLETED (or FAILED) from inside it.

A job whose batch host is lost keeps running under --no-kill without its batch script (Slurm
excises the node), and a successor controller takes the script's place in a step
(toolkit/job/successor.py). When the run is done, nothing of Slurm's command line ends such a job
with its own exit code: `scancel` makes it CANCELLED. `slurm_complete_job()`, the call a batch
script's end makes through slurmstepd, does: the job's owner may make it. Loaded from the library
Slurm's own tools link (libslurmfull beside scontrol: Debian ships no unversioned libslurm.so
without its -dev package), else the system's libslurm.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import re
import shutil
import subprocess

from toolkit.base.errors import FtError
from toolkit.slurm.commands import slurm_env


@functools.cache
def library() -> ctypes.CDLL | None:
    """libslurm as scontrol links it; None where it cannot be loaded."""
    for path in candidates():
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        if hasattr(lib, "slurm_complete_job"):
            if hasattr(lib, "slurm_init"):  # 22.05 on: reads slurm.conf once, before any call
                lib.slurm_init.argtypes = [ctypes.c_char_p]
                lib.slurm_init(os.environ.get("SLURM_CONF", "").encode() or None)
            return lib
    return None


def candidates() -> list[str]:
    found = []
    scontrol = shutil.which("scontrol")
    if scontrol:
        try:
            linked = subprocess.run(["ldd", scontrol], capture_output=True, text=True, timeout=10,
                                    env=slurm_env(), check=False).stdout
        except (OSError, subprocess.TimeoutExpired, FtError):
            linked = ""
        found += re.findall(r"=>\s*(\S*libslurm(?:full)?\.so\S*)", linked)
    system = ctypes.util.find_library("slurm")
    return found + ([system] if system else [])


def complete_job(job_id: str, exit_code: int) -> bool:
    """End a running job of this user with `exit_code` (0: COMPLETED, else FAILED) as its batch
    script's end would. False where libslurm is not found or Slurm refused."""
    lib = library()
    if lib is None or not job_id.isdigit():
        return False
    lib.slurm_complete_job.argtypes = [ctypes.c_uint32, ctypes.c_uint32]
    # The return code is a wait status: the exit code in its second byte.
    return lib.slurm_complete_job(int(job_id), (exit_code & 0xFF) << 8) == 0
