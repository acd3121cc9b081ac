#!/usr/bin/env python3
"""Writes the RoPE and per-layer attention parity fixtures of tests/hf_model (run by a
developer, not by CI), in the format of make_fixtures.py (whose write() they use):

    /work/venv-quant/bin/python tests/hf_model/make_rope_fixtures.py [NAME...]

Tiny llama / qwen models, one per RoPE kind of transformers' ROPE_INIT_FUNCTIONS, on 24 tokens:
longer than original_max_position_embeddings (16; dynamic: max_position_embeddings 16), so the
long-context branches run. rope_dynamic and rope_longrope also store "logits_20" and
"logits_12": forwards of 20 and then 12 tokens after the first, which show transformers' state
between forwards (dynamic keeps the frequencies of the 24 tokens for 20, goes back to the
original ones for 12; longrope uses its long factors for 20, its short ones for 12).

rope_partial (yarn with partial_rotary_factor 0.5): transformers' Llama attention rotates the
whole head (a partial factor fails on shapes there), so that fixture runs Llama with Phi-3's
apply_rotary_pos_emb, transformers' own partial rotation (the first rotary_dim channels rotate,
the rest pass), as the models that use the factor do.

Each also stores transformers' rotary tables (rope:inv_freq, rope:inv_freq_after,
rope:attention_scaling: write()'s rope_tables), which mdist's must equal bit for bit.

qwen3_sliding: Qwen3's use_sliding_window + max_window_layers (layer 1 of 2 slides, window 5);
qwen2_layer_types: explicit layer_types (layer 0 slides, window 6).
"""
import sys

import transformers.models.llama.modeling_llama as modeling_llama
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as partial_rotary

from make_fixtures import write

LONG = 24
LLAMA = dict(rope_theta=10000.0, attention_bias=False, tie_word_embeddings=False)


def llama(rope, **extra):
    return (LlamaConfig, LlamaForCausalLM, dict(LLAMA, rope_parameters=rope, **extra))


FIXTURES = {
    "rope_linear": (llama({"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}), {}),
    "rope_dynamic": (llama({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                           max_position_embeddings=16), dict(followups=(20, 12))),
    "rope_yarn": (llama({"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                         "original_max_position_embeddings": 16}), {}),
    # attention factor from mscale / mscale_all_dim, an untruncated correction range, betas
    "rope_yarn_mscale": (llama({"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                "original_max_position_embeddings": 16, "mscale": 0.707,
                                "mscale_all_dim": 1.0, "truncate": False, "beta_fast": 2,
                                "beta_slow": 0.25}), {}),
    # an explicit attention factor, in Qwen3
    "rope_yarn_qwen3": ((Qwen3Config, Qwen3ForCausalLM, dict(
        head_dim=8, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1000000.0,
                         "original_max_position_embeddings": 16, "attention_factor": 0.8})), {}),
    # no factor: max_position_embeddings / original_max_position_embeddings = 4
    "rope_longrope": (llama({"rope_type": "longrope", "rope_theta": 10000.0,
                             "short_factor": [1.0, 1.1, 1.3, 1.6],
                             "long_factor": [1.0, 2.0, 4.0, 8.0],
                             "original_max_position_embeddings": 16}),
                      dict(followups=(20, 12))),
    "rope_llama3": (llama({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                           "rope_theta": 500000.0}), {}),
    "rope_partial": (llama({"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                            "original_max_position_embeddings": 16,
                            "partial_rotary_factor": 0.5}, head_dim=16), {}),
    "qwen3_sliding": ((Qwen3Config, Qwen3ForCausalLM, dict(
        rope_theta=1000000.0, head_dim=8, tie_word_embeddings=False, use_sliding_window=True,
        sliding_window=5, max_window_layers=1)), {}),
    "qwen2_layer_types": ((Qwen2Config, Qwen2ForCausalLM, dict(
        rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=True, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"])), {}),
}

if __name__ == "__main__":
    for name, ((config_cls, model_cls, extra), options) in FIXTURES.items():
        if len(sys.argv) > 1 and name not in sys.argv[1:]:
            continue
        original = modeling_llama.apply_rotary_pos_emb
        if name == "rope_partial":
            modeling_llama.apply_rotary_pos_emb = partial_rotary
        try:
            write(name, config_cls, model_cls, extra, seq_len=LONG, rope_tables=True, **options)
        finally:
            modeling_llama.apply_rotary_pos_emb = original
