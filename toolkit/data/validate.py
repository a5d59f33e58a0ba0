"""Validate a data file in one streaming pass: every problem with its location, and statistics.

Memory stays bounded whatever the file's size: rows are checked in batches, and only an 8-byte
hash and a 4-byte token count per row are kept (for duplicates and percentiles).
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from toolkit.base.errors import UsageError
from toolkit.data import pii
from toolkit.data.chat_template import ChatTemplateError
from toolkit.data.encode import encode_rows, sequences_per_row
from toolkit.data.readers import Row, UnsupportedFile, open_rows, row_bytes
from toolkit.data.schemas import FORMATS, check_row, detect_format
from toolkit.data.split import is_eval
from toolkit.data.tokenizer import LengthCounter
from toolkit.storage.object_store import ObjectStore

BATCH_ROWS = 2048
# Rows held before they are checked and tokenized together: at most BATCH_ROWS, and at most about
# this much text (2,048 rows of up to 16 MiB each would be 32 GiB).
BATCH_BYTES = 64 << 20
EXAMPLES_PER_KIND = 5  # locations listed per kind of problem; the count covers all of them
DEFAULT_MIN_ROWS = 100
MAX_ROWS_BY_TIER = {"free": 100_000, "standard": 20_000_000, "premium": None}


class UnknownFormat(UsageError):
    """--format names no data format."""


@dataclass
class Finding:
    location: str  # file:line
    field: str | None
    message: str

    def __str__(self) -> str:
        return f"{self.location}{' ' + self.field if self.field else ''}: {self.message}"


@dataclass
class KindSummary:
    count: int = 0
    examples: list[Finding] = field(default_factory=list)


@dataclass
class Report:
    path: str
    format: str | None
    rows: int = 0
    valid_rows: int = 0
    errors: dict[str, KindSummary] = field(default_factory=dict)
    warnings: dict[str, KindSummary] = field(default_factory=dict)
    tokens: dict[str, float] = field(default_factory=dict)
    duplicates: int = 0

    @property
    def ok(self) -> bool:
        return not self.errors

    def add(self, severity: str, kind: str, finding: Finding, count: int = 1) -> None:
        bucket = (self.errors if severity == "error" else self.warnings).setdefault(kind, KindSummary())
        bucket.count += count
        if len(bucket.examples) < EXAMPLES_PER_KIND:
            bucket.examples.append(finding)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["ok"] = self.ok
        return data


@dataclass
class Limits:
    max_seq_len: int | None = None
    too_long: str = "reject"  # or truncate
    min_rows: int = DEFAULT_MIN_ROWS
    max_rows: int | None = None


@dataclass
class CacheTarget:
    """Where the tokens of a clean pass go, and the split they are marked with."""

    writer: object  # toolkit.data.cache.CacheWriter
    eval_fraction: float = 0.0
    seed: int = 0


class _Pass:
    """State of one validation pass over a file."""

    def __init__(self, path: str, fmt: str, counter: LengthCounter | None, limits: Limits,
                 cache: CacheTarget | None = None):
        self.report = Report(path, None if fmt == "auto" else fmt)
        self.counter, self.limits, self.cache = counter, limits, cache
        self.hashes, self.lines, self.lengths = array("Q"), array("I"), array("I")
        self.pending: list[Row] = []
        self.pending_bytes = 0

    def where(self, line: int) -> str:
        return f"{self.report.path}:{line}"

    def take(self, row: Row) -> None:
        self.report.rows += 1
        if row.problem:
            self.report.add("error", row.problem.kind, Finding(self.where(row.line), row.problem.field,
                                                               row.problem.message))
            return
        if self.report.format is None:
            self.report.format = detect_format(row.data)
            if self.report.format is None:
                self.report.add("error", "unknown_format", Finding(
                    self.where(row.line), None, f"cannot tell the format from the keys {sorted(row.data)}; expected "
                    "prompt/completion, messages, or prompt/chosen/rejected"))
                return
        self.pending.append(row)
        self.pending_bytes += row_bytes(row.data)
        if len(self.pending) >= BATCH_ROWS or self.pending_bytes >= BATCH_BYTES:
            self.flush()

    def flush(self) -> None:
        rows, self.pending, self.pending_bytes = self.pending, [], 0
        good: list[Row] = []
        for row in rows:
            problems = check_row(row.data, self.report.format)
            for kind, field_name, message in problems:
                self.report.add("error", kind, Finding(self.where(row.line), field_name, message))
            if not problems:
                good.append(row)
        for row in good:
            # default=str: a Parquet file's extra columns may hold decimals, times or bytes.
            canonical = json.dumps(row.data, sort_keys=True, ensure_ascii=False, default=str).encode()
            self.hashes.append(int.from_bytes(hashlib.blake2b(canonical, digest_size=8).digest(), "little"))
            self.lines.append(row.line)
            for kind in pii.find(" ".join(_strings(row.data))):
                self.report.add("warning", f"pii_{kind}", Finding(self.where(row.line), None,
                                                                  f"looks like it holds a {kind.replace('_', ' ')}"))
        self.report.valid_rows += len(good)
        if self.counter and good:
            self.measure(good)

    def measure(self, good: list[Row]) -> None:
        """Token lengths, by the same encoding training uses; the tokens go to the cache."""
        fmt = self.report.format
        per_row = sequences_per_row(fmt)
        limit = self.limits.max_seq_len or 1 << 30
        try:
            encoded = encode_rows([r.data for r in good], fmt, self.counter, limit)
        except ChatTemplateError:
            self.template_failed(good, fmt, limit)
            return
        for index, row in enumerate(good):
            parts = encoded[index * per_row:(index + 1) * per_row]
            length = max(part[2] for part in parts)
            self.lengths.append(length)
            self.check_length(row, length)
            if self.cache:
                held_out = is_eval(row.data, self.cache.eval_fraction, self.cache.seed)
                for ids, labels, _ in parts:
                    self.cache.writer.add(ids, labels, held_out)

    def template_failed(self, rows: list[Row], fmt: str, limit: int) -> None:
        """The model's chat template failed on a conversation of this batch: one error at the first
        row it fails on (each alone, within the template's bounds), and no more token counts (the
        template is the model's, not the data's: it would fail again)."""
        for row in rows:
            try:
                encode_rows([row.data], fmt, self.counter, limit)
            except ChatTemplateError as exc:
                self.report.add("error", "chat_template", Finding(
                    self.where(row.line), "messages",
                    f"the model's chat template cannot render this conversation: {exc} (fix the template, "
                    "chat_template.jinja or tokenizer_config.json's chat_template, or use another tokenizer)"))
                break
        self.counter = None

    def check_length(self, row: Row, length: int) -> None:
        limit = self.limits.max_seq_len
        if limit is None or length <= limit:
            return
        message = f"{length} tokens, max_seq_len is {limit}"
        if self.limits.too_long == "truncate":
            self.report.add("warning", "too_long_truncated", Finding(self.where(row.line), None, message))
        else:
            self.report.add("error", "too_long", Finding(
                self.where(row.line), None, message + " (shorten it, raise data.max_seq_len, or set "
                                                      "data.too_long: truncate)"))

    def finish(self) -> Report:
        self.flush()
        report = self.report
        self.duplicates()
        if len(self.lengths):
            import numpy as np

            values = np.frombuffer(self.lengths, dtype=np.uint32)
            report.tokens = {"total": int(values.sum()), "mean": round(float(values.mean()), 1),
                             "p50": float(np.percentile(values, 50)), "p95": float(np.percentile(values, 95)),
                             "max": int(values.max())}
        limits = self.limits
        if report.valid_rows < limits.min_rows:
            report.add("error", "too_few_rows", Finding(
                f"{report.path}", None, f"{report.valid_rows} usable examples; at least {limits.min_rows} are needed"))
        if limits.max_rows is not None and report.rows > limits.max_rows:
            report.add("error", "too_many_rows", Finding(
                f"{report.path}", None,
                f"{report.rows} rows; this tier allows {limits.max_rows} (ask for a higher tier)"))
        return report

    def duplicates(self) -> None:
        if not self.hashes:
            return
        import numpy as np

        hashes = np.frombuffer(self.hashes, dtype=np.uint64)
        order = np.argsort(hashes, kind="stable")
        ordered = hashes[order]
        repeated = np.nonzero(ordered[1:] == ordered[:-1])[0] + 1  # positions of second and later copies
        self.report.duplicates = int(len(repeated))
        lines = np.frombuffer(self.lines, dtype=np.uint32)
        if not repeated.size:
            return
        summary = self.report.warnings.setdefault("duplicate", KindSummary())
        summary.count = int(repeated.size)
        for position in repeated[:EXAMPLES_PER_KIND]:
            first = position
            while first > 0 and ordered[first - 1] == ordered[position]:
                first -= 1
            summary.examples.append(Finding(self.where(int(lines[order[position]])), None,
                                            f"exact duplicate of line {int(lines[order[first]])}"))


def report_from_dict(data: dict) -> Report:
    """A report as `Report.to_dict` wrote it (the cache keeps reports)."""
    def kinds(raw: dict) -> dict[str, KindSummary]:
        return {kind: KindSummary(v["count"], [Finding(**f) for f in v["examples"]]) for kind, v in raw.items()}

    return Report(data["path"], data["format"], data["rows"], data["valid_rows"], kinds(data["errors"]),
                  kinds(data["warnings"]), data["tokens"], data["duplicates"])


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [text for item in value.values() for text in _strings(item)]
    if isinstance(value, list):
        return [text for item in value for text in _strings(item)]
    return []


def validate_file(path: str, fmt: str = "auto", counter: LengthCounter | None = None, limits: Limits | None = None,
                  progress: Callable[[int, int | None], None] | None = None,
                  cache: CacheTarget | None = None, store: ObjectStore | None = None) -> Report:
    """Check one data file (an s3:// one read through `store`, by default the store the environment
    names). `progress(bytes_read, total_bytes)` is called as the pass advances."""
    if fmt not in ("auto", *FORMATS):
        raise UnknownFormat(f"unknown format {fmt!r}; use auto or one of {', '.join(FORMATS)}")
    try:
        rows, bytes_counter, size = open_rows(path, store or ObjectStore())
    except (UnsupportedFile, OSError) as exc:  # not a data file, missing, unreadable: one located error
        report = Report(path, None)
        message = str(exc) if isinstance(exc, UnsupportedFile) else f"{path}: cannot be read: {exc}"
        report.add("error", "unreadable", Finding(path, None, message))
        return report
    state = _Pass(path, fmt, counter, limits or Limits(), cache)
    for index, row in enumerate(rows):
        state.take(row)
        if progress and index % 4096 == 0:
            progress(bytes_counter.count, size)
    if progress:
        progress(size or bytes_counter.count, size)
    return state.finish()
