"""Blends, splits and the sources they open (`optimized.data.blend`, `splits`, `sources`,
`corpus`): the order's prefix property, epochs, the position across DP layouts, document
splits, and every bad blend named."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from optimized.data.blend import Blend, BlendLoader, blend_sources, parse_blend
from optimized.data.corpus import EVAL, TRAIN, check_corpora, config_problems, open_corpus
from optimized.data.sources import Windows, open_source
from optimized.data.splits import parse_split, split_documents


def megatron_prefix(path, documents, dtype=np.uint16):
    """A bare Megatron prefix written by megatron-core's own ``IndexedDatasetBuilder``."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{path}.bin", dtype=dtype)
    for doc in documents:
        builder.add_item(torch.tensor(doc, dtype=torch.int64))
        builder.end_document()
    builder.finalize(f"{path}.idx")
    return str(path)


def documents(count, seed, low=0, high=500):
    rng = np.random.default_rng(seed)
    return [rng.integers(low, high, size=int(rng.integers(5, 40))).tolist() for _ in range(count)]


# ------------------------------------------------------------------ the blend's syntax
def test_parse_blend():
    assert parse_blend("0.7 web/ 0.3 code/") == [(0.7, "web/"), (0.3, "code/")]
    assert parse_blend(" a/  b/ ") == [(None, "a/"), (None, "b/")]
    assert parse_blend("0 a 2 b") == [(0.0, "a"), (2.0, "b")]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "empty"),
        ("0.7 web/ 0.3", "no partner"),
        ("0.7 web/ x code/", "entry 2 (x code/): the weight 'x' is not a number"),
        ("-1 web/ 2 code/", "entry 1 (-1 web/): the weight -1 must be a finite number >= 0"),
        ("nan web/", "finite"),
        ("0 web/ 0 code/", "sum to 0"),
        ("web/ 0.3 code/", "'0.3' looks like a weight"),
    ],
)
def test_bad_blends_are_named(text, needle):
    with pytest.raises(ValueError, match=None) as caught:
        parse_blend(text)
    assert needle in str(caught.value), caught.value


# ------------------------------------------------------------------ the order
WEIGHTS = [
    [1.0],
    [0.7, 0.3],
    [0.5, 0.3, 0.2],
    [0.01, 0.98, 0.01],
    [0.13, 0.29, 0.07, 0.31, 0.2],
    [0.001, 0.002, 0.3, 0.1, 0.05, 0.547],
    [1 / 3, 1 / 3, 1 / 3],
]


@pytest.mark.parametrize("weights", WEIGHTS, ids=lambda w: f"{len(w)}-sources")
def test_every_prefix_within_one_sample(weights):
    """Exhaustively over 3000 samples, taken in uneven pieces (as steps take them): each
    source's count after every prefix of n samples is within 1 - 1/(2S-2) < 1 of w * n."""
    w = np.asarray(weights) / sum(weights)
    counts = np.zeros(len(w), dtype=np.int64)
    pieces, start = [], 0
    for size in [1, 7, 64, 13, 915, 2000]:
        pieces.append(blend_sources(w, counts, start, size))
        start += size
    order = np.concatenate(pieces)
    prefix = np.cumsum(np.eye(len(w))[order], axis=0)
    error = np.abs(prefix - np.arange(1, len(order) + 1)[:, None] * w).max()
    bound = 1 - 1 / (2 * len(w) - 2) if len(w) > 1 else 0
    assert error <= bound + 1e-9, (error, bound)
    assert counts.tolist() == prefix[-1].astype(int).tolist()


