"""Benchmark data validation, in one run on this machine:

  ft validation   validate_file on a 1-million-row JSONL with token counting (the tiny tokenizer)
  datasets        datasets.load_dataset("json") + batched map tokenization of the same file with
                  the same tokenizer (a fresh cache directory, as a first run would have)

Prints rows per second of each and the ratio (target >= 1.5x), then the peak resident memory of
validating a 10-million-row file in a fresh process (target <= 1 GB).
    python benchmarks/data_validation.py [--rows 1000000] [--big-rows 10000000]
Needs the `datasets` package (pip install -c constraints.txt datasets) for the comparison.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "model", "data", "train", "token",
         "batch", "node", "rank"]
MEASURE_PEAK = """
import resource, sys
from toolkit.data.tokenizer import load_length_counter
from toolkit.data.validate import Limits, validate_file
counter = load_length_counter("tiny-llama")
report = validate_file(sys.argv[1], counter=counter, limits=Limits(max_seq_len=512))
print(report.rows, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def make_jsonl(path: Path, rows: int) -> None:
    rnd = random.Random(0)
    with open(path, "w") as handle:
        for index in range(rows):
            prompt = " ".join(rnd.choice(WORDS) for _ in range(12))
            completion = " ".join(rnd.choice(WORDS) for _ in range(6))
            handle.write(json.dumps({"prompt": f"Q{index}: {prompt}", "completion": f" {completion}"}) + "\n")


def ft_rate(path: Path, rows: int) -> float:
    from toolkit.data.tokenizer import load_length_counter
    from toolkit.data.validate import Limits, validate_file

    started = time.monotonic()
    report = validate_file(str(path), counter=load_length_counter("tiny-llama"), limits=Limits(max_seq_len=512))
    assert report.rows == rows
    return rows / (time.monotonic() - started)


def datasets_rate(path: Path, rows: int, work: Path) -> float:
    import datasets
    from transformers import PreTrainedTokenizerFast

    from toolkit.data.tiny_tokenizer import train_tiny_tokenizer

    datasets.disable_progress_bars()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=train_tiny_tokenizer())
    started = time.monotonic()
    dataset = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(work / "hf"))

    def tokenize(batch):
        return {"prompt_ids": tokenizer(batch["prompt"], add_special_tokens=False)["input_ids"],
                "completion_ids": tokenizer(batch["completion"], add_special_tokens=False)["input_ids"]}

    mapped = dataset.map(tokenize, batched=True, batch_size=2048)
    assert len(mapped) == rows
    return rows / (time.monotonic() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--big-rows", type=int, default=10_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ft-bench-data-") as tmp:
        work = Path(tmp)
        data = work / "rows.jsonl"
        make_jsonl(data, args.rows)
        ours = ft_rate(data, args.rows)
        print(f"ft validation  {ours:10.0f} rows/s")
        try:
            theirs = datasets_rate(data, args.rows, work)
            print(f"datasets       {theirs:10.0f} rows/s")
            ratio = ours / theirs
            print(f"ratio          x{ratio:.2f} ({'met' if ratio >= 1.5 else 'MISSED'} target >= 1.5x)")
        except ImportError as exc:
            print(f"datasets comparison skipped: {exc}")
        if args.big_rows:
            big = work / "big.jsonl"
            make_jsonl(big, args.big_rows)
            out = subprocess.run([sys.executable, "-c", MEASURE_PEAK, str(big)], capture_output=True, text=True,
                                 check=True).stdout.split()
            peak_mb = int(out[1]) / 1024
            print(f"peak memory validating {int(out[0]):,} rows: {peak_mb:.0f} MB "
                  f"({'met' if peak_mb <= 1024 else 'MISSED'} target <= 1024 MB)")


if __name__ == "__main__":
    main()
