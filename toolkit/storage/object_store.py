"""Where files live and how to reach them: local paths, or s3:// through fsspec + s3fs.

Every fsspec filesystem ft opens is made here, by an `ObjectStore`: the endpoint of an s3:// URL is
AWS_ENDPOINT_URL when set, else the cluster profile's `s3_endpoint`, else AWS's own, and each
filesystem is given it with bounded timeouts as its own options: fsspec's process-wide configuration
is never set, so what a call reaches never depends on who called first (one environment variable is
set, AWS_EC2_METADATA_DISABLED where the endpoint is not AWS's: see `ObjectStore.filesystem`). Calls
are bounded in time: an object store that does not answer is reported as unreachable within seconds,
never as a missing file, and never waited on forever. One rule says what an S3 URL is
(`parse_s3_url`), for recipes, profiles and mirrors alike.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Bounded connection attempts: botocore's default (60 s connect, legacy retries) would let an
# unreachable endpoint hold `ft validate` for minutes.
S3_CLIENT_CONFIG = {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 3, "mode": "standard"}}
# A store that accepts connections and never answers: the existence check gives up after this
# (s3fs retries timeouts itself, on top of botocore's attempts: minutes, left alone).
PRESENCE_DEADLINE_S = 30.0

CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
                        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI")

# A bucket as S3 and the stores ft meets name them (legacy us-east-1 buckets may hold upper case and
# '_'), then a key or prefix on one line. Keys may hold what S3 allows (':' in a timestamp, spaces,
# '%', a user's login), but not what fsspec reads as something else: '::' chains filesystems (all
# after it is dropped) and '?' starts a query ('?versionId=' picks an object version), so a key
# holding them would reach another object than the one named.
_S3_URL = re.compile(r"s3://(?P<bucket>[A-Za-z0-9][A-Za-z0-9._-]{1,254})(?:/(?P<key>[^\x00-\x1f\x7f?]*))?")


@dataclass(frozen=True)
class S3Url:
    bucket: str
    key: str  # "" for a bare bucket; never with a leading or trailing slash

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}" if self.key else f"s3://{self.bucket}"


def is_s3_url(value: str) -> bool:
    return value.startswith("s3://")


def parse_s3_url(value: str, what: str = "an S3 URL", needs_key: bool = False) -> S3Url:
    """The one rule for an S3 URL: s3://bucket[/key], the bucket named as S3 allows. Raises
    ValueError naming `what` and the shape wanted."""
    match = _S3_URL.fullmatch(value)
    key = (match["key"] or "").strip("/") if match else ""
    if not match or "::" in value or (needs_key and not key):
        shape = "s3://bucket/path/file" if needs_key else "s3://bucket[/prefix]"
        raise ValueError(f"{value!r} is not {what} ({shape}: a bucket of letters, digits, '.', '_' and '-'; "
                         f"a key on one line, without '::' or '?', which fsspec reads as something else)")
    return S3Url(match["bucket"], key)


@dataclass(frozen=True)
class Presence:
    """A file is there, is missing, or cannot be asked about (and why)."""

    found: bool
    unreachable: str | None = None


@dataclass(frozen=True)
class Answer:
    """What a call to an object store gave within its deadline: a value, an error, or nothing yet."""

    value: Any = None
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


@dataclass(frozen=True)
class ObjectStore:
    """The object store of one cluster: `profile_endpoint` is its profile's s3_endpoint ("" for AWS
    itself, or where the environment names it)."""

    profile_endpoint: str = ""

    @property
    def endpoint(self) -> str:
        """AWS_ENDPOINT_URL wins (a user pointing one shell at another store), then the profile's."""
        return os.environ.get("AWS_ENDPOINT_URL") or self.profile_endpoint

    def s3_options(self) -> dict:
        """s3fs's options for this store: its endpoint and bounded timeouts."""
        options: dict = {"config_kwargs": dict(S3_CLIENT_CONFIG)}
        if self.endpoint:
            options["endpoint_url"] = self.endpoint
        return options

    def filesystem(self, url: str, **options) -> tuple[Any, str]:
        """The fsspec filesystem holding `url` and the path in it: s3:// with this store's options
        (`options` added, e.g. s3fs's multipart settings), the local filesystem otherwise."""
        import fsspec

        if not is_s3_url(url):
            return fsspec.core.url_to_fs(url, **options)
        if self.endpoint and "amazonaws.com" not in self.endpoint:
            # Instance roles are AWS's: asking EC2's metadata address for credentials of another
            # store would only send traffic off the machine and wait for it. botocore takes this from
            # the environment alone, so it holds for the rest of the process and its children: an ft
            # process talks to one cluster's store, and a user's own setting is kept.
            os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
        return fsspec.core.url_to_fs(url, **(self.s3_options() | options))

    def open(self, url: str, mode: str = "rb"):
        """An open file object (a context manager) for `url`."""
        filesystem, path = self.filesystem(url)
        return filesystem.open(path, mode)

    def where(self, url: str) -> str:
        """The store a URL is read from, in words, for messages."""
        if not is_s3_url(url):
            return "the local filesystem"
        return f"the object store at {self.endpoint}" if self.endpoint else "AWS S3"

    def presence(self, url: str, deadline_s: float = PRESENCE_DEADLINE_S) -> Presence:
        """Whether a file is there, asked within a deadline."""
        answer = within(lambda: self._ask_presence(url), deadline_s)
        if not answer.in_time:
            return Presence(False, f"no answer within {deadline_s:.0f} s")
        return answer.value if answer.error is None else Presence(False, _why(answer.error))

    def _ask_presence(self, url: str) -> Presence:
        try:
            filesystem, path = self.filesystem(url)
            info = filesystem.info(path)
        except FileNotFoundError:
            return Presence(False)
        except PermissionError as exc:
            return Presence(False, f"access denied: {exc}")
        return Presence(info.get("type") == "file")

    def credentials_visible(self) -> bool:
        """Whether a job started from this environment will find S3 credentials: in the environment
        or the user's AWS files. Against AWS itself the nodes' instance role may hold them: not known
        here, so counted as found."""
        if not self.endpoint or "amazonaws.com" in self.endpoint:
            return True
        if any(os.environ.get(name) for name in CREDENTIAL_VARIABLES):
            return True
        home = os.path.expanduser("~/.aws")
        return os.path.isfile(os.path.join(home, "credentials")) or os.path.isfile(os.path.join(home, "config"))


def _why(error: Exception) -> str:
    """Connection refused, DNS, TLS, credentials, timeouts: the store's fault, in one line."""
    return f"{type(error).__name__}: {error}"
