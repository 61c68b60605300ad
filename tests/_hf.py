"""A transformers model of one of our configs, for the parity tests."""

from __future__ import annotations

import torch
import transformers

from models.hf import config_to_hf

BIAS_STD = 0.1
"""DeepSeek-V3's expert bias is drawn N(0, 0.1): sigmoid scores of a random router spread by
about as much, so the bias changes many tokens' experts and groups (a router that ignored
it fails these tests)."""


def hf_model(config, noise: float = 0.05, seed: int = 0, dtype=torch.float32):
    """A transformers model of our config in ``dtype``, in eval mode, with eager math and
    noise on every parameter (and a random expert bias, DeepSeek-V3's
    ``e_score_correction_bias``, where the family has one)."""
    torch.manual_seed(seed)
    hf_config = transformers.AutoConfig.for_model(**config_to_hf(config))
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * noise)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * BIAS_STD)
    return model.to(dtype).eval()