@pytest.mark.slow  # builds megatron-core's C++ helpers
def test_megatron_greedy_rule_can_stray_past_one_sample():
    """Why not Megatron's rule itself (megatron-core's ``build_blending_indices``, run here):
    on these weights a prefix strays 1.25 samples from its share, where Tijdeman's rule
    stays within 0.9 (the test above)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import helpers_cpp

    w = np.asarray(WEIGHTS[5]) / sum(WEIGHTS[5])
    order, within = np.zeros(3000, dtype=np.int16), np.zeros(3000, dtype=np.int64)
    helpers_cpp.build_blending_indices(order, within, w, len(w), 3000, False)
    prefix = np.cumsum(np.eye(len(w))[order.astype(np.int64)], axis=0)
    assert np.abs(prefix - np.arange(1, 3001)[:, None] * w).max() > 1.2


def test_epochs_reshuffle_and_are_reported():
    blend = Blend([5, 3], [0.5, 0.5], seed=1, names=["a/", "b/"])
    sources, ids = blend.take(20)
    for s, size in ((0, 5), (1, 3)):
        drawn = ids[sources == s]
        epochs = [drawn[i : i + size] for i in range(0, len(drawn) - size + 1, size)]
        assert all(sorted(e.tolist()) == list(range(size)) for e in epochs)  # each a permutation
        assert len({tuple(e) for e in epochs}) > 1  # reshuffled
    assert blend.epochs() == [2, 3]
    assert blend.notes == [
        "data: a/ ran out after epoch 1 of its 5 samples; epoch 2 starts, reshuffled",
        "data: b/ ran out after epoch 1 of its 3 samples; epoch 2 starts, reshuffled",
        "data: b/ ran out after epoch 2 of its 3 samples; epoch 3 starts, reshuffled",
        "data: b/ ran out after epoch 3 of its 3 samples; epoch 4 starts, reshuffled",
    ]
    again = Blend([5, 3], [0.5, 0.5], seed=1)
    assert [a.tolist() for a in again.take(20)] == [sources.tolist(), ids.tolist()]
    other = Blend([5, 3], [0.5, 0.5], seed=2)
    assert other.take(20)[1].tolist() != ids.tolist()


def _windows(sizes, seq_len=4):
    return [
        Windows(np.arange(i * 10_000, i * 10_000 + n * seq_len + 1), 0, n * seq_len + 1, seq_len)
        for i, n in enumerate(sizes)
    ]


def test_resume_at_another_dp_layout_reads_the_same_global_batches():
    """4 steps at DP 1 == 2 steps at DP 1, the state saved, then 2 steps at DP 2 (and at
    DP 4) with the same global batch: the same samples in the same places, nothing repeated
    or skipped; the global digest agrees on every rank."""
    sizes, weights, windows = [11, 7, 30], [0.2, 0.5, 0.3], _windows([11, 7, 30])

    def loader(rank, dp, m):
        return BlendLoader(Blend(sizes, weights, seed=3), windows, m, 2, rank, dp)

    whole = loader(0, 1, 4)
    straight = [next(whole) for _ in range(4)]
    first = loader(0, 1, 4)
    head = [next(first) for _ in range(2)]
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint keeps it
    for dp in (2, 4):
        ranks = [loader(r, dp, 4 // dp) for r in range(dp)]
        for rank in ranks:
            rank.load_state_dict(state)
        for step in range(2, 4):
            batches = [next(rank) for rank in ranks]
            assert len({b.digest for b in batches}) == 1
            assert batches[0].digest == straight[step].digest
            inputs = torch.cat([b.inputs.reshape(-1, 4) for b in batches])
            assert torch.equal(inputs, straight[step].inputs.reshape(-1, 4))
    assert [b.digest for b in head] == [b.digest for b in straight[:2]]
    counts = state["blend"]["counts"]
    assert state["blend"]["epochs"] == [c // s for c, s in zip(counts, sizes, strict=True)]


def test_state_of_other_data_is_refused():
    a = BlendLoader(Blend([5, 6], [1, 1]), _windows([5, 6]), 1, 1)
    next(a)
    b = BlendLoader(Blend([5, 7], [1, 1]), _windows([5, 7]), 1, 1)
    with pytest.raises(ValueError, match="sizes"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="earlier twinpipe"):
        b.load_state_dict({"sampler": {}, "seq_len": 4})


# ------------------------------------------------------------------ splits
@pytest.mark.parametrize(
    ("text", "needle"),
    [("99", "1 part"), ("1,2,3,4", "4 part"), ("99,x", "part 2 'x' is not a number"),
     ("0,0", "sum to 0"), ("-1,2", "part 1 = -1"), ("0,1", "training part")],
)  # fmt: skip
def test_bad_splits_are_named(text, needle):
    with pytest.raises(ValueError) as caught:
        parse_split(text)
    assert needle in str(caught.value)


@pytest.mark.parametrize("split", ["99,1", "949,50,1", "90,10", "1,1", "2,1,1"])
def test_split_documents_follows_megatron(split):
    """The boundaries megatron-core's builder takes for a split, at several corpus sizes."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    fractions = parse_split(split)
    assert fractions == pytest.approx(parse_and_normalize_split(split)[: len(fractions)])
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    for n in (1, 3, 10, 1000, 12345):
        bounds = split_documents(n, fractions)
        for part, bookends in enumerate(matrix[: len(fractions)]):
            begin, end = (0, 0) if bookends is None else bookends
            want = (int(round(begin * n)), int(round(end * n)))
            if bookends is not None:
                assert (bounds[part], bounds[part + 1]) == want, (split, n, part)


