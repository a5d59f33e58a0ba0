"""Stream rows out of JSONL, CSV and Parquet files, plain or compressed (gzip, zstd), local or s3://
(toolkit/storage/object_store.py), each with its location, in bounded memory. Rows that cannot be
read come out as problems with their line, never as exceptions."""

from __future__ import annotations

import codecs
import csv
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from toolkit.storage.object_store import ObjectStore

KINDS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet"}
COMPRESSIONS = {".gz": "gzip", ".gzip": "gzip", ".zst": "zstd", ".zstd": "zstd"}
JSON_VALUES = (str, int, float, bool, type(None), list, dict)
MAX_ROW_BYTES = 16 << 20  # one example; a longer line is an error, never a memory blow-up
# An example is a few levels deep (a row, its messages, a message); far deeper nesting is no data,
# and every reader after this one (duplicates, PII scan, encoding) walks rows recursively.
MAX_NESTING = 32


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


def check_local_file(path: str) -> None:
    """A local data file must be a regular file: a folder fails late and a FIFO blocks forever."""
    import os
    import stat

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise UnsupportedFile(f"{path}: no such file") from None
    except OSError as exc:  # a symlink loop, permissions
        raise UnsupportedFile(f"{path}: cannot be read: {exc.strerror or exc}") from None
    if stat.S_ISDIR(mode):
        raise UnsupportedFile(f"{path}: is a folder; name a data file")
    if not stat.S_ISREG(mode):
        raise UnsupportedFile(f"{path}: not a regular file (a FIFO or device?); name a data file")


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


def bounded_lines(stream, limit: int = MAX_ROW_BYTES) -> Iterator[bytes | None]:
    """The file's lines, each read with a bound: a line longer than `limit` comes out as None (and
    is skipped in pieces), so memory stays bounded whatever the file holds."""
    while True:
        line = stream.readline(limit + 1)
        if not line:
            return
        if len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        while line and not line.endswith(b"\n"):  # the rest of the overlong line
            line = stream.readline(1 << 20)
        yield None


def read_jsonl(stream) -> Iterator[Row]:
    for number, raw in enumerate(bounded_lines(stream), 1):
        if raw is None:
            yield Row(number, None, Problem("too_large", f"the line is longer than {MAX_ROW_BYTES >> 20} MiB"))
            continue
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
        except (ValueError, RecursionError) as exc:  # a 5000-digit number, nesting deeper than Python's stack
            yield Row(number, None, Problem("unparseable", f"not usable JSON: {str(exc)[:120]}"))
            continue
        if not isinstance(value, dict):
            yield Row(number, None, Problem("wrong_type", f"a row must be a JSON object, not {type(value).__name__}"))
            continue
        if nesting(value) > MAX_NESTING:
            yield Row(number, None, Problem("unparseable", f"nested deeper than {MAX_NESTING} levels: no example is"))
            continue
        if ("\\ud" in text or "\\uD" in text) and lone_surrogate(value):
            yield Row(number, None, Problem("encoding", "a \\ud800-\\udfff escape with no pair: not text a tokenizer "
                                                        "reads (save the file as UTF-8 with whole characters)"))
            continue
        yield Row(number, value)


class LineTooLong(Exception):
    """A CSV line longer than MAX_ROW_BYTES (its rest is skipped: the reader goes on at the next)."""


class BoundedTextLines:
    """A text file's lines for the csv module, each read with a bound: an overlong one raises
    LineTooLong once, its rest skipped in pieces, and the lines after it still come (the csv reader
    starts each record afresh). Memory stays bounded whatever the file holds: csv would read a 1.6 GiB
    line whole before its field limit could say no."""

    def __init__(self, text, limit: int | None = None):
        self.text, self.limit, self.count = text, limit or MAX_ROW_BYTES, 0
        self.record = 0  # characters of the record being read (read_csv resets it at each record)

    def __iter__(self):
        return self

    def __next__(self) -> str:
        line = self.text.readline(self.limit + 1)
        if not line:
            raise StopIteration
        self.count += 1
        if len(line) > self.limit and not line.endswith("\n"):
            while line and not line.endswith("\n"):
                line = self.text.readline(1 << 20)
            raise LineTooLong(self.count)
        self.record += len(line)
        if self.record > self.limit:  # one record over many lines (quoted newlines, field after field)
            self.record = 0
            raise LineTooLong(self.count)
        return line


