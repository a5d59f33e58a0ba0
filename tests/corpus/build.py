"""Build the corpus of broken and hostile inputs that every ft command runs over in CI
(tests/unit/test_corpus.py). Deterministic; rerun after adding a case:

    .venv/bin/python tests/corpus/build.py

recipes/   YAML recipes: broken syntax, wrong types, hostile strings, values that must be refused
profiles/  user cluster-profile files (FT_CLUSTERS_FILE)
data/      data files: JSONL, CSV, Parquet, gzip and zstd, broken every way a file breaks
runs/      run directories with damaged records (for `ft ls` and `ft status`)
Cases that cannot live in git (FIFOs, symlink loops, folders named like files) are made by the
test itself. The fuzzing seeds (tests/unit/test_fuzz.py) live in seeds/.
"""

from __future__ import annotations

import gzip
import io
import json
import shutil
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
GOOD_ROWS = [{"prompt": f"Question {i}: what is {i} plus {i}?", "completion": f" {2 * i}"} for i in range(150)]
GOOD_JSONL = b"".join(json.dumps(row).encode() + b"\n" for row in GOOD_ROWS)
BASE = {"name": "corpus", "model": {"base": "tiny-llama"}, "data": {"train": "../data/good.jsonl",
                                                                     "max_seq_len": 128},
        "training": {"steps": 10, "micro_batch": 1, "global_batch": 2}, "resources": {"nodes": 1,
                                                                                      "gpus_per_node": 1}}
HOSTILE_STRINGS = ["$(touch /tmp/ft-corpus-pwned)", "`id`", "a\nb", "x'; rm -rf / #", "--help", "%j%u",
                   "[red]x[/red]", "\x1b[31m", "ü" * 70, " leading", "a" * 300, ""]


def with_value(dotted: str, value) -> dict:
    recipe = json.loads(json.dumps(BASE))
    node = recipe
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return recipe