def test_split_by_whole_documents_of_a_megatron_prefix(tmp_path):
    """A bare prefix as megatron-core's builder writes it: the training and held-out
    windows of ``--split 80,20`` cover disjoint documents, and all of each part's tokens."""
    docs = documents(50, seed=0)
    prefix = megatron_prefix(tmp_path / "corpus", docs)
    source = open_source(prefix)
    assert source.num_documents == 50 and source.vocab_size is None
    assert source.tokens.tolist() == [t for d in docs for t in d]
    starts = np.cumsum([0] + [len(d) for d in docs])
    assert [source.document_start(d) for d in range(51)] == starts.tolist()
    owner = np.repeat(np.arange(50), [len(d) for d in docs])  # token -> document
    seen = []
    for part in (TRAIN, EVAL):
        corpus = open_corpus(prefix, 8, "data.path", "80,20", part)
        window = corpus.windows[0]
        ids = np.arange(window.num_samples)
        tokens = window.gather(ids).numpy()
        positions = window.first + ids[:, None] * 8 + np.arange(9)
        assert (source.tokens[positions] == tokens).all()
        seen.append(set(owner[positions].ravel().tolist()))
    assert seen[0] and seen[1] and not seen[0] & seen[1]
    assert max(seen[0]) < 40 <= min(seen[1])


# ------------------------------------------------------------------ sources of a blend
def test_weights_from_sizes_and_checks(tmp_path):
    small = megatron_prefix(tmp_path / "small", documents(10, 1))
    large = megatron_prefix(tmp_path / "large", documents(30, 2))
    corpus = open_corpus(f"{small} {large}", 4, "data.path")
    assert corpus.weights == [open_source(small).num_tokens, open_source(large).num_tokens]
    check_corpora([corpus], vocab_size=512)
    wide = megatron_prefix(tmp_path / "wide", documents(5, 3, 500, 600))
    with pytest.raises(ValueError, match=r"holds token id 5\d\d, beyond the model's vocab"):
        check_corpora([open_corpus(f"0.5 {small} 0.5 {wide}", 4, "data.path")], 512)
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(ValueError, match="plain. is not a prepared data folder"):
        open_corpus(f"1 {small} 1 {plain}", 4, "data.path")
    assert config_problems(f"1 {small} 1 {tmp_path / 'nothing'}", None, "1,x") == [
        f"data.path = '1 {small} 1 {tmp_path / 'nothing'}' is invalid: "
        f"'{tmp_path / 'nothing'}' does not exist (a folder written by `twinpipe prepare-data`, "
        "or a Megatron prefix with .bin and .idx)",
        "data.split = '1,x' is invalid: part 2 'x' is not a number",
    ]
    with pytest.raises(ValueError, match="held-out part"):
        open_corpus(small, 4, "data.path", "99,1", EVAL)


def test_mismatched_tokenizers_are_refused(tmp_path):
    from optimized.data.sources import Source

    tokens = np.zeros(100, dtype=np.uint16)
    offsets = np.array([0, 100])
    byte = Source("a/", tokens, 1, 257, 256, {"kind": "byte"}, offsets)
    hf = Source("b/", tokens, 1, 257, 0, {"kind": "hf", "sha256": "ab" * 32}, offsets)
    wider = Source("c/", tokens, 1, 300, 256, None, offsets)

    def corpus(*sources):
        from optimized.data.corpus import Corpus

        return Corpus("data.path", list(sources), [], [1.0] * len(sources))

    with pytest.raises(ValueError, match=r"b/ was tokenized with hf abab.*but a/ .* with byte"):
        check_corpora([corpus(byte, hf)], 512)
    with pytest.raises(ValueError, match="c/ has vocab_size 300, but a/ .*257"):
        check_corpora([corpus(byte), corpus(wider)], 512)
