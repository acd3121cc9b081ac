#!/usr/bin/env python3
"""Writes the Phi-3, OLMo 2, Gemma 2 and Gemma 3 parity fixtures of tests/hf_model (run by a developer, not by
CI), in the format of make_fixtures.py (whose write() they use):

    /work/venv-quant/bin/python tests/hf_model/make_family_fixtures.py [NAME...]

Tiny seeded models of transformers 5.24's Phi3ForCausalLM, Olmo2ForCausalLM,
Gemma2ForCausalLM and Gemma3ForCausalLM on 24 tokens:
  phi3       longrope (original_max_position_embeddings 16 at the top level, as Phi-3 stores
             it, so the 24 tokens take the long factors) with partial_rotary_factor 0.5 (the
             first 4 of 8 channels rotate, as Phi-4-mini's 0.75); "logits_20" and "logits_12"
             are later forwards (long factors, then short ones again) and the rotary tables
             are stored (write()'s rope_tables).
  phi3_bf16  default RoPE, a sliding window of 5 on every layer, tied embeddings, in bf16.
  olmo2      q/k norms over the whole projections, norms after each sub-layer, q/k/v/o bias.
  olmo2_bf16 the same in bf16 (OLMo 2 multiplies its norm weights and rotates in fp32).
  gemma2     sandwich norms, (1 + weight) norms, scaled embeddings, GeGLU, head_dim 16 (not
             hidden / heads), query_pre_attn_scalar 12, attention and final soft-capping small
             enough to bite (2 and 3), layer 0 sliding (window 5), layer 1 full, tied head;
             eager attention (sdpa has no soft-capping).
  gemma2_bf16 the same in bf16.
  gemma3     Gemma 3 text: no soft-capping, per-head q/k norms, sliding_window_pattern 2
             (layer 0 sliding, window 5, layer 1 full), per-layer-type RoPE: linear scaling
             (factor 4, theta 1e6) on the full layer, plain theta 1e4 on the sliding one; sdpa,
             transformers' default for Gemma 3 and mdist's attention there (eager sums the
             products in another order: 1e-5 apart on these logits of up to 15).
  gemma3_bf16 the same in bf16.
"""
import sys

from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig,
                          Olmo2Config, Olmo2ForCausalLM, Phi3Config, Phi3ForCausalLM)

from make_fixtures import write

LONG = 24
GEMMA2 = dict(head_dim=16, query_pre_attn_scalar=12, sliding_window=5,
              attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
GEMMA3 = dict(head_dim=16, query_pre_attn_scalar=12, sliding_window=5, sliding_window_pattern=2,
              rope_parameters={
                  "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
EAGER = dict(attention="eager")

FIXTURES = {
    "phi3": ((Phi3Config, Phi3ForCausalLM, dict(
        pad_token_id=0, tie_word_embeddings=False, original_max_position_embeddings=16,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5, "short_factor": [1.0, 1.3],
                         "long_factor": [1.5, 6.0]})),
             dict(followups=(20, 12), rope_tables=True)),
    "phi3_bf16": ((Phi3Config, Phi3ForCausalLM, dict(
        pad_token_id=0, tie_word_embeddings=True, sliding_window=5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})), {}),
    "olmo2": ((Olmo2Config, Olmo2ForCausalLM, dict(
        pad_token_id=0, tie_word_embeddings=False, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0})), {}),
    "olmo2_bf16": ((Olmo2Config, Olmo2ForCausalLM, dict(
        pad_token_id=0, tie_word_embeddings=False, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0})), {}),
    "gemma2": ((Gemma2Config, Gemma2ForCausalLM, GEMMA2), EAGER),
    "gemma2_bf16": ((Gemma2Config, Gemma2ForCausalLM, GEMMA2), EAGER),
    "gemma3": ((Gemma3TextConfig, Gemma3ForCausalLM, GEMMA3), {}),
    "gemma3_bf16": ((Gemma3TextConfig, Gemma3ForCausalLM, GEMMA3), {}),
}

if __name__ == "__main__":
    for name, ((config_cls, model_cls, extra), options) in FIXTURES.items():
        if len(sys.argv) > 1 and name not in sys.argv[1:]:
            continue
        write(name, config_cls, model_cls, extra, seq_len=LONG, **options)
