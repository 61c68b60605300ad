"""Tokenizers, prepare_data, TokenDataset, the sharded resumable loader, default data, CLI."""

from __future__ import annotations

import hashlib
import json
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from harness.cli import main as cli_main
from optimized.data.indexed import IndexedReader
from optimized.train import (
    ByteTokenizer,
    HFTokenizer,
    ShardedSampler,
    TokenDataset,
    TokenLoader,
    default_dataset,
    load_tokenizer,
    prepare_data,
    read_sidecar,
    resolve_inputs,
    token_dtype,
)

SIDECAR = "twinpipe-data.json"
TEXTS = {
    "a.txt": "hello world\n",
    "b.txt": "héllo — ünïcode 🚀\r\nsecond line\n",
    "sub/c.txt": "def f(x):\n    return x + 1\n" * 7,
}


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    for name, text in TEXTS.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode("utf-8"))
    (root / ".hidden").write_text("never read")
    return root


def _random_text(rng: np.random.Generator, n: int) -> str:
    alphabet = list("abcdefghij klmnopq\nxyzé€🚀")
    return "".join(rng.choice(alphabet, size=n))


# --------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    rng = np.random.default_rng(0)
    for text in [_random_text(rng, 200), "", "\x00\r\n\t", "ünïcode — 🚀"]:
        ids = tok.encode(text)
        assert ids.dtype == np.int64
        assert ids.size == len(text.encode("utf-8"))
        assert ids.size == 0 or (ids.min() >= 0 and ids.max() < 256)
        assert tok.decode(ids) == text
        assert tok.decode(torch.from_numpy(ids)) == text
    assert tok.vocab_size == 257 and tok.eod_id == 256
    # end-of-document ids mark boundaries and are dropped from text
    ids = np.concatenate([tok.encode("ab"), [256], tok.encode("c")])
    assert tok.decode(ids) == "abc"
    with pytest.raises(ValueError, match="0..256"):
        tok.decode([257])
    assert load_tokenizer("byte").describe() == {"kind": "byte", "vocab_size": 257, "eod_id": 256}


