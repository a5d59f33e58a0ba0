"""Where data files live and how to reach them: local paths, or s3:// through fsspec + s3fs.

The endpoint of an s3:// URL comes from AWS_ENDPOINT_URL when set, else from the cluster profile's
`s3_endpoint`, else AWS's own. Calls are bounded in time: an object store that does not answer is
reported as unreachable within seconds, never as a missing file, and never waited on forever.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

# Bounded connection attempts: botocore's default (60 s connect, legacy retries) would let an
# unreachable endpoint hold `ft validate` for minutes.
S3_CLIENT_CONFIG = {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 3, "mode": "standard"}}
# A store that accepts connections and never answers: the existence check gives up after this
# (s3fs retries timeouts itself, on top of botocore's attempts: minutes, left alone).
PRESENCE_DEADLINE_S = 30.0


def s3_endpoint(profile_endpoint: str = "") -> str:
    return os.environ.get("AWS_ENDPOINT_URL") or profile_endpoint


def configure(profile_endpoint: str = "") -> None:
    """Make every s3:// access of this process (readers, digests, checks) use the cluster's endpoint
    and bounded timeouts: fsspec applies its per-protocol config to each filesystem it creates."""
    import fsspec.config

    fsspec.config.conf["s3"] = s3_options(profile_endpoint)


def s3_options(profile_endpoint: str = "") -> dict:
    options: dict = {"config_kwargs": dict(S3_CLIENT_CONFIG)}
    endpoint = s3_endpoint(profile_endpoint)
    if endpoint:
        options["endpoint_url"] = endpoint
        if "amazonaws.com" not in endpoint:
            # Instance roles are AWS's: asking EC2's metadata address for credentials of another
            # store would only send traffic off the machine and wait for it.
            os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    return options


@dataclass(frozen=True)
class Presence:
    """A data file is there, is missing, or cannot be asked about (and why)."""

    found: bool
    unreachable: str | None = None


def where(url: str, profile_endpoint: str = "") -> str:
    """The store a URL is read from, in words, for messages."""
    if not url.startswith("s3://"):
        return "the local filesystem"
    endpoint = s3_endpoint(profile_endpoint)
    return f"the object store at {endpoint}" if endpoint else "AWS S3"


@dataclass(frozen=True)
class Answer:
    """What a call to an object store gave within its deadline: a value, an error, or nothing yet."""

    value: object = None
    error: Exception | None = None
    in_time: bool = True


def within(call: Callable[[], object], seconds: float) -> Answer:
    """Run `call` in a daemon thread and wait at most `seconds`: a store that does not answer never
    holds the caller, and one left waiting never holds the process."""
    answers: list[Answer] = []

    def ask() -> None:
        try:
            answers.append(Answer(call()))
        except Exception as exc:  # noqa: BLE001 - the store's trouble, whatever its kind: the caller decides
            answers.append(Answer(error=exc))
    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(seconds)
    return answers[0] if answers else Answer(in_time=False)


def presence(url: str, deadline_s: float = PRESENCE_DEADLINE_S) -> Presence:
    """Whether a data file is there, asked of the store configured by `configure`, within a deadline."""
    answer = within(lambda: ask_presence(url), deadline_s)
    if not answer.in_time:
        return Presence(False, f"no answer within {deadline_s:.0f} s")
    return answer.value


def ask_presence(url: str) -> Presence:
    import fsspec

    try:
        filesystem, path = fsspec.core.url_to_fs(url)
        info = filesystem.info(path)
    except FileNotFoundError:
        return Presence(False)
    except PermissionError as exc:
        return Presence(False, f"access denied: {exc}")
    except Exception as exc:  # noqa: BLE001 - connection refused, DNS, TLS, credentials, timeouts: the store's fault
        return Presence(False, f"{type(exc).__name__}: {exc}")
    return Presence(info.get("type") == "file")


CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
                        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI")


def credentials_visible(profile_endpoint: str = "") -> bool:
    """Whether a job started from this environment will find S3 credentials: in the environment or
    the user's AWS files. Against AWS itself the nodes' instance role may hold them: not known here,
    so counted as found."""
    endpoint = s3_endpoint(profile_endpoint)
    if not endpoint or "amazonaws.com" in endpoint:
        return True
    if any(os.environ.get(name) for name in CREDENTIAL_VARIABLES):
        return True
    home = os.path.expanduser("~/.aws")
    return os.path.isfile(os.path.join(home, "credentials")) or os.path.isfile(os.path.join(home, "config"))