def read_csv(stream) -> Iterator[Row]:
    head = stream.peek(3)[:3] if hasattr(stream, "peek") else b""
    if head == codecs.BOM_UTF8:
        yield Row(1, None, Problem("bom", "the file starts with a UTF-8 byte-order mark; save it without one"))
        stream.read(3)
    lines = BoundedTextLines(io.TextIOWrapper(stream, encoding="utf-8", errors="strict", newline=""))
    reader = csv.DictReader(lines)
    start = 2  # line 1 is the header
    while True:
        lines.record = 0  # each record is bounded as a whole
        try:
            record = next(reader)
        except StopIteration:
            return
        except LineTooLong as exc:
            yield Row(exc.args[0], None, Problem("too_large", f"the row is longer than {MAX_ROW_BYTES >> 20} MiB"))
            start = lines.count + 1
            continue
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
    """A Parquet file's rows, with memory bounded whatever its pages expand to: string columns read as
    dictionaries (a page of one long string used by every row stays one string), batches sized from
    each row group's decoded bytes, and a row group whose values could not fit MAX_ROW_BYTES a row
    (a list of 50 million zeros in one row, run-length encoded in a few hundred bytes) refused from its
    metadata, before any of it is decoded."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(stream)
        text = [field.name for field in parquet.schema_arrow
                if pa.types.is_string(field.type) or pa.types.is_large_string(field.type)
                or pa.types.is_binary(field.type) or pa.types.is_large_binary(field.type)]
        if text and getattr(stream, "seekable", lambda: False)():
            stream.seek(0)
            parquet = pq.ParquetFile(stream, read_dictionary=text)
    except (pa.ArrowException, OSError, ValueError) as exc:  # ArrowInvalid and friends; a cut-short file
        yield Row(1, None, Problem("unparseable", f"not a Parquet file: {exc}"))
        return
    number = 0
    metadata = parquet.metadata
    for group in range(metadata.num_row_groups):
        rows, why = metadata.row_group(group).num_rows, group_problem(metadata.row_group(group))
        if why:
            yield Row(number + 1, None, Problem("too_large", f"rows {number + 1}-{number + rows} (row group {group}): "
                                                             f"{why}; nothing of them is read"))
            number += rows
            continue
        size = max(metadata.row_group(group).total_byte_size // max(rows, 1), 1)
        batches = parquet.iter_batches(batch_size=max(1, min(batch_rows, PARQUET_BATCH_BYTES // size)),
                                       row_groups=[group])
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                break
            except (pa.ArrowException, OSError, ValueError) as exc:  # a corrupt page
                yield Row(number + 1, None, Problem("corrupt",
                                                    f"unreadable from row {number + 1} on: {str(exc)[:200]}"))
                return
            for record in rows_of(batch):
                number += 1
                if record is None:
                    yield Row(number, None, Problem("too_large", f"the row is larger than {MAX_ROW_BYTES >> 20} MiB"))
                    continue
                odd = [name for name, value in record.items() if not isinstance(value, JSON_VALUES)]
                if odd:
                    yield Row(number, None, Problem("wrong_type", f"column {odd[0]} holds "
                                                    f"{type(record[odd[0]]).__name__} values; store text as strings",
                                                    odd[0]))
                    continue
                yield Row(number, record)


PARQUET_BATCH_BYTES = 64 << 20  # decoded bytes a batch holds at most (a row group's own average)


def group_problem(group) -> str | None:
    """Why a row group cannot be read a row at a time within MAX_ROW_BYTES, from its metadata alone:
    more values a row than a row's bytes could hold (each value is at least one)."""
    rows = max(group.num_rows, 1)
    for index in range(group.num_columns):
        column = group.column(index)
        if column.num_values > rows * MAX_ROW_BYTES // 8:
            return (f"column {column.path_in_schema} holds {column.num_values:,} values for {group.num_rows:,} "
                    f"rows, more than a row of {MAX_ROW_BYTES >> 20} MiB holds")
    return None


PARQUET_ROWS_AT_ONCE = 16  # rows made Python objects at once: a dictionary-encoded page expands as it is


def rows_of(batch) -> Iterator[dict | None]:
    """A record batch's rows as dicts, a few at a time (a 796-byte file of dictionary strings made
    3.2 GB when its 8,192-row batch became Python objects at once); a row larger than MAX_ROW_BYTES
    comes out as None."""
    for start in range(0, batch.num_rows, PARQUET_ROWS_AT_ONCE):
        for record in batch.slice(start, PARQUET_ROWS_AT_ONCE).to_pylist():
            yield None if row_bytes(record) > MAX_ROW_BYTES else record


