"""A run's data opened: the training blend and the held-out one, as the trainer reads them
and the preflight checks them.

`open_corpus` turns a blend (``--data``, ``--eval-data``) into each source's `Windows` of
the part asked for (everything, or one part of ``--split``) and its weight; `held_out` says
which held-out data a run evaluates on (``--eval-data``, else ``--split``'s second part,
else none); `check_corpora` holds every source of both against each other (one tokenizer,
one vocabulary) and against the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from optimized.data.blend import Blend, BlendLoader, gather, parse_blend
from optimized.data.sources import Source, Windows, largest_token, open_source
from optimized.data.splits import parse_split, split_documents

TRAIN, EVAL = 0, 1
"""The parts of ``--split``."""


@dataclass(slots=True)
class Corpus:
    """One blend, opened: each source's windows and weight (normalised by `Blend`)."""

    key: str
    """The config key it came from (``data.path``, ``data.eval_path``): errors name it."""
    sources: list[Source]
    windows: list[Windows]
    weights: list[float]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    @property
    def eod_id(self) -> int | None:
        """The end-of-document id the sources share (`open_corpus` refuses mismatched
        tokenizers); None: unknown (a bare Megatron prefix)."""
        ids = {s.eod_id for s in self.sources}
        return ids.pop() if len(ids) == 1 else None

    @property
    def num_samples(self) -> int:
        return sum(w.num_samples for w, weight in zip(self.windows, self.weights) if weight > 0)

    def blend(self, seed: int, shuffle: bool = True) -> Blend:
        sizes = [w.num_samples for w in self.windows]
        return Blend(sizes, self.weights, seed, shuffle, self.names)

    def loader(self, seed, shuffle, micro_batches, micro_batch_size, dp_rank, dp) -> BlendLoader:
        return BlendLoader(self.blend(seed, shuffle), self.windows, micro_batches,
                           micro_batch_size, dp_rank, dp)  # fmt: skip

    def batches(self, seed: int, count: int, size: int) -> list[tuple]:
        """The first ``count`` batches of ``size`` samples of the blend from ``seed``, each
        ``(inputs, labels)`` int64 ``[size, seq_len]``: the same every time it is asked."""
        sources, ids = self.blend(seed).take(count * size)
        windows = gather(self.windows, sources, ids).reshape(count, size, -1)
        return [(w[:, :-1], w[:, 1:]) for w in windows]


def open_corpus(spec: str, seq_len: int, key: str, split: str | None = None,
                part: int = TRAIN) -> Corpus:  # fmt: skip
    """The blend ``spec`` with each source cut to ``part`` of ``split`` (None: whole).
    `ValueError` names ``key``, the spec's entry and what is wrong with it."""
    try:
        entries = parse_blend(spec)
    except ValueError as error:
        raise ValueError(f"{key} = {spec!r}: {error}") from None
    fractions = parse_split(split) if split is not None else None
    sources, windows = [], []
    for _, path in entries:
        try:
            source = open_source(path)
        except (OSError, ValueError, KeyError) as error:
            raise ValueError(f"{key} = {spec!r}: {error}") from None
        first, end = 0, source.num_tokens
        if fractions is not None:
            bounds = split_documents(source.num_documents, fractions)
            first = source.document_start(bounds[part])
            end = source.document_start(bounds[part + 1])
        sources.append(source)
        windows.append(Windows(source.tokens, first, end, seq_len, path))
    if entries[0][0] is None:  # paths alone: weighed by their tokens
        weights = [float(s.num_tokens) for s in sources]
    else:
        weights = [float(w) for w, _ in entries]
    corpus = Corpus(key, sources, windows, weights)
    alone = len(sources) == 1 and part == TRAIN and key == "data.path"  # the preflight's
    for source, window, weight in zip(sources, windows, weights, strict=True):  # global batch
        if weight > 0 and window.num_samples < 1 and not alone:
            where = "" if fractions is None else f" in its {('training', 'held-out')[part]} part"
            raise ValueError(
                f"{key} = {spec!r}: {source.name} holds {window.end - window.first} tokens"
                f"{where}{_split_note(split, source)}, too few for one sample of "
                f"seq_len + 1 = {seq_len + 1}"
            )
    return corpus


