"""Tokenization in batches on ``workers`` processes, the results in input order.

The reading process groups documents into batches (`BATCH_DOCUMENTS` documents or
`BATCH_BYTES` of text, whichever comes first) and hands them to a pool of worker
processes, each holding its own copy of the tokenizer and encoding a batch with one
``encode_batch`` call (the ``tokenizers`` package's Rust batch path for a Hugging Face
tokenizer, kept to one thread per worker so N workers use N cores). At most
``2 x workers`` batches are in flight, so memory stays bounded, and results are taken
back in submission order: every document is encoded on its own, so the output is the
same bytes for any worker count. One worker encodes in the reading process itself.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor

import numpy as np

from optimized.data.tokenizers import Tokenizer

BATCH_DOCUMENTS = 512
BATCH_BYTES = 1 << 20
IN_FLIGHT_PER_WORKER = 4
"""Batches submitted ahead per worker. Results are taken in input order, so a worker that
finishes the batches queued behind a slower one idles until the slow one is taken; four per
worker (4 MB of text each) keeps every worker busy through that."""


def default_workers() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def batches(
    documents: Iterable[tuple[int, str]],
) -> Iterator[tuple[list[int], list[str], int]]:
    """``(source numbers, texts, characters)`` of consecutive documents, batch by batch."""
    numbers: list[int] = []
    texts: list[str] = []
    size = 0
    for number, text in documents:
        numbers.append(number)
        texts.append(text)
        size += len(text)
        if len(texts) >= BATCH_DOCUMENTS or size >= BATCH_BYTES:
            yield numbers, texts, size
            numbers, texts, size = [], [], 0
    if texts:
        yield numbers, texts, size


_WORKER_TOKENIZER: Tokenizer | None = None
_WORKER_DTYPE: np.dtype | None = None


def _start_worker(tokenizer: Tokenizer, dtype: np.dtype) -> None:
    global _WORKER_TOKENIZER, _WORKER_DTYPE  # noqa: PLW0603 (one per worker process)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker
    _WORKER_TOKENIZER, _WORKER_DTYPE = tokenizer, dtype


def encode_texts(
    tokenizer: Tokenizer, dtype: np.dtype, texts: list[str]
) -> tuple[np.ndarray, np.ndarray]:
    """``texts`` encoded, each followed by the end-of-document id, back to back in
    ``dtype``, and each document's length (its end-of-document id included)."""
    encoded = tokenizer.encode_batch(texts)
    lengths = np.fromiter((ids.size + 1 for ids in encoded), dtype=np.int64, count=len(encoded))
    out = np.empty(int(lengths.sum()), dtype=dtype)
    ends = np.cumsum(lengths)
    out[ends - 1] = tokenizer.eod_id
    vocab = tokenizer.vocab_size
    for ids, end, length in zip(encoded, ends, lengths, strict=True):
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"the tokenizer produced ids outside its vocabulary 0..{vocab - 1}")
        out[end - length : end - 1] = ids
    return out, lengths


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER_TOKENIZER is not None and _WORKER_DTYPE is not None
    return encode_texts(_WORKER_TOKENIZER, _WORKER_DTYPE, texts)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """``TOKENIZERS_PARALLELISM=false`` while encoding in this process, then as it was."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def encode_ordered(
    tokenizer: Tokenizer,
    dtype: np.dtype,
    documents: Iterable[tuple[int, str]],
    workers: int = 1,
) -> Iterator[tuple[list[int], np.ndarray, np.ndarray]]:
    """``(source numbers, tokens, lengths)`` per batch of ``documents``, in input order."""
    if workers < 1:
        raise ValueError(f"workers = {workers}: must be >= 1")
    if workers == 1:
        with _one_thread():
            for numbers, texts, _ in batches(documents):
                tokens, lengths = encode_texts(tokenizer, dtype, texts)
                yield numbers, tokens, lengths
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    pool = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context(method),
        initializer=_start_worker,
        initargs=(tokenizer, dtype),
    )
    pending: deque[tuple[list[int], Future]] = deque()
    try:
        for numbers, texts, _ in batches(documents):
            pending.append((numbers, pool.submit(_encode_in_worker, texts)))
            while len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                done_numbers, future = pending.popleft()
                yield done_numbers, *future.result()
        while pending:
            done_numbers, future = pending.popleft()
            yield done_numbers, *future.result()
    finally:
        for _, future in pending:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