def row_bytes(value, depth: int = 0) -> int:
    """About how large a row is as text: its strings' and bytes' lengths, nested values included."""
    if isinstance(value, str | bytes):
        return len(value)
    if depth > MAX_NESTING:
        return 0
    if isinstance(value, dict):
        return sum(len(str(key)) + row_bytes(item, depth + 1) for key, item in value.items())
    if isinstance(value, list | tuple):
        return sum(row_bytes(item, depth + 1) for item in value)
    return 8


class TruncatedFile(OSError):
    pass


class ZstdStream(io.RawIOBase):
    """zstd frames, one after another, decompressed as read. Unlike zstandard's stream_reader, an
    input that ends inside a frame (a copy cut short at a block boundary) is an error, not an EOF."""

    def __init__(self, raw, chunk: int = 1 << 20):
        import zstandard

        self.raw, self.chunk, self.zstd = raw, chunk, zstandard
        self.decompressor = zstandard.ZstdDecompressor()
        self.frame = self.decompressor.decompressobj()
        self.in_frame, self.pending = False, b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self.pending:
            compressed = self.raw.read(self.chunk)
            if not compressed:
                if self.in_frame:
                    raise TruncatedFile("the zstd stream ends in the middle of a frame")
                return 0
            self.pending = self.feed(compressed)
        size = min(len(buffer), len(self.pending))
        buffer[:size], self.pending = self.pending[:size], self.pending[size:]
        return size

    def feed(self, compressed: bytes) -> bytes:
        out = []
        while compressed:
            self.in_frame = True
            out.append(self.frame.decompress(compressed))
            if not self.frame.eof:
                break
            compressed, self.in_frame = self.frame.unused_data, False  # the next frame, if any
            self.frame = self.decompressor.decompressobj()
        return b"".join(out)


def lone_surrogate(value: Any) -> bool:
    """Whether a JSON value holds half of a UTF-16 pair (JSON lets "\\ud800" through; no text is it)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def nesting(value: Any) -> int:
    """How deep lists and objects nest in a JSON value (without recursion: any depth is measured)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if depth <= MAX_NESTING:  # past the limit, deeper is no different
                stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def stream_problems(rows: Iterator[Row]) -> Iterator[Row]:
    """Rows, and a located problem instead of an exception when the stream under them breaks (a
    corrupt or truncated gzip or zstd file, a read error)."""
    line = 0
    try:
        for row in rows:
            line = row.line
            yield row
    except TruncatedFile as exc:
        yield Row(line + 1, None, Problem("truncated", f"{exc}: the file is cut short"))
    except EOFError:
        yield Row(line + 1, None, Problem("truncated", "the compressed file ends before its end marker: it is "
                                                       "cut short"))
    except Exception as exc:  # noqa: BLE001 - gzip.BadGzipFile, zstandard.ZstdError, OSError
        yield Row(line + 1, None, Problem("corrupt", f"unreadable from here on ({type(exc).__name__}: "
                                                     f"{str(exc)[:160]})"))


def open_rows(url: str, store: ObjectStore) -> tuple[Iterator[Row], CountingReader, int | None]:
    """Rows of a data file (read through `store` where it is an s3:// URL), the byte counter under
    them, and the file's size when known."""
    kind, compression = file_kind(url)
    if "://" not in url:
        check_local_file(url)
    filesystem, path = store.filesystem(url)
    handle = filesystem.open(path, "rb")
    try:
        size = filesystem.size(path)
    except (OSError, ValueError):  # a store that cannot say: the bar shows rows, not bytes
        size = None
    counter = CountingReader(handle)
    raw: Any = io.BufferedReader(counter, buffer_size=1 << 20)
    if compression == "gzip":
        import gzip

        raw = io.BufferedReader(gzip.GzipFile(fileobj=raw), buffer_size=1 << 20)
    elif compression == "zstd":
        raw = io.BufferedReader(ZstdStream(raw), buffer_size=1 << 20)
    if kind == "parquet":
        rows = read_parquet(raw if compression else handle)
    else:
        rows = read_jsonl(raw) if kind == "jsonl" else read_csv(raw)
    return stream_problems(rows), counter, size