def recipe_cases() -> dict[str, str]:
    cases: dict[str, str] = {
        "alias-bomb.yaml": "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
            f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(9)),
        "deep-flow.yaml": "name: x\nmodel: " + "[" * 5000 + "]" * 5000 + "\n",
        "deep-block.yaml": "name: x\nmodel:\n  " + "- " * 5000 + "x\n",
        "duplicate-key.yaml": "name: a\nmodel: {base: tiny-llama}\nname: b\n",
        "empty.yaml": "",
        "only-comment.yaml": "# nothing here\n",
        "top-level-list.yaml": "- name: x\n",
        "top-level-scalar.yaml": "just a string\n",
        "tabs.yaml": "name: x\nmodel:\n\tbase: tiny-llama\n",
        "unclosed-quote.yaml": 'name: "x\nmodel: {base: tiny-llama}\n',
        "unknown-key.yaml": yaml.safe_dump(BASE | {"trainng": {"steps": 1}}),
        "unknown-nested-key.yaml": yaml.safe_dump(with_value("training.stpes", 10)),
        "python-tag.yaml": "name: !!python/object/apply:os.system ['touch /tmp/ft-corpus-pwned']\n",
        "binary-tag.yaml": "name: !!binary aGVsbG8=\n",
        "huge-int.yaml": yaml.safe_dump(BASE).replace("steps: 10", "steps: " + "9" * 5000),
        "missing-name.yaml": yaml.safe_dump({k: v for k, v in BASE.items() if k != "name"}),
        "missing-model.yaml": yaml.safe_dump({k: v for k, v in BASE.items() if k != "model"}),
        "missing-data.yaml": yaml.safe_dump({k: v for k, v in BASE.items() if k != "data"}),
    }
    bad_values = {
        "resources.nodes": ["two", -1, 0, 10**9, 1.5, None, [1], True],
        "resources.gpus_per_node": [-1, 1000, "8"],
        "resources.time": ["٠٤:٠٠:٠٠", "abc", "04:00", "-1", "1-", "04:00:00\n#SBATCH --x", "99:99:99", "1-24:00:00",
                           90],
        "resources.tier": ["platinum", 1],
        "resources.account": ["a b", "a\nb", "$(id)"],
        "method.kind": ["rlhf", None],
        "method.rank": [0, -4, 100000],
        "method.dropout": [1.5, -0.1],
        "method.target_modules": ["q_proj", [1, 2], [""]],
        "training.learning_rate": [-1, 0, 2, ".nan", "fast"],
        "training.micro_batch": [0, 3],
        "training.global_batch": [0, -2],
        "training.steps": [0, -5, False],
        "training.epochs": [0, -1, float("inf"), float("nan")],
        "training.zero_stage": [4, -1],
        "training.precision": ["fp8", 16],
        "training.lr_schedule": ["exp"],
        "data.max_seq_len": [0, 10**9, "long"],
        "data.too_long": ["ignore"],
        "data.eval_fraction": [0.9, -0.1],
        "data.format": ["xml"],
        "data.train": ["", "s3://bucket-only", "http://example.org/x.jsonl", "a\nb.jsonl"],
        "checkpoint.s3_mirror": ["http://x", "bucket"],
        "checkpoint.keep_last": [0],
        "cluster": ["no-such-cluster", "lab\n"],
        "tracking.wandb.mode": ["loud"],
        "env": [["A=1"], {"FT_RUN_DIR": "/x"}, {"SHELLOPTS": "xtrace"}, {"HF_TOKEN": "x"},
                {"NOTE": "hf_" + "a1" * 20}, {"URL": "https://u:p@h/x"}, {"1BAD": "x"}, {"NOTE": "x" * 140_000}],
    }
    for dotted, values in bad_values.items():
        for index, value in enumerate(values):
            cases[f"bad-{dotted.replace('.', '-')}-{index}.yaml"] = yaml.safe_dump(with_value(dotted, value))
    for index, text in enumerate(HOSTILE_STRINGS):
        cases[f"hostile-name-{index}.yaml"] = yaml.safe_dump(with_value("name", text))
        cases[f"hostile-env-{index}.yaml"] = yaml.safe_dump(with_value("env", {"NOTE": text}))
    cases["nul-in-env.yaml"] = yaml.safe_dump(with_value("env", {"NOTE": "a\0b"}))
    # Valid recipes whose data `ft validate` must refuse.
    for index, train in enumerate(["../data/missing.jsonl", "../data", "../data/no-extension", "s3:/bad",
                                   "../data/truncated.jsonl.gz", "../data/not-json.jsonl"]):
        cases[f"data-refused-{index}.yaml"] = yaml.safe_dump(with_value("data.train", train))
    return cases


def profile_cases() -> dict[str, str]:
    return {
        "partition-newline.yaml": yaml.safe_dump({"p": {"extends": "lab",
                                                        "tiers": {"standard": {"partition": "a\nb"}}}}),
        "fabric-injection.yaml": yaml.safe_dump({"p": {"extends": "lab", "fabric": "efa$(id)"}}),
        "unknown-parent.yaml": yaml.safe_dump({"p": {"extends": "nowhere"}}),
        "not-a-mapping.yaml": "- p\n",
        "body-a-list.yaml": yaml.safe_dump({"p": ["extends", "lab"]}),
        "bad-endpoint.yaml": yaml.safe_dump({"p": {"extends": "lab", "s3_endpoint": "ftp://x y"}}),
        "negative-gpus.yaml": yaml.safe_dump({"p": {"extends": "lab", "gpus_per_node": -1}}),
        "percent-root.yaml": yaml.safe_dump({"p": {"extends": "lab", "shared_root": "/tmp/a%jb"}}),
        "account-space.yaml": yaml.safe_dump({"p": {"extends": "lab", "default_account": "a b"}}),
        "bomb.yaml": "p: &m {extends: lab}\n" + recipe_cases()["alias-bomb.yaml"],
    }


def parquet(columns: dict) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    pq.write_table(pa.table(columns), sink)
    return sink.getvalue()


