"""prepare-data against its physical limit, and a trainer's view of a large index.

- ``encode_batch``: the ``tokenizers`` package's own batch encoding of the corpus, texts
  already in memory, on all the cores (its Rust threads): the limit. ``prepare-data``
  adds reading, parsing, ordering and writing; it should keep >= 0.8x of the limit's
  tokens/s with as many workers as cores, and 2 workers >= 1.7x one.
- ``open_index``: opening a synthetic Megatron ``.idx`` of many documents; the reader's
  resident memory for it is measured in a fresh process (``extra_info``).

The corpus is generated (Zipf-distributed pseudo-words in documents of 100-800 words, as
JSON lines) and a byte-level BPE of 8192 ids is trained on its first 8 MB: nothing is
downloaded. Small by default; ``TWINPIPE_BENCH_CORPUS_MB`` (e.g. 1000 for the issue's 1 GB)
and ``TWINPIPE_BENCH_INDEX_DOCS`` (e.g. 100000000) set the big run. Each figure is in
``extra_info``: ``tokens_per_s``, ``tokens_per_cpu_s`` (tokens per CPU-second of the
process and its workers: what the pipeline costs, whatever else the machine runs),
``mb_per_s``, ``workers``, ``corpus_mb``;
``open_seconds`` and ``rss_delta_mb`` for the index.

    pytest benchmarks/bench_prepare_data.py --benchmark-json=out.json
"""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from optimized.data.encoding import default_workers
from optimized.data.indexed import HEADER_BYTES, MAGIC, IndexedReader, dtype_code
from optimized.data.preparation import prepare_data, read_sidecar
from optimized.data.tokenizers import load_tokenizer

CORPUS_MB = float(os.environ.get("TWINPIPE_BENCH_CORPUS_MB", "4"))
INDEX_DOCS = int(os.environ.get("TWINPIPE_BENCH_INDEX_DOCS", str(10**6)))
TRAIN_BYTES = 8_000_000
VOCAB = 8192
ROOT = Path(__file__).resolve().parents[1]


def _words(rng: np.random.Generator, count: int) -> np.ndarray:
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    lengths = rng.integers(2, 10, size=count)
    return np.array(["".join(rng.choice(letters, size=n)) for n in lengths])


def write_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """JSON lines of about ``megabytes`` MB; returns the documents written."""
    rng = np.random.default_rng(seed)
    words = _words(rng, 20_000)
    punctuation = np.array([" ", " ", " ", " ", " ", " ", ", ", ". ", ".\n"])
    budget, written, documents = int(megabytes * 1e6), 0, 0
    with open(path, "w", encoding="utf-8") as out:
        while written < budget:
            n = int(rng.integers(100, 800))
            ids = np.minimum(rng.zipf(1.3, size=n) - 1, words.size - 1)
            glue = rng.choice(punctuation, size=n)
            text = "".join(np.char.add(words[ids], glue).tolist())
            line = json.dumps({"id": documents, "text": text}) + "\n"
            out.write(line)
            written += len(line)
            documents += 1
    return documents


