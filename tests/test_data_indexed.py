"""Megatron-Core's indexed dataset: what twinpipe writes megatron-core reads, what
megatron-core writes twinpipe reads, token for token; corrupted files are refused by name."""

from __future__ import annotations

import struct
import warnings

import numpy as np
import pytest

from models.runtime import BadInput
from optimized.data.indexed import (
    HEADER_BYTES,
    IndexedReader,
    IndexedWriter,
    bin_path,
    idx_path,
    token_dtype,
)


def _documents(seed: int, count: int, vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(0, 40))) for _ in range(count)]


def _megatron():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset  # noqa: PLC0415
    return indexed_dataset


def _write(prefix, documents, dtype) -> None:
    with IndexedWriter(prefix, dtype) as writer:
        for doc in documents[:3]:
            writer.add_document(doc)
        rest = documents[3:]
        lengths = np.array([d.size for d in rest])
        writer.add_documents(np.concatenate(rest) if rest else np.zeros(0), lengths)


@pytest.mark.slow
@pytest.mark.parametrize("vocab", [257, 70_000])
def test_megatron_reads_what_twinpipe_writes_and_back(tmp_path, vocab):
    """Both directions in one import of megatron-core (slow: the import is seconds)."""
    mcore = _megatron()
    docs = _documents(0, 50, vocab)
    ours = tmp_path / "ours"
    _write(ours, docs, token_dtype(vocab))
    theirs = mcore.IndexedDataset(str(ours))
    assert len(theirs) == len(docs)
    assert list(theirs.document_indices) == list(range(len(docs) + 1))
    assert theirs.index.dtype == token_dtype(vocab).type
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(theirs[i], doc)

    built = tmp_path / "theirs"
    dtype = mcore.DType.optimal_dtype(vocab)
    builder = mcore.IndexedDatasetBuilder(str(bin_path(built)), dtype=dtype)
    for doc in docs:
        builder.add_document(doc, [doc.size])
    builder.finalize(str(idx_path(built)))
    reader = IndexedReader(built)
    assert reader.dtype == np.dtype(dtype) == token_dtype(vocab)
    assert reader.num_sequences == reader.num_documents == len(docs)
    assert reader.num_tokens == sum(d.size for d in docs)
    np.testing.assert_array_equal(reader.tokens, np.concatenate(docs))
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(reader.sequence(i), doc)
    assert idx_path(built).read_bytes() == idx_path(ours).read_bytes()  # byte for byte
    assert bin_path(built).read_bytes() == bin_path(ours).read_bytes()


@pytest.mark.slow
def test_train_takes_a_folder_megatron_core_wrote(tmp_path):
    """A folder holding one pair megatron-core's builder wrote, no sidecar: the trainer's
    checks pass it (the ids are scanned, no tokenizer being known) and its dataset reads
    the tokens; ids beyond the model's vocabulary are refused by name."""
    from optimized.data.preparation import MEGATRON_FORMAT, open_prepared  # noqa: PLC0415
    from optimized.train import (  # noqa: PLC0415
        TokenDataset,
        TrainConfig,
        apply_overrides,
        validate_config,  # noqa: PLC0415
    )
    from optimized.train.preflight import plan_run  # noqa: PLC0415

    mcore = _megatron()
    for name, vocab in (("fits", 500), ("wide", 2000)):
        folder = tmp_path / name
        folder.mkdir()
        docs = _documents(3, 60, vocab)
        builder = mcore.IndexedDatasetBuilder(str(folder / "c_text_document.bin"), np.uint16)
        for doc in docs:
            builder.add_document(doc, [doc.size])
        builder.finalize(str(folder / "c_text_document.idx"))
        sidecar, _ = open_prepared(folder)
        assert sidecar["format"] == MEGATRON_FORMAT and sidecar["vocab_size"] is None
        sets = ["model.name=tiny-deepseek-v2", f"data.path={folder}", "data.seq_len=16"]
        cfg = validate_config(apply_overrides(TrainConfig(), sets))
        if name == "fits":  # tiny-deepseek-v2 has 512 ids
            assert plan_run(cfg).data_dir == str(folder)
            dataset = TokenDataset(folder, seq_len=16)
            np.testing.assert_array_equal(dataset.tokens, np.concatenate(docs))
        else:
            with pytest.raises(BadInput, match="beyond the model's vocabulary"):
                plan_run(cfg)


def test_reader_views_and_writer_leaves_nothing_on_error(tmp_path):
    docs = _documents(1, 7, 257)
    _write(tmp_path / "a", docs, np.uint16)
    reader = IndexedReader(tmp_path / "a")
    assert isinstance(reader.tokens, np.memmap) and reader.tokens.dtype == np.uint16
    np.testing.assert_array_equal(reader.sequence_lengths, [d.size for d in docs])
    np.testing.assert_array_equal(
        reader.sequence_pointers, np.cumsum([0] + [2 * d.size for d in docs])[:-1]
    )
    np.testing.assert_array_equal(reader.sequence(-1), docs[-1])
    with pytest.raises(IndexError):
        reader.sequence(7)
    with pytest.raises(RuntimeError), IndexedWriter(tmp_path / "b", np.uint16) as writer:
        writer.add_document(np.arange(5))
        raise RuntimeError("crash")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "a.idx"]
    with pytest.raises(ValueError, match="no Megatron code"):
        IndexedWriter(tmp_path / "c", np.uint32)
    _write(tmp_path / "e", [np.zeros(0)] * 3, np.uint16)  # empty sequences only
    assert IndexedReader(tmp_path / "e").num_tokens == 0


def _corrupt(path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: _corrupt(idx_path(p), 0, b"NOTMMIDX\x00"), "not a Megatron indexed dataset"),
        (lambda p: _corrupt(idx_path(p), 9, struct.pack("<Q", 2)), "version 2"),
        (lambda p: _corrupt(idx_path(p), 17, b"\x09"), "dtype code 9"),
        (lambda p: idx_path(p).write_bytes(idx_path(p).read_bytes()[:-3]), "tokens.idx' is trunc"),
        (lambda p: idx_path(p).write_bytes(idx_path(p).read_bytes()[:20]), "a header needs 34"),
        (lambda p: bin_path(p).write_bytes(bin_path(p).read_bytes()[:-2]), "tokens.bin' is trunc"),
    ],
    ids=["magic", "version", "dtype", "idx-short", "header-short", "bin-short"],
)
def test_corrupted_files_are_refused_by_name(tmp_path, damage, message):
    prefix = tmp_path / "tokens"
    _write(prefix, _documents(2, 5, 257), np.uint16)
    assert idx_path(prefix).stat().st_size == HEADER_BYTES + 12 * 5 + 8 * 6
    damage(prefix)
    with pytest.raises(ValueError, match=message):
        IndexedReader(prefix)
