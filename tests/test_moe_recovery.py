"""A router that starts collapsed recovers under each balancing mechanism, and not without.

The start: every MoE router's inputs share a direction (a common component added to every
token embedding, as real hidden states share a mean) and the gate rows of experts 0 and 2
lean toward it, their other rows scaled up so tokens still differ; so most tokens pick
experts 0 and 2 and some experts get almost none (max/mean load near 3 of a possible 4).
Trained on the language-model loss alone the collapse holds (the chosen experts learn, the
rest starve); with the pooled loss (tiny Qwen3-MoE), DeepSeek's sequence loss (tiny
DeepSeek-V2) or the expert bias (through ``twinpipe train``, end to end, on its default
data) the load's max/mean falls below `TARGET` within `STEPS` steps.

The load is counted per step over the global batch (256 tokens, 512 routed copies a
layer); a single step's max/mean is noisy at that size (a perfectly balanced router's
is about 1.3), so each figure is the max/mean of the load summed over the last `WINDOW`
steps, per layer, worst layer. A run with a loss stops once it has recovered; the pictures
(`harness.report.plot_expert_load`) are written into the test's folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.report import load_from_metrics, plot_expert_load
from models.hf import save_pretrained
from models.network import StateDictWeights, build_model, build_part, preset
from models.runtime import OptimizerConfig, ParallelConfig, launch, make_layout, synthetic_batch

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

ROOT = Path(__file__).resolve().parents[1]
STEPS, WINDOW, TARGET = 200, 10, 1.5
WINNERS = (0, 2)
"""The experts the collapsed routers prefer (in different groups of DeepSeek's top-k)."""
SHIFT, TILT, GATE_SCALE = 0.05, 0.6, 5.0
"""The common component added to the embeddings, how far the winners' gate rows lean to it,
and the factor on every gate row (initializer_range 0.02: the token-specific logits' spread
about 0.8, the winners' lead about 1.5)."""
LR = 5e-4
BATCH = dict(micro_batch_size=8, micro_batches=2, seq_len=16)
MODELS = {"qwen3": ("tiny-qwen3-moe", 2), "deepseek": ("tiny-deepseek-v2", 3)}
"""Family -> (preset, layers): two MoE layers each (DeepSeek's first layer is dense)."""


def collapsed_state(config) -> dict[str, torch.Tensor]:
    """The seeded weights of ``config`` with every router collapsed onto `WINNERS`."""
    state = {k: v.detach().clone() for k, v in build_model(config, seed=0).state_dict().items()}
    direction = torch.randn(config.hidden_size, generator=torch.Generator().manual_seed(1))
    direction /= direction.norm()
    state["model.embed_tokens.weight"] += SHIFT * direction
    for layer in range(config.num_hidden_layers):
        if config.is_moe_layer(layer):
            gate = state[f"model.layers.{layer}.mlp.gate.weight"]
            gate *= GATE_SCALE
            gate[list(WINNERS)] += TILT * direction
    return state


def worst_step(step_load: list) -> float:
    """The worst layer's max/mean of one step's load."""
    load = torch.tensor(step_load, dtype=torch.float64)
    return float((load.max(dim=1).values / load.mean(dim=1)).max())


def worst_windows(load: list) -> list[float]:
    """Per step from `WINDOW` on: the worst layer's max/mean of the last `WINDOW` steps' load."""
    out = []
    for end in range(WINDOW, len(load) + 1):
        summed = torch.tensor(load[end - WINDOW : end], dtype=torch.float64).sum(dim=0)
        out.append(float((summed.max(dim=1).values / summed.mean(dim=1)).max()))
    return out


def _train(cases: list[tuple[str, dict]]) -> list[list]:
    """Each case on one rank with the reference stack's runner: its per-step load."""
    from reference.pipeline import ReferencePipeline  # noqa: PLC0415

    parallel = ParallelConfig(pp=1, dp=1, ep=1, seed=0, **BATCH)
    layout = make_layout(parallel)
    loads = []
    for family, controls in cases:
        name, layers = MODELS[family]
        config = preset(name, num_hidden_layers=layers, **controls)
        weights = StateDictWeights(collapsed_state(preset(name, num_hidden_layers=layers)))
        runner = ReferencePipeline(config, parallel, layout, weights, OptimizerConfig(lr=LR))
        load = []
        for step in range(STEPS):
            runner.forward_backward(*synthetic_batch(config, parallel, step))
            load.append(runner.step_load().tolist())
            runner.optimizer_step()
            if controls and len(load) >= WINDOW and worst_windows(load[-WINDOW:])[0] < TARGET:
                break  # recovered: only the runs without balancing need every step
        loads.append(load)
    return loads


CASES = {
    "qwen3 off": ("qwen3", {}),
    "qwen3 pooled": ("qwen3", dict(aux_loss="pooled", aux_loss_coef=0.3)),
    "deepseek off": ("deepseek", {}),
    "deepseek sequence": ("deepseek", dict(aux_loss="sequence", aux_loss_coef=0.3)),
}


def test_a_collapsed_router_recovers_with_each_loss_and_not_without(tmp_path):
    loads = dict(zip(CASES, launch(_train, 1, (list(CASES.values()),))[0], strict=True))
    report = []
    for case, load in loads.items():
        windows = worst_windows(load)
        first = next((i + WINDOW for i, w in enumerate(windows) if w < TARGET), None)
        report.append(f"{case}: step 1 {worst_step(load[0]):.2f}, min {min(windows):.2f}, "
                      f"last {windows[-1]:.2f}, below {TARGET} first at step {first}")  # fmt: skip
        name, count = MODELS[CASES[case][0]]
        layers = [i for i in range(count) if preset(name, num_hidden_layers=count).is_moe_layer(i)]
        plot_expert_load(load, tmp_path / f"{case.replace(' ', '-')}.png", layers=layers,
                         title=f"expert load, collapsed start: {case}", target=TARGET)  # fmt: skip
    print("\n".join(report), f"\npictures in {tmp_path}")
    for case, load in loads.items():
        windows = worst_windows(load)
        assert worst_step(load[0]) > 2.5, report  # it did start collapsed
        if case.endswith("off"):
            assert min(windows) > TARGET, report
        else:
            assert min(windows) < TARGET, report


def test_the_expert_bias_recovers_through_twinpipe_train(tmp_path):
    """``twinpipe train`` from an HF folder holding the collapsed weights (no bias: it starts
    at zero), ``moe.expert_bias`` on: the metrics file's load recovers."""
    name, layers = MODELS["deepseek"]
    config = preset(name, num_hidden_layers=layers)
    save_pretrained(build_part(config, StateDictWeights(collapsed_state(config))), tmp_path / "hf")
    metrics = tmp_path / "metrics.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "harness.cli", "train", "--init-from", str(tmp_path / "hf"),
         "--steps", str(STEPS), "--lr", str(LR), "--warmup-steps", "0", "--lr-schedule",
         "constant", "--seq-len", str(BATCH["seq_len"]), "--micro-batch-size",
         str(BATCH["micro_batch_size"]), "--micro-batches", str(BATCH["micro_batches"]),
         "--expert-bias", "on", "--expert-bias-rate", "0.01", "--metrics-file", str(metrics),
         "--nproc", "1", "--device", "cpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
        env={**os.environ, "TWINPIPE_RUNNER": "reference.pipeline:ReferencePipeline"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "load-max/mean" in done.stdout
    steps, moe_layers, load = load_from_metrics(metrics)
    assert steps == list(range(1, STEPS + 1)) and moe_layers == [1, 2]
    windows = worst_windows(load)
    plot_expert_load(load, tmp_path / "deepseek-bias.png", layers=moe_layers, steps=steps,
                     title="expert load, collapsed start: deepseek, expert bias (twinpipe train)",
                     target=TARGET)  # fmt: skip
    print(f"twinpipe train, expert bias: step 1 {worst_step(load[0]):.2f}, min {min(windows):.2f}, "
          f"last {windows[-1]:.2f}; picture in {tmp_path}")  # fmt: skip
    assert worst_step(load[0]) > 2.5 and min(windows) < TARGET
