"""Weight sources and meta-device parts: each rank reads only its rows, and the same seed
gives the same weights at any layout."""

from __future__ import annotations

import pytest
import torch

from models.network import (
    ExpertParallel,
    SeededWeights,
    StateDictWeights,
    build_model,
    build_part,
    preset,
)
from models.runtime import even_partition, rank_chunks

PRESETS = ("tiny-deepseek-v2", "tiny-gpt-oss", "tiny-qwen3-moe")


class Recording:
    """A source that remembers what it was asked for (and fills from a seeded one)."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def fill(self, name, out, start=0):
        self.calls.append((name, start, tuple(out.shape), out.dtype))
        self.inner.fill(name, out, start)


@pytest.mark.parametrize("name", PRESETS)
def test_same_seed_same_weights_at_any_layout(name):
    """Every pipeline part (PP=2, the V layout) at every EP rank (EP=2, 4) holds exactly the
    whole model's values of the same seed; another seed differs."""
    config = preset(name)
    whole = build_model(config, seed=5).state_dict()
    stages = even_partition(config.num_hidden_layers, 4)
    for ep_size in (2, 4):
        per_rank = config.num_experts // ep_size
        for ep_rank in range(ep_size):
            for pp_rank in range(2):
                chunks = rank_chunks(stages, pp_rank)
                part = build_part(
                    config, SeededWeights(config, 5), chunks[0] + chunks[1],
                    embedding=pp_rank == 0, head=pp_rank == 0,
                    ep=ExpertParallel(None, ep_rank, ep_size),
                )  # fmt: skip
                for param_name, tensor in part.state_dict().items():
                    expected = whole[param_name]
                    if ".mlp.experts." in param_name:
                        expected = expected[ep_rank * per_rank : (ep_rank + 1) * per_rank]
                    assert torch.equal(tensor, expected), (ep_size, ep_rank, pp_rank, param_name)
    other = build_model(config, seed=6).state_dict()
    assert not torch.equal(other["model.embed_tokens.weight"], whole["model.embed_tokens.weight"])


def test_any_row_range_equals_the_whole_tensor():
    """FSDP2 rows: any [start, stop) of a tensor, expert or not, drawn alone, equals those
    rows of the whole tensor; values are N(0, initializer_range), norms one, biases zero."""
    config = preset("tiny-gpt-oss", vocab_size=5000)  # embedding rows span several blocks
    source = SeededWeights(config, 3)
    generator = torch.Generator().manual_seed(0)
    for name, shape in {
        "model.embed_tokens.weight": (5000, 64),
        "model.layers.1.mlp.experts.gate_up_proj": (8, 64, 64),
        "model.layers.0.self_attn.q_proj.weight": (64, 64),
    }.items():
        whole = torch.empty(shape)
        source.fill(name, whole)
        assert abs(float(whole.std()) - config.initializer_range) < 0.1 * config.initializer_range
        for _ in range(5):
            start = int(torch.randint(0, shape[0], (1,), generator=generator))
            stop = int(torch.randint(start + 1, shape[0] + 1, (1,), generator=generator))
            rows = torch.empty((stop - start,) + shape[1:], dtype=torch.bfloat16)
            source.fill(name, rows, start)
            assert torch.equal(rows, whole[start:stop].to(torch.bfloat16)), (name, start, stop)
    for name, value in (
        ("model.layers.0.input_layernorm.weight", 1.0),
        ("model.layers.0.mlp.experts.down_proj_bias", 0.0),
        ("model.layers.0.self_attn.sinks", 0.0),
    ):
        out = torch.full((4,), 7.0)
        source.fill(name, out)
        assert torch.equal(out, torch.full((4,), value)), name