def _build_hf_tokenizer(path, special=("<|endoftext|>",)):
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["[UNK]", *special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello world", "hello there", "world of words"] * 20, trainer)
    tok.save(str(path))
    return path


def test_hf_tokenizer_prepare_and_round_trip(tmp_path, corpus):
    path = _build_hf_tokenizer(tmp_path / "tokenizer.json")
    tok = load_tokenizer(path)
    assert isinstance(tok, HFTokenizer)
    assert tok.eod_token == "<|endoftext|>"
    import tokenizers

    raw = tokenizers.Tokenizer.from_file(str(path))
    assert tok.eod_id == raw.token_to_id("<|endoftext|>")
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    for text in ("hello world", TEXTS["b.txt"]):
        assert tok.decode(tok.encode(text)) == text

    summary = prepare_data([corpus], tok, tmp_path / "out", progress=False)
    index = read_sidecar(tmp_path / "out")
    assert index["tokenizer"]["kind"] == "hf"
    assert index["tokenizer"]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert index["dtype"] == "uint16" and index["eod_id"] == tok.eod_id
    reader = IndexedReader(tmp_path / "out" / "tokens")
    tokens = reader.tokens
    offsets = np.concatenate([[0], np.cumsum(reader.sequence_lengths)])
    expected = [tok.encode(TEXTS[name]) for name in sorted(TEXTS)]  # a, b, sub/c
    assert summary.num_tokens == sum(len(e) + 1 for e in expected) == tokens.size
    for i, ids in enumerate(expected):
        assert tokens[offsets[i] : offsets[i + 1] - 1].tolist() == ids.tolist()
        assert tokens[offsets[i + 1] - 1] == tok.eod_id


def test_hf_tokenizer_eod_choice_and_errors(tmp_path, monkeypatch):
    path = _build_hf_tokenizer(tmp_path / "plain.json", special=("<sep>",))
    with pytest.raises(ValueError, match="end-of-document"):
        HFTokenizer(path)
    assert HFTokenizer(path, eod_token="<sep>").eod_token == "<sep>"
    with pytest.raises(FileNotFoundError, match="missing.json"):
        HFTokenizer(tmp_path / "missing.json")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed
    with pytest.raises(ImportError, match="'tokenizers' package"):
        load_tokenizer(path)


# --------------------------------------------------------------------------- prepare_data


def test_prepare_data_exact_tokens_and_boundaries(tmp_path, corpus):
    out = tmp_path / "prepared"
    summary = prepare_data([corpus], ByteTokenizer(), out, progress=False)
    names = sorted(TEXTS)  # folder expansion is sorted; hidden files are skipped
    raw = [TEXTS[name].encode("utf-8") for name in names]
    assert summary.num_files == summary.num_documents == 3
    assert summary.num_tokens == sum(len(r) + 1 for r in raw)
    assert summary.bytes_read == sum(len(r) for r in raw)
    assert sorted(p.name for p in out.iterdir()) == ["tokens.bin", "tokens.idx", SIDECAR]

    index = json.loads((out / SIDECAR).read_text())
    assert index["dtype"] == "uint16" and index["num_tokens"] == summary.num_tokens
    assert index["num_documents"] == 3 and index["prefix"] == "tokens"
    tokens = np.fromfile(out / "tokens.bin", dtype=np.uint16)
    assert tokens.size == summary.num_tokens
    offsets = np.concatenate([[0], np.cumsum(IndexedReader(out / "tokens").sequence_lengths)])
    assert offsets[0] == 0 and offsets[-1] == tokens.size and len(offsets) == 4
    for i, data in enumerate(raw):
        document = tokens[offsets[i] : offsets[i + 1]]
        assert document[-1] == 256 and (document[:-1] != 256).all()
        assert bytes(document[:-1].astype(np.uint8)) == data
        source = index["sources"][i]
        assert source["path"] == str((corpus / names[i]).resolve())
        assert source["size"] == len(data) and source["tokens"] == len(data) + 1
        assert source["documents"] == 1
        assert source["sha256"] == hashlib.sha256(data).hexdigest()
        assert source["mtime"] == (corpus / names[i]).stat().st_mtime


def test_resolve_inputs_globs_order_and_errors(tmp_path, corpus):
    files = resolve_inputs([corpus / "sub" / "c.txt", str(corpus / "*.txt"), corpus])
    assert [f.name for f in files] == ["c.txt", "a.txt", "b.txt"]  # input order, no repeats
    assert [f.name for f in resolve_inputs([str(corpus / "**" / "*.txt")])] == [
        "a.txt",
        "b.txt",
        "c.txt",
    ]
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        resolve_inputs([corpus / "a.txt", tmp_path / "nope.txt"])
    with pytest.raises(FileNotFoundError, match=r"matches no files"):
        resolve_inputs([str(tmp_path / "*.md")])


def test_prepare_data_is_atomic_and_never_overwrites(tmp_path, corpus):
    out = tmp_path / "prepared"
    first = prepare_data([corpus / "a.txt"], ByteTokenizer(), out, progress=False)
    with pytest.raises(FileExistsError, match="not empty"):
        prepare_data([corpus], ByteTokenizer(), out, progress=False)
    assert read_sidecar(out)["num_tokens"] == first.num_tokens

    class Failing(ByteTokenizer):
        def encode(self, text):
            if "second line" in text:
                raise RuntimeError("tokenizer crashed")
            return super().encode(text)

    fresh, empty = tmp_path / "fresh", tmp_path / "empty"
    empty.mkdir()
    for target in (fresh, empty):
        with pytest.raises(RuntimeError, match="crashed"):
            prepare_data([corpus], Failing(), target, progress=False)
    assert not fresh.exists() and list(empty.iterdir()) == []  # left as found
    with pytest.raises(FileNotFoundError, match="not a prepared data folder"):
        TokenDataset(empty, seq_len=4)


def test_wide_vocabulary_uses_int32(tmp_path, corpus):
    class Wide(ByteTokenizer):
        vocab_size = 70_000
        eod_id = 69_999

        def encode(self, text):
            return super().encode(text) * 200  # ids up to 51000

    assert token_dtype(65_499) == np.uint16 and token_dtype(65_500) == np.int32  # Megatron's
    prepare_data([corpus / "a.txt"], Wide(), tmp_path / "wide", progress=False)
    dataset = TokenDataset(tmp_path / "wide", seq_len=4)
    assert dataset.tokens.dtype == np.int32
    expected = [b * 200 for b in TEXTS["a.txt"].encode()] + [69_999]
    assert dataset.tokens.tolist() == expected


def test_progress_bar(tmp_path, corpus, capsys):
    prepare_data([corpus], ByteTokenizer(), tmp_path / "out", progress=True)
    err = capsys.readouterr().err
    assert "prepare-data" in err and "docs/s" in err and "tok/s" in err and "100%" in err


# --------------------------------------------------------------------------- dataset


@pytest.fixture
def prepared(tmp_path):
    rng = np.random.default_rng(1)
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(5):
        (folder / f"{i}.txt").write_text(_random_text(rng, 300 + 37 * i))
    prepare_data([folder], ByteTokenizer(), tmp_path / "prepared", progress=False)
    return tmp_path / "prepared"


def test_dataset_windows(prepared):
    seq_len = 16
    dataset = TokenDataset(prepared, seq_len)
    tokens = np.fromfile(prepared / "tokens.bin", dtype=np.uint16).astype(np.int64)
    assert len(dataset) == (tokens.size - 1) // seq_len
    assert dataset.vocab_size == 257 and dataset.eod_id == 256
    for i in (0, 1, len(dataset) - 1):
        sample = dataset[i]
        assert sample.dtype == torch.int64 and sample.shape == (seq_len + 1,)
        assert sample.tolist() == tokens[i * seq_len : (i + 1) * seq_len + 1].tolist()
    assert dataset[-1].tolist() == dataset[len(dataset) - 1].tolist()
    with pytest.raises(IndexError):
        dataset[len(dataset)]
    ids = np.array([[3, 0], [7, 5]])
    gathered = dataset.gather(ids)
    assert gathered.shape == (2, 2, seq_len + 1)
    assert torch.equal(gathered[1, 0], dataset[7])
    with pytest.raises(ValueError, match="too few"):
        TokenDataset(prepared, seq_len=tokens.size)


# --------------------------------------------------------------------------- sampler


def test_shards_disjoint_and_covering():
    dp_size, per_rank, steps = 3, 4, 5
    num_samples = dp_size * per_rank * steps
    samplers = [ShardedSampler(num_samples, per_rank, r, dp_size, seed=7) for r in range(dp_size)]
    for epoch in (0, 1):
        shards = [s.shard(epoch) for s in samplers]
        union = np.concatenate(shards)
        assert len(set(union.tolist())) == union.size == num_samples  # disjoint and covering
        assert all(shard.size == per_rank * steps for shard in shards)
    # next_ids walks exactly the shard
    for rank, sampler in enumerate(samplers):
        read = np.concatenate([sampler.next_ids() for _ in range(steps)])
        assert (
            read.tolist()
            == ShardedSampler(num_samples, per_rank, rank, dp_size, 7).shard(0).tolist()
        )
    # an uneven count: still disjoint, the tail shorter than a global batch is skipped
    uneven = [ShardedSampler(num_samples + 5, per_rank, r, dp_size, seed=7) for r in range(dp_size)]
    union = np.concatenate([s.shard(0) for s in uneven])
    assert len(set(union.tolist())) == union.size == num_samples


def test_sampler_determinism_and_seed():
    def order(seed, epoch=0, shuffle=True):
        return ShardedSampler(100, 10, seed=seed, shuffle=shuffle).epoch_order(epoch).tolist()

    assert order(3) == order(3)
    assert order(3) != order(4)
    assert order(3, epoch=0) != order(3, epoch=1)
    assert sorted(order(3)) == list(range(100))
    assert order(3, shuffle=False) == list(range(100))
    with pytest.raises(ValueError, match="fewer than one global batch"):
        ShardedSampler(10, 4, 0, 3)
    with pytest.raises(ValueError, match="dp_rank = 2"):
        ShardedSampler(100, 4, 2, 2)


def _take(loader, n):
    return [next(loader) for _ in range(n)]


def _same(batches_a, batches_b):
    assert len(batches_a) == len(batches_b)
    for a, b in zip(batches_a, batches_b):
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.labels, b.labels)
        assert torch.equal(a.sample_ids, b.sample_ids) and a.epoch == b.epoch


