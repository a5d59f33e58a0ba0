"""Fuzzing the recipe loader and the data readers (hypothesis): whatever the input, the outcome is
a result or ft's own located error, never another exception. Derandomized, so CI runs the same
cases every time; the inputs that once broke ft are kept as explicit examples (the seeds)."""

from __future__ import annotations

import gzip
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from toolkit.base.errors import FtError
from toolkit.base.yaml_source import YamlError, parse_yaml
from toolkit.recipe.resolve import resolve

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-10**6, max_value=10**6),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40))
KEYS = st.sampled_from(["name", "model", "base", "method", "kind", "rank", "data", "train", "training", "steps",
                        "micro_batch", "global_batch", "resources", "nodes", "time", "env", "cluster", "tier",
                        "checkpoint", "tracking", "wandb", "mode", "x"])
DOCUMENTS = st.recursive(SCALARS, lambda children: st.one_of(st.lists(children, max_size=4),
                                                             st.dictionaries(KEYS, children, max_size=6)),
                         max_leaves=30)


@FUZZ
@given(st.text(max_size=2000))
@example("a: &a [x, x]\nb: &b [*a, *a]\nc: [*b, *b]\n")  # aliases of aliases
@example("name: " + "9" * 5000)  # an integer too long to convert
@example("[" * 3000)  # nesting deeper than the parser's stack
@example("a: 1\na: 2\n")  # a duplicate key
@example("\x1f")  # a character the reader refuses before parsing (found by this test)
@example("name: !!python/object/apply:os.system ['true']\n")  # a tag that would run code
def test_any_text_parses_or_is_a_yaml_error(text):
    try:
        parse_yaml(text, "fuzz.yaml")
    except YamlError as error:
        assert error.message.startswith("fuzz.yaml")


@FUZZ
@given(DOCUMENTS)
@example({"name": "x", "model": {"base": "tiny-llama"}, "data": {"train": "t.jsonl"}, "resources": {"nodes": True}})
@example({"name": "x", "model": {"base": "tiny-llama"}, "data": {"train": "t.jsonl"}, "env": {"A": None}})
def test_any_recipe_document_resolves_or_is_a_located_error(document):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "fuzz.yaml"
        path.write_text(yaml.safe_dump(document))
        try:
            resolve(path, "lab")
        except FtError as error:
            assert str(path) in str(error) or "cluster profile" in str(error)


KINDS = [".jsonl", ".csv", ".parquet", ".jsonl.gz", ".jsonl.zst", ".csv.gz"]


@FUZZ
@given(st.binary(max_size=4096), st.sampled_from(KINDS), st.booleans())
@example(b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}\n", ".jsonl", False)
@example(gzip.compress(b'{"prompt": "a", "completion": "b"}\n' * 50)[:-9], ".jsonl.gz", False)
def test_any_bytes_as_a_data_file_give_a_report(raw, suffix, compress):
    from toolkit.data.validate import Limits, validate_file

    if compress and suffix.endswith(".gz"):
        raw = gzip.compress(raw)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"fuzz{suffix}"
        path.write_bytes(raw)
        report = validate_file(str(path), limits=Limits(min_rows=1))
        assert report.rows >= 0 and (report.ok or report.errors)