def zstd(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor().compress(data)


def data_cases() -> dict[str, bytes]:
    import datetime
    import decimal

    rows = GOOD_JSONL.splitlines(keepends=True)
    cases = {
        "good.jsonl": GOOD_JSONL,
        "empty.jsonl": b"",
        "blank-lines.jsonl": b"\n\n   \n",
        "bom.jsonl": b"\xef\xbb\xbf" + GOOD_JSONL,
        "invalid-utf8.jsonl": GOOD_JSONL + b'{"prompt": "\xff\xfe", "completion": "x"}\n',
        "not-json.jsonl": GOOD_JSONL + b"{not json\n",
        "array-row.jsonl": GOOD_JSONL + b"[1, 2]\n",
        "number-row.jsonl": GOOD_JSONL + b"42\n",
        "deep-json.jsonl": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n" + GOOD_JSONL,
        # Within Python's parser but past the readers after it (duplicates, PII scan): 600-900 deep.
        "deep-extra-field.jsonl": GOOD_JSONL + b'{"prompt": "q", "completion": "a", "meta": ' + b"[" * 900
        + b"]" * 900 + b"}\n",
        "lone-surrogate.jsonl": GOOD_JSONL + b'{"prompt": "\\ud800 half a pair", "completion": "a"}\n'
        + b'{"prompt": "q", "completion": "a", "\\udc00": 1}\n',
        "nested-extra-types.parquet": parquet({"prompt": ["q"] * 150, "completion": ["a"] * 150,
                                               "meta": [{"price": decimal.Decimal("1.50"), "when": [datetime.datetime(
                                                   2026, 1, 1)], "raw": b"\x00\xff"}] * 150}),
        "deep-messages.jsonl": b'{"messages": ' + b"[" * 600 + b"]" * 600 + b"}\n" + GOOD_JSONL,
        "huge-number.jsonl": b'{"prompt": "q", "completion": ' + b"9" * 5000 + b"}\n" + GOOD_JSONL,
        "nul-bytes.jsonl": GOOD_JSONL + b'{"prompt": "a\x00b", "completion": "c"}\n',
        "crlf.jsonl": GOOD_JSONL.replace(b"\n", b"\r\n"),
        "prompt-int.jsonl": GOOD_JSONL + b'{"prompt": 5, "completion": "x"}\n',
        "missing-completion.jsonl": GOOD_JSONL + b'{"prompt": "x"}\n',
        "messages-not-list.jsonl": b"".join(b'{"messages": "hi"}\n' for _ in range(150)),
        "bad-role.jsonl": b"".join(b'{"messages": [{"role": "wizard", "content": "x"}]}\n' for _ in range(150)),
        "mixed-formats.jsonl": GOOD_JSONL + b'{"messages": [{"role": "user", "content": "x"}]}\n',
        "preference-same.jsonl": b"".join(b'{"prompt": "p", "chosen": "a", "rejected": "a"}\n' for _ in range(150)),
        "too-few-rows.jsonl": b"".join(rows[:5]),
        "long-line.jsonl.gz": gzip.compress(b'{"prompt": "' + b"x" * (17 << 20) + b'"}\n' + GOOD_JSONL, mtime=0),
        # The reviewer's case: a small gzip holding one line of a gigabyte (it once took 4.2 GB).
        "line-bomb.jsonl.gz": gzip.compress(b'{"prompt": "' + b"x" * (1 << 30), compresslevel=9, mtime=0),
        "duplicates.jsonl": GOOD_JSONL + GOOD_JSONL,
        "pii.jsonl": GOOD_JSONL + b'{"prompt": "mail me at jane.doe@example.org", "completion": "ok"}\n',
        "good.jsonl.gz": gzip.compress(GOOD_JSONL, mtime=0),
        "truncated.jsonl.gz": gzip.compress(GOOD_JSONL, mtime=0)[:-20],
        "garbage.jsonl.gz": b"not gzip at all" * 20,
        "empty.jsonl.gz": gzip.compress(b"", mtime=0),
        "good.jsonl.zst": zstd(GOOD_JSONL),
        "truncated.jsonl.zst": zstd(GOOD_JSONL)[:-7],
        "garbage.jsonl.zst": b"not zstd at all" * 20,
        "multi-frame.jsonl.zst": zstd(GOOD_JSONL[:3000]) + zstd(GOOD_JSONL[3000:]),
        "gzip-named-jsonl.jsonl": gzip.compress(GOOD_JSONL, mtime=0),
        "good.csv": b"prompt,completion\n" + b"".join(f'"{r["prompt"]}","{r["completion"]}"\n'.encode()
                                                      for r in GOOD_ROWS),
        "header-only.csv": b"prompt,completion\n",
        "extra-cells.csv": b"prompt,completion\n" + b"a,b,c\n" * 150,
        "missing-columns.csv": b"question,answer\n" + b"a,b\n" * 150,
        "unbalanced-quote.csv": b'prompt,completion\n"a,b\n' + b"c,d\n" * 150,
        "invalid-utf8.csv": b"prompt,completion\n" + b"\xff,\xfe\n" * 150,
        "good.parquet": parquet({"prompt": [r["prompt"] for r in GOOD_ROWS],
                                 "completion": [r["completion"] for r in GOOD_ROWS]}),
        "bytes-column.parquet": parquet({"prompt": ["q"] * 150, "completion": [b"\x00"] * 150}),
        "timestamp-column.parquet": parquet({"prompt": ["q"] * 150,
                                             "completion": [datetime.datetime(2026, 1, 1)] * 150}),
        "empty-table.parquet": parquet({"prompt": [], "completion": []}),
        "not-parquet.parquet": GOOD_JSONL,
        "no-extension": GOOD_JSONL,
        "array.json": json.dumps(GOOD_ROWS).encode(),
        "unknown.txt": GOOD_JSONL,
    }
    corrupt = bytearray(cases["good.parquet"])
    for offset in range(8, 200):
        corrupt[offset] ^= 0xFF
    cases["corrupt-page.parquet"] = bytes(corrupt)
    return cases


RUN = {"run_id": "r", "recipe_name": "r", "recipe_path": "/x.yaml", "cluster": "lab", "mode": "train",
       "created": 1.0, "idempotency_key": None, "jobs": []}


def run_cases() -> dict[str, dict[str, str]]:
    """A run directory each: file name -> content."""
    return {
        "torn-record": {"run.json": '{"run_id": "torn-re'},
        "list-record": {"run.json": "[]"},
        "other-id": {"run.json": json.dumps(RUN | {"run_id": "someone-else"})},
        "jobs-not-list": {"run.json": json.dumps(RUN | {"run_id": "jobs-not-list", "jobs": 5})},
        "torn-attempts": {"run.json": json.dumps(RUN | {"run_id": "torn-attempts"}),
                          "attempts.jsonl": '{"job_id": "1", "restart": 0, "nodes": ["n1"], "started": 1}\n{"job'},
        "foreign-attempts": {"run.json": json.dumps(RUN | {"run_id": "foreign-attempts"}),
                             "attempts.jsonl": '[1]\n{"job_id": 5}\n"x"\n'},
        "bad-summary": {"run.json": json.dumps(RUN | {"run_id": "bad-summary"}), "summary.json": "[1, 2"},
        "bad-tracking": {"run.json": json.dumps(RUN | {"run_id": "bad-tracking"}), "tracking.json": "7"},
    }


def build() -> None:
    for folder in ("recipes", "profiles", "data", "runs"):
        shutil.rmtree(HERE / folder, ignore_errors=True)
        (HERE / folder).mkdir()
    for name, text in recipe_cases().items():
        (HERE / "recipes" / name).write_text(text)
    for name, text in profile_cases().items():
        (HERE / "profiles" / name).write_text(text)
    for name, raw in data_cases().items():
        (HERE / "data" / name).write_bytes(raw)
    for run, files in run_cases().items():
        (HERE / "runs" / run).mkdir()
        for name, text in files.items():
            (HERE / "runs" / run / name).write_text(text)


if __name__ == "__main__":
    build()
    counts = {folder: sum(1 for _ in (HERE / folder).iterdir()) for folder in ("recipes", "profiles", "data", "runs")}
    print(counts, "total", sum(counts.values()))