def test_a_part_reads_only_its_own_rows_once():
    """A pipeline rank's part at EP rank 1 of 2 asks the source once per parameter, for its
    own layers and its own experts only, in the part's dtype; the tied output layer is not
    read (it is the embedding)."""
    config = preset("tiny-qwen3-moe", tie_word_embeddings=True)
    source = Recording(SeededWeights(config))
    part = build_part(
        config, source, [0, 3], embedding=True, head=True,
        ep=ExpertParallel(None, 1, 2), dtype=torch.bfloat16,
    )  # fmt: skip
    names = [call[0] for call in source.calls]
    assert sorted(names) == sorted(n for n, _ in part.named_parameters())
    assert len(names) == len(set(names)) and "lm_head.weight" not in names
    assert part.lm_head.weight is part.model.embed_tokens.weight
    assert not any(".layers.1." in n or ".layers.2." in n for n in names)
    for name, start, _shape, dtype in source.calls:
        assert dtype == torch.bfloat16
        assert start == (4 if ".mlp.experts." in name else 0), name
    asked = sum(torch.Size(shape).numel() for _, _, shape, _ in source.calls)
    assert asked == sum(p.numel() for p in part.parameters())


def test_a_state_dict_is_a_source_and_rope_tables_are_rebuilt():
    config = preset("tiny-deepseek-v2")
    whole = build_model(config, seed=2)
    state = whole.state_dict()
    part = build_part(config, StateDictWeights(state), [1, 2], False, False, dtype=torch.bfloat16)
    # The rotary table stays float32 in a bfloat16 model, as transformers keeps it.
    table = part.layer(1).self_attn.inv_freq
    assert table.dtype == torch.float32
    assert torch.equal(table, whole.layer(1).self_attn.inv_freq)
    for name, tensor in part.state_dict().items():
        assert torch.equal(tensor, state[name].to(torch.bfloat16)), name
    with pytest.raises(KeyError, match="has no tensor model.norm.weight"):
        build_part(config, StateDictWeights({}), [], False, True)


def _sharded_build_worker(cases):
    from models.network import CausalLM
    from models.runtime import ParallelConfig, make_layout
    from optimized.pipeline.sharding import apply_fsdp, held_rows

    out = []
    for name, ep, fields in cases:
        config = preset(name, **fields)
        layout = make_layout(ParallelConfig(pp=1, dp=2, ep=ep, micro_batches=2))
        source = Recording(SeededWeights(config, 4))

        def shard(part, layout=layout):
            apply_fsdp(part, layout, torch.device("cpu"))

        part = build_part(config, source, ep=layout.expert_parallel, shard=shard)
        with torch.device("meta"):
            meta = CausalLM(config, ops=None, ep=layout.expert_parallel)
        plan = held_rows(meta, 2, ep, layout.dp_rank)
        locals_ = {
            n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
            for n, p in part.named_parameters()
        }
        calls = {n: (start, shape[0]) for n, start, shape, _ in source.calls}
        out.append((plan, calls, locals_))
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fsdp_on_meta_reads_exactly_the_planned_rows():
    """FSDP2 applied to the meta part (DP=2; EP=1, experts over 2 replicas, and EP=2):
    each rank reads once, for every parameter, exactly the rows `held_rows` plans without a
    process group (the dry run's figures), and holds those rows of the whole model; the
    MTP layer's (tiny-deepseek-v3, D = 1) as a main layer's."""
    from models.runtime import launch

    cases = [("tiny-gpt-oss", 1, {}), ("tiny-deepseek-v2", 2, {}),
             ("tiny-deepseek-v3", 1, {"num_mtp_layers": 1})]  # fmt: skip
    per_rank = launch(_sharded_build_worker, 2, (cases,))
    for index, (name, _, fields) in enumerate(cases):
        whole = build_model(preset(name, **fields), seed=4).state_dict()
        total = 0
        for rank in per_rank:
            plan, calls, held = rank[index]
            # Read too: DeepSeek-V3's expert biases, buffers (whole on every rank).
            params = {n: rows for n, rows in calls.items() if not n.endswith("correction_bias")}
            assert params == {n: rows for n, rows in plan.items() if rows[1]}, name
            for param_name, (start, count) in plan.items():
                assert torch.equal(held[param_name], whole[param_name][start : start + count])
                total += held[param_name].numel()
        # EP and FSDP2 together: every element of the model is held once over the 2 ranks.
        params = [t for n, t in whole.items() if not n.endswith("correction_bias")]
        assert total == sum(t.numel() for t in params), name
    plan = per_rank[1][2][0]  # rank 1's rows of tiny-deepseek-v3: the second half of each
    mtp = {n: rows for n, rows in plan.items() if n.startswith("model.layers.4.")}
    assert len(mtp) > 10 and all(start > 0 for start, _ in mtp.values()), mtp
