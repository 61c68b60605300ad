"""prepare-data as corpora ship: JSON lines (plain, gz, zst), parquet and text read
streaming; bad records named or skipped; the output the same bytes for any worker count;
shards; the old format converted, never touched."""

from __future__ import annotations

import gzip
import hashlib
import json

import numpy as np
import pytest

from harness.cli import main as cli_main
from optimized.data import encoding
from optimized.data.convert import convert_old_folder
from optimized.data.indexed import IndexedReader
from optimized.data.preparation import open_prepared, prepare_data, read_sidecar
from optimized.data.readers import BadRecord, parse_shard, resolve_inputs, shard_files
from optimized.data.tokenizers import ByteTokenizer, load_tokenizer
from optimized.train import TokenDataset

TEXTS = [f"document {i}: " + "héllo wörld, " * (i % 7) + "🚀" * (i % 3) for i in range(40)]


def _jsonl(texts, key="text") -> bytes:
    return b"".join(json.dumps({key: t, "id": i}).encode() + b"\n" for i, t in enumerate(texts))


@pytest.fixture
def shipped(tmp_path):
    """The same 40 documents as five files of four formats, and their expected order."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.jsonl").write_bytes(_jsonl(TEXTS[:10]) + b"\n")  # a blank line: no record
    (root / "b.jsonl.gz").write_bytes(gzip.compress(_jsonl(TEXTS[10:20])))
    zst = zstandard.ZstdCompressor()
    frames = zst.compress(_jsonl(TEXTS[20:22])) + zst.compress(_jsonl(TEXTS[22:25]))
    (root / "c.jsonl.zst").write_bytes(frames)  # two frames, as concatenated files are
    (root / "d.json.gz").write_bytes(gzip.compress(_jsonl(["", *TEXTS[25:30]])))  # one empty
    table = pa.table({"id": list(range(8)), "text": TEXTS[30:38]})
    pq.write_table(table, root / "e.parquet", row_group_size=3)
    (root / "f.txt").write_text(TEXTS[38] + "\n" + TEXTS[39])  # one file, one document
    expected = [*TEXTS[:38], TEXTS[38] + "\n" + TEXTS[39]]
    return root, expected


def _documents(folder) -> list[str]:
    _, reader = open_prepared(folder)
    tok = ByteTokenizer()
    assert all(reader.sequence(i)[-1] == tok.eod_id for i in range(len(reader)))
    return [tok.decode(reader.sequence(i)) for i in range(len(reader))]


def test_every_format_streams_in_order_with_sources_hashed(tmp_path, shipped):
    root, expected = shipped
    summary = prepare_data([root], ByteTokenizer(), tmp_path / "out", progress=False)
    assert _documents(tmp_path / "out") == expected
    assert summary.stats.empty == 1 and summary.stats.bad == 0
    sidecar = read_sidecar(tmp_path / "out")
    assert sidecar["num_documents"] == len(expected) and sidecar["text_key"] == "text"
    assert [s["documents"] for s in sidecar["sources"]] == [10, 10, 5, 5, 8, 1]
    assert sum(s["tokens"] for s in sidecar["sources"]) == sidecar["num_tokens"]
    for source, path in zip(sidecar["sources"], sorted(root.iterdir()), strict=True):
        assert source["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest(), path
        assert source["size"] == path.stat().st_size
    assert sidecar["skipped"] == {"empty": 1, "bad": 0, "binary": 0}


def _bpe(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXTS * 3, trainer)
    tok.save(str(path))
    return path


def test_output_is_the_same_bytes_for_any_worker_count(tmp_path, shipped, monkeypatch):
    root, expected = shipped
    tok = load_tokenizer(_bpe(tmp_path / "tokenizer.json"))
    monkeypatch.setattr(encoding, "BATCH_DOCUMENTS", 3)  # many batches in flight
    outputs = []
    for workers in (1, 2, 3):
        out = tmp_path / f"w{workers}"
        prepare_data([root], tok, out, progress=False, workers=workers)
        outputs.append([(out / name).read_bytes() for name in ("tokens.bin", "tokens.idx")])
    assert outputs[0] == outputs[1] == outputs[2]
    reader = IndexedReader(tmp_path / "w2" / "tokens")
    for i, text in enumerate(expected):
        assert reader.sequence(i)[:-1].tolist() == tok.encode(text).tolist()
    assert read_sidecar(tmp_path / "w2")["tokenizer"]["kind"] == "hf"


def test_bad_records_are_named_or_skipped_and_counted(tmp_path):
    lines = [b'{"text": "one"}', b'{"text": "two"}', b"{not json", b'{"body": "x"}',
             b'{"text": 5}', b"[1, 2]", b'{"text": "three"}']  # fmt: skip
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(BadRecord, match=r"bad\.jsonl: line 3: field 'text': malformed JSON"):
        prepare_data([bad], ByteTokenizer(), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()  # left as found
    summary = prepare_data([bad], ByteTokenizer(), tmp_path / "out", progress=False, skip_bad=True)
    assert _documents(tmp_path / "out") == ["one", "two", "three"]
    assert summary.stats.bad == 4 and len(summary.stats.bad_examples) == 4
    assert (
        "line 4: field 'text': missing (the record's keys: 'body')" in summary.stats.bad_examples[1]
    )
    assert "line 5: field 'text': a JSON int, not a string" in summary.stats.bad_examples[2]
    assert "line 6: field 'text': a JSON list, not an object" in summary.stats.bad_examples[3]
    import zstandard

    whole = _jsonl(TEXTS * 20)
    zst = zstandard.ZstdCompressor().compress(whole)
    for name, packed in [
        ("cut.jsonl.gz", gzip.compress(whole)[:-300]),
        ("cut.jsonl.zst", zst[:-300]),
    ]:
        (tmp_path / name).write_bytes(packed)
        with pytest.raises(BadRecord, match=rf"{name}: the file: field 'text': cannot be read"):
            prepare_data([tmp_path / name], ByteTokenizer(), tmp_path / "o3", progress=False)
    with pytest.raises(BadRecord, match="line 1: field 'body': missing"):  # before any work
        prepare_data([bad], ByteTokenizer(), tmp_path / "o2", progress=False, text_key="body")


def test_shards_split_the_sorted_file_list(tmp_path, shipped):
    root, _ = shipped
    files = resolve_inputs([root])
    parts = [shard_files(list(reversed(files)), i, 4) for i in range(4)]
    assert [p for part in parts for p in part] == sorted(files)  # disjoint, covering, in order
    assert [len(p) for p in parts] == [1, 2, 1, 2]
    assert parse_shard("3/4") == (3, 4)
    for spec in ("4/4", "-1/4", "1/0", "a/b", "1"):
        with pytest.raises(ValueError, match=spec):
            parse_shard(spec)
    with pytest.raises(ValueError, match="empty part"):
        shard_files(files, 0, 7)
    prepare_data([root], ByteTokenizer(), tmp_path / "s1", progress=False, shard=(1, 4))
    sidecar = read_sidecar(tmp_path / "s1")
    assert sidecar["shard"] == [1, 4] and len(sidecar["sources"]) == 2


def _old_folder(folder, documents: list[bytes]) -> None:
    """A folder as the format before this one wrote it: tokens.bin + index.json."""
    folder.mkdir()
    ids = [np.frombuffer(d, np.uint8).astype(np.uint16) for d in documents]
    tokens = np.concatenate([np.append(i, np.uint16(256)) for i in ids])
    tokens.tofile(folder / "tokens.bin")
    offsets = np.concatenate([[0], np.cumsum([i.size + 1 for i in ids])]).tolist()
    index = {"format": "twinpipe-tokens", "version": 1, "dtype": "uint16",
             "num_tokens": int(tokens.size), "num_documents": len(ids), "vocab_size": 257,
             "eod_id": 256, "tokenizer": ByteTokenizer().describe(),
             "document_offsets": offsets, "sources": []}  # fmt: skip
    (folder / "index.json").write_text(json.dumps(index))


def test_old_folders_are_named_and_converted_untouched(tmp_path, capsys):
    old, new = tmp_path / "old", tmp_path / "new"
    _old_folder(old, [b"first doc", b"x", b"third one"])
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    with pytest.raises(ValueError, match="old format.*twinpipe prepare-data --convert OLD"):
        TokenDataset(old, seq_len=4)
    sidecar = convert_old_folder(old, new)
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    assert sidecar["num_documents"] == 3 and sidecar["converted_from"] == str(old.resolve())
    assert _documents(new) == ["first doc", "x", "third one"]
    assert (new / "tokens.bin").read_bytes() == before["tokens.bin"]  # the same tokens
    assert TokenDataset(new, seq_len=4).num_tokens == len(before["tokens.bin"]) // 2

    assert cli_main(["prepare-data", "--convert", str(old), "--out", str(new)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert cli_main(["prepare-data", "--convert", str(new), "--out", str(tmp_path / "n2")]) == 2
    assert "not a prepared folder of the old format" in capsys.readouterr().err
    assert cli_main(["prepare-data", "--convert", str(old), "--out", str(tmp_path / "n3")]) == 0
    assert "converted 3 documents" in capsys.readouterr().out


def test_cli_bad_input_exits_2_before_work(tmp_path, shipped, capsys):
    root, _ = shipped
    out = str(tmp_path / "out")
    base = ["prepare-data", "--input", str(root), "--quiet", "--out", out]
    cases = [
        (["--shard", "4/4"], "--shard '4/4': '4/4' is outside 0 <= I < N"),
        (["--shard", "x"], "--shard 'x'"),
        (["--workers", "0"], "--workers 0: must be >= 1"),
        (["--text-key", "body"], "a.jsonl: line 1: field 'body': missing"),
    ]
    for extra, needle in cases:
        assert cli_main([*base, *extra]) == 2
        assert needle in capsys.readouterr().err
        assert not (tmp_path / "out").exists()
    (root / "g.jsonl").write_text('{"text": "fine"}\n{"txt": "typo"}\n')
    assert cli_main(base) == 2
    err = capsys.readouterr().err
    assert "g.jsonl: line 2: field 'text': missing" in err and "--skip-bad" in err
    assert not (tmp_path / "out").exists()
    assert cli_main([*base, "--skip-bad", "--workers", "2", "--shard", "0/1"]) == 0
    said = capsys.readouterr()
    assert "skipped 1 bad records" in said.err and "g.jsonl: line 2" in said.err
    assert "1 empty documents and 1 bad records skipped" in said.out
    assert cli_main(["prepare-data", "--out", str(tmp_path / "x")]) == 2
    assert "--input" in capsys.readouterr().err
