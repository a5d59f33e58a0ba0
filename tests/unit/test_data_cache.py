"""Tokenize once: the cache that validation fills and training reads; the deterministic split."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import yaml

from toolkit.base.shared_dirs import user_cache
from toolkit.data import recipe_data
from toolkit.data.encode import IGNORE, encode_rows
from toolkit.data.split import split
from toolkit.data.tokenizer import LengthCounter, load_length_counter
from toolkit.recipe.resolve import resolve
from toolkit.storage.object_store import ObjectStore

REPO = Path(__file__).resolve().parents[2]


def test_split_is_deterministic_order_independent_and_near_the_fraction():
    rows = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(4000)]
    train, held_out = split(rows, 0.05)
    shuffled = rows[:]
    random.Random(1).shuffle(shuffled)
    _, held_out_again = split(shuffled, 0.05)
    key = lambda r: r["prompt"]  # noqa: E731
    assert sorted(held_out, key=key) == sorted(held_out_again, key=key)
    assert 150 <= len(held_out) <= 250 and len(train) + len(held_out) == 4000
    assert split(rows, 0.05, seed=1)[1] != held_out  # the seed chooses another split


def test_labels_cover_only_the_completion_and_assistant_turns():
    tok = load_length_counter("tiny-llama")
    (ids, labels, length), = encode_rows([{"prompt": "Translate: cat", "completion": " chat"}], "prompt_completion",
                                         tok, 128)
    completion = tok.ids([" chat"])[0]
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and length == len(ids)
    assert [label for label in labels if label != IGNORE] == [*completion, tok.eos_id]
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ciao"}]
    (ids, labels, _), = encode_rows([{"messages": chat}], "chat", tok, 512)
    learned = tok.tokenizer.decode([label for label in labels if label != IGNORE], skip_special_tokens=False)
    assert "hello" in learned and "ciao" in learned and "hi" not in learned and "bye" not in learned


def test_login_node_tokens_equal_the_training_tokenizer_s():
    transformers = pytest.importorskip("transformers")
    from toolkit.train.tiny import build_tokenizer

    tok = load_length_counter("tiny-llama")
    hf = build_tokenizer(Path(pytest.importorskip("tempfile").mkdtemp()))
    assert isinstance(hf, transformers.PreTrainedTokenizerFast)
    for text in ["Translate to French: cat\nAnswer:", " chien", "unicode: café ☕ 東京"]:
        assert tok.ids([text])[0] == hf(text, add_special_tokens=False)["input_ids"]


class CountingCounter(LengthCounter):
    calls = 0

    def ids(self, texts):
        CountingCounter.calls += 1
        return super().ids(texts)


def test_second_validation_of_the_same_data_tokenizes_nothing(tmp_path, monkeypatch):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f" a{i}"}) + "\n" for i in range(150)))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "r", "model": {"base": "tiny-llama"}, "data": {"train": str(data)},
                                      "resources": {"nodes": 1, "gpus_per_node": 1}}))
    profile = tmp_path / "clusters.yaml"
    (tmp_path / "shared").mkdir(exist_ok=True)  # the admins' shared root: ft never makes it
    profile.write_text(yaml.safe_dump({"mine": {"extends": "lab", "shared_root": str(tmp_path / "shared")}}))
    monkeypatch.setenv("FT_CLUSTERS_FILE", str(profile))
    tiny = load_length_counter("tiny-llama")
    counting = CountingCounter(tiny.tokenizer, None)
    monkeypatch.setattr(recipe_data, "tokenizer_for", lambda resolved, override=None: (counting, None))
    resolved = resolve(recipe, "mine")

    first = recipe_data.validate_recipe_data(resolved)
    calls_after_first = CountingCounter.calls
    second = recipe_data.validate_recipe_data(resolved)

    assert calls_after_first > 0 and CountingCounter.calls == calls_after_first
    assert first[0].to_dict() == second[0].to_dict() and first[0].ok
    cache_root = recipe_data.token_cache(user_cache(str(tmp_path / "shared"))).root
    (entry,) = [p for p in cache_root.iterdir() if not p.name.startswith(".")]
    cached = recipe_data.token_cache(user_cache(str(tmp_path / "shared"))).load(entry.name)
    assert len(cached.offsets) - 1 == 150
    # Changing the data changes the key: the new file is validated and tokenized afresh.
    data.write_text(data.read_text() + json.dumps({"prompt": "new", "completion": " row"}) + "\n")
    recipe_data.validate_recipe_data(resolved)
    assert CountingCounter.calls > calls_after_first


def test_missing_data_file_is_a_located_error(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "r", "model": {"base": "tiny-llama"},
                                      "data": {"train": "nowhere/train.jsonl"}}))
    (report,) = recipe_data.validate_recipe_data(resolve(recipe, "lab"))
    assert not report.ok
    finding = report.errors["file_not_found"].examples[0]
    assert finding.location == str(recipe) and finding.field == "data.train"
    assert finding.message == f"{tmp_path / 'nowhere' / 'train.jsonl'}: no such file (the local filesystem)"


@pytest.mark.parametrize("recipe", ["llama3-8b-lora-sft", "llama3-8b-dpo", "llama3-70b-qlora", "llama3-8b-full-32gpu"])
def test_an_unreachable_object_store_is_one_located_line_and_stays_on_this_machine(tmp_path, monkeypatch, recipe):
    """The shipped recipes' s3://example-... data, validated against a site profile whose endpoint is on
    loopback (nothing listening): that endpoint is asked, never a public one, and the answer says so."""
    import socket
    import time

    with socket.socket() as probe:  # a loopback port with nothing behind it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    clusters = tmp_path / "clusters.yaml"
    clusters.write_text(yaml.safe_dump({"site-s3": {"extends": "hyperpod", "s3_endpoint": f"http://127.0.0.1:{port}",
                                                   "shared_root": str(tmp_path / "shared")}}))
    monkeypatch.setenv("FT_CLUSTERS_FILE", str(clusters))
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # the profile's endpoint decides
    path = REPO / "recipes" / f"{recipe}.yaml"
    started = time.monotonic()
    reports = recipe_data.validate_recipe_data(resolve(path, "site-s3"), tokenizer="tiny-llama")
    assert time.monotonic() - started < 60  # bounded retries, not botocore's minutes
    for report, role in zip(reports, ("train", "eval"), strict=False):
        assert not report.ok and list(report.errors) == ["object_store_unreachable"]
        finding = report.errors["object_store_unreachable"].examples[0]
        assert finding.location == str(path) and finding.field == f"data.{role}"
        assert f"the object store at http://127.0.0.1:{port} could not be reached" in finding.message
        assert "s3_endpoint in the site-s3 cluster profile" in finding.message and "\n" not in finding.message


def test_a_cached_report_still_gets_the_recipe_s_own_checks(tmp_path, monkeypatch):
    """The cache holds what the file is; what the recipe asks of it is checked every time."""
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f" a{i}"}) + "\n" for i in range(150)))
    profile = tmp_path / "clusters.yaml"
    (tmp_path / "shared").mkdir(exist_ok=True)  # the admins' shared root: ft never makes it
    profile.write_text(yaml.safe_dump({"mine": {"extends": "lab", "shared_root": str(tmp_path / "shared")}}))
    monkeypatch.setenv("FT_CLUSTERS_FILE", str(profile))
    recipe = tmp_path / "dpo.yaml"
    recipe.write_text(yaml.safe_dump({"name": "r", "model": {"base": "tiny-llama"}, "objective": {"kind": "dpo"},
                                      "data": {"train": str(data)}, "resources": {"nodes": 1, "gpus_per_node": 1}}))
    resolved = resolve(recipe, "mine")
    for _ in range(2):  # the second pass comes from the cache
        (report,) = recipe_data.validate_recipe_data(resolved)
        assert not report.ok and "format_objective_mismatch" in report.errors


@pytest.mark.parametrize("rows,fmt", [
    ([{"prompt": f"q{i}", "completion": f" a{i}"} for i in range(120)], "prompt_completion"),
    ([{"prompt": f"q{i}", "chosen": f" yes{i}", "rejected": f" no{i}"} for i in range(120)], "preference"),
])
def test_a_worker_fills_the_cache_exactly_as_validation_does(tmp_path, monkeypatch, rows, fmt):
    """A run submitted with --skip-validation tokenizes in the worker: same tokens, same split."""
    from toolkit.recipe.schema import Recipe
    from toolkit.train.dataset import build_cache

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    profile = tmp_path / "clusters.yaml"
    (tmp_path / "shared").mkdir(exist_ok=True)  # the admins' shared root: ft never makes it
    profile.write_text(yaml.safe_dump({"mine": {"extends": "lab", "shared_root": str(tmp_path / "shared")}}))
    monkeypatch.setenv("FT_CLUSTERS_FILE", str(profile))
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(yaml.safe_dump({
        "name": "r", "model": {"base": "tiny-llama"}, "objective": {"kind": "dpo" if fmt == "preference" else "sft"},
        "data": {"train": str(data), "eval_fraction": 0.1}, "resources": {"nodes": 1, "gpus_per_node": 1}}))
    resolved = resolve(recipe_file, "mine")
    recipe_data.validate_recipe_data(resolved)
    tok = load_length_counter("tiny-llama")
    key = recipe_data.dataset_key(resolved.recipe, str(data), tok, "train", ObjectStore())
    from_validation = recipe_data.token_cache(user_cache(str(tmp_path / "shared"))).load(key)

    other = recipe_data.token_cache(tmp_path / "worker")
    build_cache(Recipe.model_validate(resolved.recipe.model_dump(mode="json")), tok, other, key)
    from_worker = other.load(key)

    assert len(from_worker.offsets) - 1 == len(rows) * (2 if fmt == "preference" else 1)
    for held_out in (False, True):
        assert from_worker.examples(held_out) == from_validation.examples(held_out)


def test_an_object_store_that_never_answers_is_reported_within_the_deadline(monkeypatch):
    """A loopback server that accepts connections and then says nothing: the check gives up in time."""
    import socket
    import time

    from toolkit.storage.object_store import ObjectStore

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{silent.getsockname()[1]}")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
        started = time.monotonic()
        found = ObjectStore().presence("s3://bucket/train.jsonl", deadline_s=3)
        assert time.monotonic() - started < 10
    assert not found.found and found.unreachable == "no answer within 3 s"


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{% set x = messages.append({'role': 'x'}) %}{{ messages }}",
])
def test_a_chat_template_cannot_reach_python(tmp_path, template):
    """A model folder's chat template renders in jinja2's immutable sandbox, as in transformers: what
    it may not reach is refused, as the template's located failure (toolkit/data/chat_template.py)."""
    from toolkit.data.chat_template import ChatTemplateError
    from toolkit.data.tokenizer import LengthCounter

    counter = LengthCounter(load_length_counter("tiny-llama").tokenizer, template)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError, match="SecurityError: access to attribute .* is unsafe"):
        counter.render_chat(messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_an_unwritable_token_cache_degrades_to_no_cache_with_a_warning(tmp_path, monkeypatch):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f" a{i}"}) + "\n" for i in range(150)))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "r", "model": {"base": "tiny-llama"}, "data": {"train": str(data)}}))
    clusters = tmp_path / "clusters.yaml"
    # A file where the cache folder should be: the user's own folder beside it is used instead.
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "cache").write_text("not a folder")
    clusters.write_text(yaml.safe_dump({"ro": {"extends": "lab", "shared_root": str(tmp_path / "shared")}}))
    monkeypatch.setenv("FT_CLUSTERS_FILE", str(clusters))
    (report,) = recipe_data.validate_recipe_data(resolve(recipe, "ro"))
    assert report.ok and "token_cache_unusable" not in report.warnings
    fallback = tmp_path / "shared" / f".cache-uid-{os.getuid()}"
    assert fallback.is_dir()
    # And a file there too: no user, root included, can create a cache: no cache, and a warning.
    shutil.rmtree(fallback)
    fallback.write_text("not a folder either")
    (report,) = recipe_data.validate_recipe_data(resolve(recipe, "ro"))
    assert report.ok and "token_cache_unusable" in report.warnings
    assert "is not used: " in report.warnings["token_cache_unusable"].examples[0].message
    assert f"{fallback} is not a folder" in report.warnings["token_cache_unusable"].examples[0].message


