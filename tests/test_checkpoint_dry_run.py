"""The published-size dry run (`benchmarks.checkpoints dry-run`): at PP4 DP8 EP8, built on
the meta device, the ranks of each published model read every byte of its checkpoint
exactly once, and ``--tensors`` lists each rank's reads."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from benchmarks.checkpoints import dry_run_report, main
from models.hf import PUBLISHED_FP8, expected_state_shapes
from models.network import preset

PUBLISHED_BYTES = {
    "deepseek-v2-lite": 31_412_968_448,
    "qwen3-30b-a3b": 61_064_245_248,
    "gpt-oss-20b": 13_761_264_768,  # MXFP4 experts, as published
}
"""``metadata.total_size`` of each published ``model.safetensors.index.json``."""


def _rows_read(report: dict) -> dict[str, list[tuple[int, int]]]:
    """Tensor -> the ``(first row, rows)`` every rank reads of it."""
    rows = defaultdict(list)
    for rank in report["ranks"]:
        assert sum(read["bytes"] for read in rank["reads"]) == rank["bytes"], rank["dp_rank"]
        assert len(rank["reads"]) == rank["tensors"]
        for read in rank["reads"]:
            rows[read["tensor"]].append((read["first_row"], read["rows"]))
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("model", PUBLISHED_BYTES)
def test_the_ranks_read_the_published_checkpoint_once(model):
    """Every tensor's rows are read by exactly one rank (PP stages, EP experts, FSDP2
    rows tile it), and the bytes all ranks read are the published checkpoint's size."""
    report = dry_run_report(model, pp=4, dp=8, ep=8, tensors=True)
    assert report["checkpoint_bytes"] == PUBLISHED_BYTES[model]
    assert report["bytes_read_by_all_ranks"] == PUBLISHED_BYTES[model] and report["equal"]
    assert len(report["ranks"]) == 32
    config = preset(model)
    whole = {
        name: shape[0] if shape else 1
        for name, shape in expected_state_shapes(config).items()
        if not (name == "lm_head.weight" and config.tie_word_embeddings)
    }
    rows = _rows_read(report)
    assert rows.keys() == whole.keys()
    for name, pieces in rows.items():
        end = 0
        for first, count in sorted(pieces):
            assert first == end and count > 0, (name, sorted(pieces))
            end = first + count
        assert end == whole[name], name


DEEPSEEK_V3_FP8_BYTES = 688_574_839_360
"""DeepSeek-V3's checkpoint as published (FP8 linear weights with a float32 scale per 128 x 128
block, float32 expert biases, the rest bf16), its MTP module (layer 61, with its copies of the
embedding and the head) included: the tensors' bytes, 11.9 MB short of the published files'
688,586,727,753 bytes, which also hold 163 safetensors headers (673,150,611,808 without
layer 61)."""


@pytest.mark.slow
def test_the_ranks_read_deepseek_v3_fp8_once_but_shared_scale_rows():
    """At PP4 DP8 EP8 every row of every FP8 weight and every bf16 tensor is read by exactly
    one rank; a rank also reads the scale rows its rows need, so a 128-row block cut by an
    FSDP2 boundary has its scales read by both ranks, and each DP rank of a stage reads its
    layers' expert biases (buffers, not sharded). The MTP layer (on pp-rank 0, with the
    head) is read like a main layer: FSDP2 shards its non-expert parameters over pp-rank
    0's 8 DP ranks (`optimized.pipeline.fsdp_modules`), EP its experts, so each of its rows
    is read once. Its copies of the embedding and the head are read by no rank (the
    parent's check reads them, `models.hf.mtp_copies`). That, and nothing else, is read
    twice."""
    report = dry_run_report("deepseek-v3", pp=4, dp=8, ep=8, partition="even", tensors=True)
    assert report["format"] == "bf16 + FP8 linear weights"
    assert report["checkpoint_bytes"] == DEEPSEEK_V3_FP8_BYTES
    assert report["mtp_copies_bytes"] == 2 * 129280 * 7168 * 2
    config = preset("deepseek-v3")
    assert config.num_mtp_layers == 1  # as the published config.json says
    whole = expected_state_shapes(config)
    rows = _rows_read(report)
    assert rows.keys() == whole.keys()
    assert sum(name.startswith("model.layers.61.") for name in rows) == 20  # ours: fused experts
    on_disk = defaultdict(int)
    for rank in report["ranks"]:
        for read in rank["reads"]:
            on_disk[read["tensor"]] += read["bytes"]
    duplicated = 0
    for name, pieces in rows.items():
        if name.endswith("e_score_correction_bias"):
            assert sorted(pieces) == [(0, whole[name][0])] * 8, name  # every DP rank of its stage
            duplicated += on_disk[name] * 7 // 8
            continue
        end = 0
        for first, count in sorted(pieces):
            assert first == end and count > 0, (name, sorted(pieces))
            end = first + count
        assert end == whole[name][0], name
        if PUBLISHED_FP8.match(name):
            blocks = [b for f, c in pieces for b in range(f // 128, (f + c - 1) // 128 + 1)]
            duplicated += (len(blocks) - len(set(blocks))) * -(-whole[name][1] // 128) * 4
    read = report["bytes_read_by_all_ranks"] + report["mtp_copies_bytes"]
    assert read - report["checkpoint_bytes"] == duplicated


@pytest.mark.slow
def test_dry_run_command_lists_each_ranks_tensors(capsys):
    argv = ["dry-run", "--model", "qwen3-30b-a3b", "--pp", "2", "--dp", "2", "--ep", "2"]
    assert main([*argv, "--tensors"]) == 0
    printed = capsys.readouterr().out
    report = json.loads(printed)
    assert report["equal"] and len(report["ranks"]) == 4
    rank = report["ranks"][0]
    assert rank["reads"][0] == {
        "tensor": "model.embed_tokens.weight", "first_row": 0, "rows": 151936 // 2,
        "bytes": 151936 // 2 * 2048 * 2,
    }  # fmt: skip
    experts = next(r for r in rank["reads"] if r["tensor"].endswith(".experts.gate_up_proj"))
    assert experts["rows"] == 64 and experts["bytes"] == 64 * 2 * 768 * 2048 * 2  # EP2: 64 of 128
    assert sum(len(r["reads"]) for r in report["ranks"]) == report["tensor_slices"]
    read_lines = [line for line in printed.splitlines() if '"tensor": ' in line]
    assert len(read_lines) == report["tensor_slices"]  # one line a read
    assert main(argv) == 0
    assert "reads" not in capsys.readouterr().out