def test_loader_batches(prepared):
    dataset = TokenDataset(prepared, seq_len=8)
    loader = TokenLoader(dataset, micro_batches=3, micro_batch_size=2, seed=1)
    batch = next(loader)
    assert batch.inputs.shape == batch.labels.shape == (3, 2, 8)
    assert batch.inputs.dtype == batch.labels.dtype == torch.int64
    for m in range(3):
        for b in range(2):
            window = dataset[int(batch.sample_ids[m, b])]
            assert torch.equal(batch.inputs[m, b], window[:-1])
            assert torch.equal(batch.labels[m, b], window[1:])


@pytest.mark.parametrize("where", ["first", "mid", "before_end", "at_end", "past_end"])
def test_loader_resumes_exactly(prepared, where):
    dataset = TokenDataset(prepared, seq_len=32)

    def make(rank, data=dataset):
        return TokenLoader(data, 5, 1, dp_rank=rank, dp_size=2, seed=11)

    per_epoch = make(0).sampler.steps_per_epoch
    assert per_epoch == len(dataset) // 10 >= 4
    stops = {"first": 1, "mid": 2, "before_end": per_epoch - 1, "at_end": per_epoch}
    stop_after = stops.get(where, per_epoch + 2)
    total = 2 * per_epoch + 2  # into a third epoch
    for rank in (0, 1):
        straight = _take(make(rank), total)
        assert {b.epoch for b in straight} == {0, 1, 2}
        first = make(rank)
        head = _take(first, stop_after)
        state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
        resumed = make(rank, TokenDataset(prepared, seq_len=32))
        resumed.load_state_dict(state)
        _same(head + _take(resumed, total - stop_after), straight)


