"""Broken and hostile data files: each ends in a located error (file:line, kind), never a
traceback, a hang or unbounded memory."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest

from toolkit.data.validate import Limits, validate_file

GOOD = b"".join(json.dumps({"prompt": f"q{i}", "completion": f" a{i}"}).encode() + b"\n" for i in range(2000))


def zstd(data: bytes, **options) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(**options).compress(data)


def truncated_zstd_at_a_block_boundary() -> bytes:
    """A frame written as several blocks, cut after a complete block: zstandard's own stream reader
    reports a clean end of file there."""
    import io

    import zstandard

    out = io.BytesIO()
    with zstandard.ZstdCompressor(level=1).stream_writer(out, closefd=False) as writer:
        for start in range(0, len(GOOD), 4096):
            writer.write(GOOD[start:start + 4096])
            writer.flush(zstandard.FLUSH_BLOCK)
    data = out.getvalue()
    return data[: len(data) // 2]


def parquet_bytes(column) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"prompt": ["q"] * 150, "completion": column})
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def corrupt_parquet() -> bytes:
    import datetime  # noqa: F401  (pyarrow needs nothing else)

    data = bytearray(parquet_bytes([" a"] * 150))
    for offset in range(8, 200):  # the first data page, not the footer
        data[offset] ^= 0xFF
    return bytes(data)


CASES = {
    "a 20 MiB line": ("big.jsonl.gz", lambda: gzip.compress(b'{"prompt": "' + b"x" * (20 << 20) + b'"}\n' + GOOD),
                      "too_large"),
    "a 5000-digit number": ("num.jsonl", lambda: b'{"prompt": "q", "completion": ' + b"9" * 5000 + b"}\n" + GOOD,
                            "unparseable"),
    "100k-deep JSON": ("deep.jsonl", lambda: b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n" + GOOD,
                       "unparseable"),
    "zstd cut at a block boundary": ("cut.jsonl.zst", truncated_zstd_at_a_block_boundary, "truncated"),
    "zstd cut anywhere": ("cut2.jsonl.zst", lambda: zstd(GOOD)[:-7], "truncated"),
    "gzip cut short": ("cut.jsonl.gz", lambda: gzip.compress(GOOD)[:-20], "truncated"),
    "not gzip": ("bad.jsonl.gz", lambda: b"definitely not gzip data" * 10, "corrupt"),
    "not zstd": ("bad.jsonl.zst", lambda: b"definitely not zstd data" * 10, "corrupt"),
    "bytes in Parquet": ("bytes.parquet", lambda: parquet_bytes([b"\x00\x01"] * 150), "wrong_type"),
    "timestamps in Parquet": ("time.parquet",
                              lambda: parquet_bytes([__import__("datetime").datetime(2026, 1, 1)] * 150),
                              "wrong_type"),
    "a corrupt Parquet page": ("corrupt.parquet", corrupt_parquet, None),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_broken_file_is_a_located_error(tmp_path, case):
    name, make, kind = CASES[case]
    path = tmp_path / name
    path.write_bytes(make())
    report = validate_file(str(path), limits=Limits(min_rows=1))
    assert not report.ok
    kinds = set(report.errors)
    if kind:
        assert kind in kinds, kinds
    finding = next(iter(report.errors.values())).examples[0]
    assert finding.location.startswith(f"{path}:") or finding.location == str(path)


@pytest.mark.parametrize("name", ["data.jsonl.zst", "data.jsonl.gz"])
def test_a_decompressor_failing_unforeseen_is_a_located_error_too(tmp_path, monkeypatch, name):
    """readers.py's blind except in stream_problems: a decompressor raising what nobody foresaw (not
    gzip's BadGzipFile, an OSError, nor zstandard's ZstdError) still ends the file in a located
    "corrupt" error, never a traceback (narrowed to OSError, this test fails: checked)."""
    import gzip as gzip_module

    from toolkit.data import readers

    class Unforeseen(Exception):
        pass

    def breaks(*args, **kwargs):
        raise Unforeseen("the decompressor broke in a way nobody foresaw")

    if name.endswith(".zst"):
        monkeypatch.setattr(readers.ZstdStream, "feed", breaks)
    else:
        monkeypatch.setattr(gzip_module.GzipFile, "read", breaks)
        monkeypatch.setattr(gzip_module.GzipFile, "readinto", breaks)
    path = tmp_path / name
    path.write_bytes(zstd(GOOD) if name.endswith(".zst") else gzip.compress(GOOD))
    report = validate_file(str(path), limits=Limits(min_rows=1))
    assert not report.ok and "corrupt" in report.errors
    finding = report.errors["corrupt"].examples[0]
    assert finding.location == f"{path}:1"
    assert "unreadable from here on (Unforeseen: the decompressor broke in a way nobody foresaw)" in finding.message


def test_a_whole_multi_frame_zstd_file_is_read_to_the_end(tmp_path):
    path = tmp_path / "frames.jsonl.zst"
    path.write_bytes(zstd(GOOD[: len(GOOD) // 2]) + zstd(GOOD[len(GOOD) // 2:]))
    report = validate_file(str(path))
    assert report.ok and report.rows == 2000


@pytest.mark.timeout(30)
@pytest.mark.parametrize("what", ["missing", "folder", "fifo", "no extension", "symlink loop"])
def test_a_path_that_is_not_a_data_file_is_one_located_error(tmp_path, what):
    path = tmp_path / ("data" if what == "no extension" else "data.jsonl")
    if what == "folder":
        path.mkdir()
    elif what == "fifo":
        os.mkfifo(path)
    elif what == "no extension":
        path.write_bytes(GOOD)
    elif what == "symlink loop":
        path.symlink_to(path)
    report = validate_file(str(path))
    assert list(report.errors) == ["unreadable"]
    assert str(path) in report.errors["unreadable"].examples[0].message


def ft(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True, timeout=120)


def test_the_cli_reports_broken_files_without_a_traceback(tmp_path):
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(gzip.compress(GOOD)[:-20])
    result = ft("data", "check", str(path))
    assert result.returncode == 1 and "Traceback" not in result.stderr + result.stdout
    assert "truncated" in result.stdout
    bogus = ft("data", "check", str(path), "--format", "bogus")
    assert bogus.returncode == 2 and "unknown format 'bogus'" in bogus.stderr and "Traceback" not in bogus.stderr