def train_bpe(corpus: Path, path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts():
        seen = 0
        with open(corpus, encoding="utf-8") as lines:
            for line in lines:
                text = json.loads(line)["text"]
                seen += len(text)
                yield text
                if seen > TRAIN_BYTES:
                    return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepare-bench")
    path = root / "corpus.jsonl"
    documents = write_corpus(path, CORPUS_MB)
    return root, path, train_bpe(path, root / "tokenizer.json"), documents


def _cpu_seconds() -> float:
    """User + system CPU time of this process and its reaped children (the workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _info(benchmark, **info) -> None:
    benchmark.group = "prepare-data"
    benchmark.extra_info.update(cores=default_workers(), corpus_mb=CORPUS_MB, **info)


def test_encode_batch_limit(benchmark, corpus):
    """The ``tokenizers`` package alone: every text in memory, one ``encode_batch_fast``
    per 4096 documents, its threads on every core."""
    _, path, tokenizer, _ = corpus
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tokenizer))
    with open(path, encoding="utf-8") as lines:
        texts = [json.loads(line)["text"] for line in lines]
    os.environ.pop("TOKENIZERS_PARALLELISM", None)

    def run() -> int:
        tokens = 0
        for start in range(0, len(texts), 4096):
            batch = raw.encode_batch_fast(texts[start : start + 4096], add_special_tokens=False)
            tokens += sum(len(e.ids) + 1 for e in batch)
        return tokens

    start, cpu = time.perf_counter(), _cpu_seconds()
    tokens = benchmark.pedantic(run, rounds=1, iterations=1)
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    _info(benchmark, implementation="encode_batch", tokens=tokens, tokens_per_s=tokens / seconds,
          tokens_per_cpu_s=tokens / cpu, cpu_seconds=cpu,
          mb_per_s=path.stat().st_size / 1e6 / seconds)  # fmt: skip


@pytest.mark.parametrize("workers", sorted({1, 2, default_workers()}))
def test_prepare_data(benchmark, corpus, workers):
    root, path, tokenizer, _ = corpus
    tok = load_tokenizer(tokenizer)
    outs = iter(root / f"out-{workers}-{i}" for i in range(100))

    def run():
        out = next(outs)
        prepare_data([path], tok, out, progress=False, workers=workers)
        return out

    start, cpu = time.perf_counter(), _cpu_seconds()
    out = benchmark.pedantic(run, rounds=1, iterations=1)
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    tokens = read_sidecar(out)["num_tokens"]
    _info(benchmark, implementation=f"prepare-data --workers {workers}", workers=workers,
          tokens=tokens, tokens_per_s=tokens / seconds, tokens_per_cpu_s=tokens / cpu,
          cpu_seconds=cpu, mb_per_s=path.stat().st_size / 1e6 / seconds)  # fmt: skip


def write_synthetic_index(prefix: Path, documents: int, length: int = 100) -> None:
    """A Megatron ``.idx`` of ``documents`` documents of ``length`` uint16 tokens, written
    with numpy block by block, and a sparse ``.bin`` of the size it points to."""
    block = 1 << 22
    with open(f"{prefix}.idx", "wb") as out:
        out.write(MAGIC + struct.pack("<QB", 1, dtype_code(np.uint16)))
        out.write(struct.pack("<QQ", documents, documents + 1))
        for start in range(0, documents, block):
            out.write(np.full(min(block, documents - start), length, np.int32).tobytes())
        for start in range(0, documents, block):
            stop = min(start + block, documents)
            out.write((np.arange(start, stop, dtype=np.int64) * 2 * length).tobytes())
        for start in range(0, documents + 1, block):
            out.write(np.arange(start, min(start + block, documents + 1), dtype=np.int64).tobytes())
    with open(f"{prefix}.bin", "wb") as out:
        out.truncate(documents * length * 2)
    assert Path(f"{prefix}.idx").stat().st_size == HEADER_BYTES + 20 * documents + 8


_RSS_PROBE = """
import sys, time
from optimized.data.indexed import IndexedReader
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
before = rss()
start = time.perf_counter()
reader = IndexedReader(sys.argv[1])
n, t = reader.num_sequences, reader.num_tokens
seq = reader.sequence(n // 2).sum() + reader.sequence(n - 1).sum()
seconds = time.perf_counter() - start
print(seconds, rss() - before, n, t)
"""


def test_open_index(benchmark, tmp_path):
    prefix = tmp_path / "synthetic"
    write_synthetic_index(prefix, INDEX_DOCS)

    def run():
        reader = IndexedReader(prefix)
        return reader.num_sequences, reader.num_tokens

    assert benchmark.pedantic(run, rounds=3, iterations=1) == (INDEX_DOCS, INDEX_DOCS * 100)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    probe = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(prefix)], env=env,
                           capture_output=True, text=True, check=True)  # fmt: skip
    seconds, rss, _, _ = probe.stdout.split()
    _info(benchmark, implementation="IndexedReader", documents=INDEX_DOCS,
          idx_mb=(HEADER_BYTES + 20 * INDEX_DOCS + 8) / 1e6,
          open_seconds=float(seconds), rss_delta_mb=int(rss) / 1e6)  # fmt: skip
