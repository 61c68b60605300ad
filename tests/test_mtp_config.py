"""Multi-token prediction's settings: the depth read from a DeepSeek-V3 config.json, the
run's ``[mtp]`` section, and every bad value refused by name (exit 2) before any rank."""

from __future__ import annotations

import math

import pytest

from models.hf import config_from_hf, config_to_hf
from models.network import preset
from optimized.train.config import TrainConfig, validate_config
from optimized.train.mtp_coef import coef_steps, mtp_coef_at
from optimized.train.objective import with_mtp
from tests._cli import twinpipe
from tests.test_deepseek_v3 import DEEPSEEK_V3, MOONLIGHT


def test_the_published_depth_is_read_and_written_back():
    published = dict(DEEPSEEK_V3)
    published.pop("quantization_config")
    config = config_from_hf(published)
    assert config.num_mtp_layers == 1 and config.mtp_loss_coef == 0.1
    assert config_to_hf(config)["num_nextn_predict_layers"] == 1
    assert config_from_hf(config_to_hf(config)) == config
    assert config_from_hf(MOONLIGHT).num_mtp_layers == 0  # Moonlight says 0
    absent = {k: v for k, v in MOONLIGHT.items() if k != "num_nextn_predict_layers"}
    assert config_from_hf(absent).num_mtp_layers == 0


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_nextn_predict_layers": -1}, r"num_nextn_predict_layers = -1 .*integer >= 0"),
        ({"num_nextn_predict_layers": 1.5}, r"num_nextn_predict_layers = 1.5 .*an integer"),
        ({"num_nextn_predict_layers": "1"}, r"num_nextn_predict_layers = '1' .*an integer"),
        ({"router_aux_loss_coef": "lots"}, r"router_aux_loss_coef = 'lots' .*a finite number"),
        ({"aux_loss_alpha": [1]}, r"aux_loss_alpha = \[1\] .*a finite number"),
        ({"rms_norm_eps": "1e-6"}, r"rms_norm_eps = '1e-6'"),
        ({"hidden_size": 2048.0}, r"hidden_size = 2048.0 .*an integer"),
        ({"n_group": True}, r"n_group = True .*an integer"),
        ({"rope_scaling": {"type": "yarn", "factor": "x"}}, r"rope_parameters.factor = 'x'"),
    ],
)
def test_every_numeric_config_json_field_names_itself(change, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf({**MOONLIGHT, **change})


def test_model_config_refuses_a_bad_depth_or_weight():
    for value in (-1, 1.0, True):
        with pytest.raises(ValueError, match=r"num_mtp_layers=.*integer >= 0"):
            preset("tiny-deepseek-v3", num_mtp_layers=value)
    for value in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"mtp_loss_coef=.*finite float >= 0"):
            preset("tiny-deepseek-v3", mtp_loss_coef=value)
    config = preset("tiny-deepseek-v3", num_mtp_layers=2)
    assert config.routed_layers == config.moe_layers + 2


def _train(**mtp) -> TrainConfig:
    cfg = TrainConfig()
    for key, value in mtp.items():
        setattr(cfg.mtp, key, value)
    return cfg


@pytest.mark.parametrize(
    ("mtp", "match"),
    [
        ({"layers": -1}, r"mtp.layers = -1 is invalid"),
        ({"loss_coef": -0.5}, r"mtp.loss_coef = -0.5 is invalid"),
        ({"loss_coef": math.nan}, r"mtp.loss_coef = nan is invalid"),
        ({"loss_coef_steps": "10:0.3,5:0.1"}, r"mtp.loss_coef_steps = .*steps must increase"),
        ({"loss_coef_steps": "10:0.3,10:0.1"}, r"steps must increase"),
        ({"loss_coef_steps": "ten:0.3"}, r"'ten:0.3' must be STEP:VALUE"),
        ({"loss_coef_steps": "5:-1"}, r"'5:-1': the value must be a finite number >= 0"),
        ({"loss_coef_steps": "5:nan"}, r"'5:nan': the value"),
    ],
)
def test_the_mtp_section_refuses_by_key(mtp, match):
    with pytest.raises(ValueError, match=match):
        validate_config(_train(**mtp))


def test_the_weight_changes_at_its_steps_and_the_section_sets_the_model():
    cfg = _train(loss_coef=0.3, loss_coef_steps="5:0.1,9:0.05")
    assert coef_steps(cfg.mtp.loss_coef_steps) == [(5, 0.1), (9, 0.05)]
    assert [mtp_coef_at(s, cfg) for s in (1, 4, 5, 8, 9, 100)] == [0.3, 0.3, 0.1, 0.1, 0.05, 0.05]
    v3 = config_from_hf({**DEEPSEEK_V3, "quantization_config": None})
    assert with_mtp(_train(), v3).num_mtp_layers == 1  # unset: the model's own
    assert with_mtp(_train(layers=0), v3).num_mtp_layers == 0
    assert with_mtp(_train(layers=2, loss_coef=0.3), v3).mtp_loss_coef == 0.3


def test_train_exits_2_naming_the_key():
    result = twinpipe("train", "--model", "tiny-deepseek-v3", "--mtp-loss-coef-steps",
                     "10:0.3,5:0.1", "--steps", "1")  # fmt: skip
    assert result.returncode == 2 and "mtp.loss_coef_steps" in result.stderr


def test_the_estimator_counts_the_mtp_layers():
    """FLOPs (MFU's numerator): per depth a decoder layer, eh_proj and one more head."""
    from optimized.estimator.flops import layer_flops, training_flops  # noqa: PLC0415

    plain, mtp = preset("tiny-deepseek-v3"), preset("tiny-deepseek-v3", num_mtp_layers=2)
    h, v, n = plain.hidden_size, plain.vocab_size, plain.num_hidden_layers
    layers = sum(layer_flops(mtp, n + k, 32).total for k in range(2))
    extra = layers + 2 * (2 * 2 * h * h + 2 * h * v)
    more = training_flops(mtp, 32).model - training_flops(plain, 32).model
    assert math.isclose(more, 3 * extra)