def _split_note(split: str | None, source: Source) -> str:
    if split is None:
        return ""
    return f" (data.split = {split!r} of its {source.num_documents} documents)"


def config_problems(path: str | None, eval_path: str | None, split: str | None) -> list[str]:
    """What is wrong with ``data.path``, ``data.eval_path`` and ``data.split`` as written
    (syntax, weights, paths that do not exist), one line each; the files are opened later."""
    problems = []
    for key, spec in (("data.path", path), ("data.eval_path", eval_path)):
        try:
            entries = parse_blend(spec) if spec is not None else []
        except ValueError as error:
            problems.append(f"{key} = {spec!r} is invalid: {error}")
            continue
        for _, where in entries:
            if not (Path(where).exists() or Path(f"{where}.idx").exists()):
                problems.append(
                    f"{key} = {spec!r} is invalid: {where!r} does not exist (a folder written by "
                    "`twinpipe prepare-data`, or a Megatron prefix with .bin and .idx)"
                )
    if split is not None:
        try:
            parse_split(split)
        except ValueError as error:
            problems.append(f"data.split = {split!r} is invalid: {error}")
    return problems


def held_out(spec: str, eval_spec: str | None, split: str | None, seq_len: int) -> Corpus | None:
    """The held-out data of a run: ``eval_spec`` whole, else ``split``'s held-out part of
    ``spec``'s sources (same weights), else None."""
    if eval_spec is not None:
        return open_corpus(eval_spec, seq_len, "data.eval_path")
    if split is not None:
        return open_corpus(spec, seq_len, "data.path", split, EVAL)
    return None


def check_corpora(corpora: list[Corpus], vocab_size: int) -> None:
    """Every source speaks one tokenizer and one vocabulary, and holds no id beyond the
    model's ``vocab_size``; `ValueError` names the sources that differ."""
    known = [(c.key, s) for c in corpora for s in c.sources]
    with_tokenizer = [(k, s) for k, s in known if s.tokenizer is not None]
    for key, source in with_tokenizer[1:]:
        first_key, first = with_tokenizer[0]
        if _identity(source.tokenizer) != _identity(first.tokenizer):
            raise ValueError(
                f"{key}: {source.name} was tokenized with {_identity(source.tokenizer)}, but "
                f"{first.name} ({first_key}) with {_identity(first.tokenizer)}: a blend "
                "must be one tokenizer's ids; prepare every source with the same one"
            )
    with_vocab = [(k, s) for k, s in known if s.vocab_size is not None]
    for key, source in with_vocab[1:]:
        first_key, first = with_vocab[0]
        if source.vocab_size != first.vocab_size:
            raise ValueError(
                f"{key}: {source.name} has vocab_size {source.vocab_size}, but {first.name} "
                f"({first_key}) {first.vocab_size}: a blend must share one vocabulary"
            )
    for key, source in known:
        could_exceed = (
            source.vocab_size > vocab_size
            if source.vocab_size is not None
            else np.iinfo(source.tokens.dtype).max >= vocab_size
        )
        if could_exceed:
            largest = largest_token(source.tokens)
            if largest >= vocab_size:
                ids = source.vocab_size
                has = "" if ids is None else f"; its tokenizer has {ids} ids"
                raise ValueError(
                    f"{key}: {source.name} holds token id {largest}, beyond the model's "
                    f"vocabulary (vocab_size = {vocab_size}, ids 0..{vocab_size - 1}){has}: "
                    "prepare the data with the model's tokenizer"
                )


def _identity(tokenizer: dict) -> str:
    """What makes two tokenizers the same: the kind, and the file's hash when there is one."""
    kind = tokenizer.get("kind", "?")
    digest = tokenizer.get("sha256")
    return f"{kind} {str(digest)[:12]}" if digest else str(kind)