def test_a_data_file_gone_by_the_time_the_job_reads_it_is_a_user_error_no_restart_helps(tmp_path):
    """Every rank reads the file's digest first: every rank stops with the user-error code (4), which
    the watchdog does not restart, instead of crashing into restarts that fail the same way."""
    from toolkit.recipe.schema import Recipe
    from toolkit.runs.exits import RunEnds
    from toolkit.train.dataset import load_split

    gone = str(tmp_path / "gone.jsonl")
    recipe = Recipe.model_validate({"name": "r", "model": {"base": "tiny-llama"}, "data": {"train": gone}})
    with pytest.raises(RunEnds) as ended:
        load_split(recipe, Path("tiny-llama"), tmp_path, 0, None, print, gone, "train", False)
    assert ended.value.code == 4 and "cannot be read" in str(ended.value)


def test_a_long_conversation_is_encoded_as_before_with_renders_bounded_by_max_len():
    """Turns past max_len are cut anyway: a 2,000-turn row renders its prefixes only up to max_len and
    the whole once (it rendered 2,000 growing prefixes: quadratic), with the same ids, labels, length."""
    tok = load_length_counter("tiny-llama")
    chat = [{"role": "user" if turn % 2 == 0 else "assistant", "content": f"turn {turn} says hello"}
            for turn in range(2000)]
    renders = []
    real = tok.render_chat
    tok.render_chat = lambda messages: renders.append(len(messages)) or real(messages)
    (ids, labels, length), = encode_rows([{"messages": chat}], "chat", tok, 128)
    assert len(renders) < 40 and renders[-1] == 2000
    assert length == len(tok.ids([real(chat)])[0]) and len(ids) == len(labels) == 128
    full_ids, full_labels = [], []
    for turn in range(len(chat)):  # the per-turn rule, all the way, as it was
        prefix = tok.ids([real(chat[: turn + 1])])[0]
        new = prefix[len(full_ids):]
        full_labels += new if chat[turn]["role"] == "assistant" else [IGNORE] * len(new)
        full_ids = prefix
        if len(full_ids) > 200:
            break
    assert ids == full_ids[:128] and labels == full_labels[:128]