def test_loader_resume_with_other_dp_layout_keeps_global_batches(prepared):
    dataset = TokenDataset(prepared, seq_len=32)
    two = [TokenLoader(dataset, 2, 2, r, 2, seed=5) for r in range(2)]  # global batch 8
    for loader in two:
        _take(loader, 3)
    one = TokenLoader(dataset, 4, 2, 0, 1, seed=5)  # the same global batch on one rank
    one.load_state_dict(two[0].state_dict())
    for _ in range(4):  # crosses the epoch boundary (6 steps per epoch)
        expected = torch.cat([next(loader).sample_ids.reshape(-1) for loader in two])
        assert next(one).sample_ids.reshape(-1).tolist() == expected.tolist()


def test_loader_state_mismatch_is_an_error(prepared):
    dataset = TokenDataset(prepared, seq_len=32)
    state = TokenLoader(dataset, 2, 2, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed = 1"):
        TokenLoader(dataset, 2, 2, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len = 32"):
        TokenLoader(TokenDataset(prepared, seq_len=16), 2, 2, seed=1).load_state_dict(state)


# --------------------------------------------------------------------------- default data


def test_default_dataset_builds_once_and_is_python_source(tmp_path, monkeypatch):
    monkeypatch.setenv("TWINPIPE_CACHE", str(tmp_path / "cache"))
    with ThreadPoolExecutor(max_workers=3) as pool:  # racing builders
        futures = [pool.submit(default_dataset, None, 300_000) for _ in range(3)]
        results = [future.result() for future in futures]
    folder = tmp_path / "cache" / "data" / "stdlib-byte"
    assert results == [folder] * 3
    assert sorted(p.name for p in folder.parent.iterdir()) == ["stdlib-byte", "stdlib-byte.lock"]
    index = read_sidecar(folder)
    assert 0 < sum(s["size"] for s in index["sources"]) <= 300_000
    assert all(s["path"].endswith(".py") for s in index["sources"])
    assert index["recipe"]["max_bytes"] == 300_000
    text = ByteTokenizer().decode(TokenDataset(folder, seq_len=64).tokens[:20_000])
    assert "import" in text or "def " in text

    built = (folder / "tokens.bin").stat().st_mtime_ns
    assert default_dataset(max_bytes=300_000) == folder
    assert (folder / "tokens.bin").stat().st_mtime_ns == built  # cached, not rebuilt
    default_dataset(max_bytes=150_000)  # another recipe rebuilds in place
    assert read_sidecar(folder)["recipe"]["max_bytes"] == 150_000
    assert sorted(p.name for p in folder.parent.iterdir()) == ["stdlib-byte", "stdlib-byte.lock"]


# --------------------------------------------------------------------------- CLI


def test_cli_prepare_data(tmp_path, corpus, capsys):
    out = tmp_path / "out"
    assert cli_main(["prepare-data", "--input", str(corpus), "--out", str(out), "--quiet"]) == 0
    assert read_sidecar(out)["num_documents"] == 3
    assert "tokens" in capsys.readouterr().out

    missing = str(tmp_path / "missing.txt")
    assert cli_main(["prepare-data", "--input", str(corpus), missing, "--out", str(out)]) == 2
    assert f"--input {missing!r}" in capsys.readouterr().err

    code = cli_main(["prepare-data", "--input", str(corpus), "--out", str(out)])
    assert code == 2 and "not empty" in capsys.readouterr().err  # never overwritten
    assert read_sidecar(out)["num_documents"] == 3

    fresh = str(tmp_path / "fresh")
    bad_tok = str(corpus / "a.txt")
    code = cli_main(
        ["prepare-data", "--input", str(corpus), "--tokenizer", bad_tok, "--out", fresh]
    )
    assert code == 2 and f"--tokenizer {bad_tok!r}" in capsys.readouterr().err

    file_out = str(corpus / "a.txt")
    assert cli_main(["prepare-data", "--input", str(corpus), "--out", file_out]) == 2
    assert "--out" in capsys.readouterr().err

    code = cli_main(["prepare-data", "--input", str(corpus), "--eod-token", "x", "--out", fresh])
    assert code == 2 and "--eod-token" in capsys.readouterr().err

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["prepare-data", "--input", str(corpus)])  # --out missing
    assert exit_info.value.code == 2
