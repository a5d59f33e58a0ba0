"""Stream rows out of JSONL, CSV and Parquet files, plain or compressed (gzip, zstd), local or
s3:// (fsspec), each with its location, in bounded memory. Rows that cannot be read come out as
problems with their line, never as exceptions."""

from __future__ import annotations

import codecs
import csv
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

KINDS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet"}
COMPRESSIONS = {".gz": "gzip", ".gzip": "gzip", ".zst": "zstd", ".zstd": "zstd"}


@dataclass(frozen=True)
class Problem:
    kind: str
    message: str
    field: str | None = None


@dataclass(frozen=True)
class Row:
    line: int  # 1-based line of the row's start (JSONL, CSV) or 1-based row number (Parquet)
    data: dict[str, Any] | None
    problem: Problem | None = None


class UnsupportedFile(ValueError):
    pass


def file_kind(url: str) -> tuple[str, str | None]:
    """(jsonl|csv|parquet, compression) from the file name."""
    name = url.rsplit("/", 1)[-1].lower()
    compression = None
    for suffix, codec in COMPRESSIONS.items():
        if name.endswith(suffix):
            compression, name = codec, name[: -len(suffix)]
            break
    for suffix, kind in KINDS.items():
        if name.endswith(suffix):
            return kind, compression
    raise UnsupportedFile(f"{url}: unknown data file type; use .jsonl, .csv or .parquet (optionally .gz or .zst)")


class CountingReader(io.RawIOBase):
    """Counts the compressed bytes consumed, for a progress bar over the file's real size."""

    def __init__(self, raw):
        self.raw, self.count = raw, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.raw.read(len(buffer))
        self.count += len(data)
        buffer[: len(data)] = data
        return len(data)


def read_jsonl(stream) -> Iterator[Row]:
    for number, raw in enumerate(stream, 1):
        if number == 1 and raw.startswith(codecs.BOM_UTF8):
            yield Row(1, None, Problem("bom", "the file starts with a UTF-8 byte-order mark; save it without one"))
            raw = raw[len(codecs.BOM_UTF8):]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield Row(number, None, Problem("encoding", f"invalid UTF-8 at byte {exc.start} of the line"))
            continue
        if not text.strip():
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            yield Row(number, None, Problem("unparseable", f"not JSON: {exc.msg} at column {exc.colno}"))
            continue
        if not isinstance(value, dict):
            yield Row(number, None, Problem("wrong_type", f"a row must be a JSON object, not {type(value).__name__}"))
            continue
        yield Row(number, value)


def read_csv(stream) -> Iterator[Row]:
    head = stream.peek(3)[:3] if hasattr(stream, "peek") else b""
    if head == codecs.BOM_UTF8:
        yield Row(1, None, Problem("bom", "the file starts with a UTF-8 byte-order mark; save it without one"))
        stream.read(3)
    text = io.TextIOWrapper(stream, encoding="utf-8", errors="strict", newline="")
    reader = csv.DictReader(text)
    start = 2  # line 1 is the header
    while True:
        try:
            record = next(reader)
        except StopIteration:
            return
        except UnicodeDecodeError as exc:
            problem = Problem("encoding", f"invalid UTF-8 ({exc.reason}); reading stops here")
            yield Row(reader.line_num + 1, None, problem)
            return
        except csv.Error as exc:
            yield Row(reader.line_num, None, Problem("unparseable", f"bad CSV: {exc}"))
            start = reader.line_num + 1
            continue
        if None in record:  # more cells than header columns
            yield Row(start, None, Problem("unparseable", f"{len(reader.fieldnames) + len(record[None])} cells, "
                                                         f"the header has {len(reader.fieldnames)}"))
        else:
            yield Row(start, dict(record))
        start = reader.line_num + 1


def read_parquet(stream, batch_rows: int = 8192) -> Iterator[Row]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(stream)
    except Exception as exc:  # pyarrow raises ArrowInvalid and friends
        yield Row(1, None, Problem("unparseable", f"not a Parquet file: {exc}"))
        return
    number = 0
    for batch in parquet.iter_batches(batch_size=batch_rows):
        for record in batch.to_pylist():
            number += 1
            yield Row(number, record)


def open_rows(url: str) -> tuple[Iterator[Row], CountingReader, int | None]:
    """Rows of a data file, the byte counter under them, and the file's size when known."""
    import fsspec

    kind, compression = file_kind(url)
    opened = fsspec.open(url, "rb")
    handle = opened.open()
    try:
        size = opened.fs.size(opened.path)
    except Exception:
        size = None
    counter = CountingReader(handle)
    raw: Any = io.BufferedReader(counter, buffer_size=1 << 20)
    if compression == "gzip":
        import gzip

        raw = io.BufferedReader(gzip.GzipFile(fileobj=raw), buffer_size=1 << 20)
    elif compression == "zstd":
        import zstandard

        raw = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw), buffer_size=1 << 20)
    if kind == "parquet":
        return read_parquet(raw if compression else handle), counter, size
    return (read_jsonl(raw) if kind == "jsonl" else read_csv(raw)), counter, size
