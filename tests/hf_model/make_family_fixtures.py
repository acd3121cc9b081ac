#!/usr/bin/env python3
"""Writes the Phi-3 and OLMo 2 parity fixtures of tests/hf_model (run by a developer, not by
CI), in the format of make_fixtures.py (whose write() they use):

    /work/venv-quant/bin/python tests/hf_model/make_family_fixtures.py [NAME...]

Tiny seeded models of transformers 5.24's Phi3ForCausalLM and Olmo2ForCausalLM on 24 tokens:
  phi3       longrope (original_max_position_embeddings 16 at the top level, as Phi-3 stores
             it, so the 24 tokens take the long factors) with partial_rotary_factor 0.5 (the
             first 4 of 8 channels rotate, as Phi-4-mini's 0.75); "logits_20" and "logits_12"
             are later forwards (long factors, then short ones again) and the rotary tables
             are stored (write()'s rope_tables).
  phi3_bf16  default RoPE, a sliding window of 5 on every layer, tied embeddings, in bf16.
  olmo2      q/k norms over the whole projections, norms after each sub-layer, q/k/v/o bias.
  olmo2_bf16 the same in bf16 (OLMo 2 multiplies its norm weights and rotates in fp32).
"""
import sys

from transformers import Olmo2Config, Olmo2ForCausalLM, Phi3Config, Phi3ForCausalLM

from make_fixtures import write

LONG = 24

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
}

if __name__ == "__main__":
    for name, ((config_cls, model_cls, extra), options) in FIXTURES.items():
        if len(sys.argv) > 1 and name not in sys.argv[1:]:
            continue
        write(name, config_cls, model_cls, extra, seq_len=LONG, **options)
