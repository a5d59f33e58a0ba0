"""Becoming an unprivileged user for good: ft's daemons start as root (to load a key, bind, and read
ft's Python where only root may), load everything they serve with, then drop root."""

from __future__ import annotations

import os
import pwd


def drop_privileges(user: str) -> None:
    """Become `user` for good: its uid and gid, no supplementary groups. Call it once everything the
    process needs is imported (ft's files may not be readable by `user`)."""
    account = pwd.getpwnam(user)
    os.setgroups([])
    os.setgid(account.pw_gid)
    os.setuid(account.pw_uid)
    if os.getuid() != account.pw_uid or os.geteuid() != account.pw_uid:
        raise SystemExit(f"could not become {user}")
