#!/usr/bin/env python3
"""Writes the parity fixtures of tests/hf_model (run by a developer, not by CI).

    ~/.cache/mdist/bench-venv/bin/pip install transformers
    ~/.cache/mdist/bench-venv/bin/python tests/hf_model/make_fixtures.py

For each architecture, a tiny seeded random model in fp32 is built with transformers and
fixtures/<arch>/ receives:
  config.json     the model's config as save_pretrained writes it
  manifest.json   {"tensors": [{"name", "dtype" ("f16"|"f32"|"i64"), "shape", "offset"}]}
  tensors.bin     the tensors, raw little-endian, at their offsets
Tensors: the weights under their checkpoint names (the save_pretrained key set: a tied
lm_head.weight is left out), stored as f16; the model runs on those f16-rounded values in
fp32, so the C++ side loads exactly the same weights. Then the inputs "input_ids" and
"attention_mask" [3, T] (T = 8 here) (row 0 full, row 1 right-padded, row 2 left-padded), "labels"
(input_ids with -100 at padding and at the left-padded row's first real token, whose
prediction comes from a padded position), and HF's "logits" [3, 8, V] and "loss" [] (f32),
"grad_norms" (the 2-norm of each parameter's gradient of the loss, parameters in name
order, f32); for llama also that gradient of "model.embed_tokens.weight" (its pad_token_id
row is zero) as "grad:model.embed_tokens.weight", and "logits_with_position_ids" for
"position_ids" counted from each row's first real token.

Mixtures of experts (qwen3_moe* and mixtral): transformers 5 holds the experts fused
(mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]); the fixture stores the
weights under the published checkpoints' per-expert names (mlp.experts.N.{gate,up,down}_proj,
Mixtral block_sparse_moe.experts.N.w{1,3,2}, gate first in gate_up_proj) and the fused tensors
as they are in transformers' state_dict under "fused:<key>". The model runs with
output_router_logits=True and router_aux_loss_coef=0.1: "loss" is the language-model loss
alone, "aux_loss" transformers' aux_loss (attention mask applied), "aux_loss_no_mask" that of
load_balancing_loss_func without a mask for row 0 alone, "total_loss" transformers' loss (loss + coef *
aux_loss), whose gradients give "grad_norms" (0 for an expert no token chose).
qwen3_moe_ties: experts 1 and 2 share their router row, so tokens must choose between two equal
scores (the script checks some did): the tie broken as torch.topk breaks it.
qwen3_moe_bf16: the qwen3_moe model in bf16 with every router (mlp.gate) kept in fp32 and fed
fp32 input (a forward pre-hook), "logits" and the losses of that run.
"""
import json
import os
import pathlib

import torch
import transformers
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          MixtralConfig, MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

# MDIST_FIXTURES_DIR: write elsewhere (to compare a regeneration with the committed files).
HERE = pathlib.Path(os.environ.get("MDIST_FIXTURES_DIR",
                                   pathlib.Path(__file__).resolve().parent / "fixtures"))
COMMON = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=40, max_position_embeddings=64,
              rms_norm_eps=1e-6)

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        rope_theta=500000.0, attention_bias=False, tie_word_embeddings=False,
        pad_token_id=0)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(
        rope_theta=10000.0, head_dim=8, sliding_window=5, tie_word_embeddings=False)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(rope_theta=1000000.0,
                                                  tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(rope_theta=1000000.0, head_dim=8,
                                                  tie_word_embeddings=False)),
}
MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1)
QWEN3_MOE = dict(rope_theta=1000000.0, head_dim=8, tie_word_embeddings=False, num_experts=4,
                 moe_intermediate_size=16, **MOE)
ARCHS.update({
    # layer 0 sparse, layer 1 dense (mlp_only_layers); top-k probabilities not renormalised
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        QWEN3_MOE, norm_topk_prob=False, mlp_only_layers=[1])),
    # layer 0 dense, layer 1 sparse (decoder_sparse_step 2); renormalised
    "qwen3_moe_norm": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        QWEN3_MOE, norm_topk_prob=True, decoder_sparse_step=2)),
    "qwen3_moe_ties": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        QWEN3_MOE, norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen3_moe_bf16": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        QWEN3_MOE, norm_topk_prob=False, mlp_only_layers=[1])),
    # a shared expert with its sigmoid gate, q/k/v bias; layer 1 sparse, layer 0 dense
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, dict(
        rope_theta=1000000.0, tie_word_embeddings=False, num_experts=4, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, norm_topk_prob=False, decoder_sparse_step=2, **MOE)),
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(
        rope_theta=1000000.0, num_local_experts=4, tie_word_embeddings=False, **MOE)),
})


def published(state, config):
    """transformers 5's fused experts -> the published per-expert keys, and the fused ones."""
    out, fused = {}, {}
    mixtral = config.model_type == "mixtral"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for key, t in state.items():
        prefix = key.rsplit(".experts.", 1)[0]
        if mixtral:
            prefix = prefix.replace(".mlp", ".block_sparse_moe")
        if key.endswith(".experts.gate_up_proj"):
            fused[key] = t
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.experts.{e}.{names[0]}.weight"] = t[e, :half]
                out[f"{prefix}.experts.{e}.{names[1]}.weight"] = t[e, half:]
        elif key.endswith(".experts.down_proj"):
            fused[key] = t
            for e in range(t.shape[0]):
                out[f"{prefix}.experts.{e}.{names[2]}.weight"] = t[e]
        elif mixtral and key.endswith(".mlp.gate.weight"):
            fused[key] = t
            out[key.replace(".mlp.", ".block_sparse_moe.")] = t
        else:
            out[key] = t
    return out, fused


def write(arch, config_cls, model_cls, extra, seq_len=8, followups=(), rope_tables=False,
          attention="sdpa"):
    """seq_len: the inputs' length. followups: lengths of further forwards, run in order after
    the first (no mask, every row cut to that length), whose logits are stored as
    "logits_<length>": they show the state transformers keeps between forwards (dynamic RoPE,
    longrope's short and long factors). rope_tables: also store the rotary embedding's
    "rope:inv_freq" as built, "rope:inv_freq_after" as the first forward left it, and
    "rope:attention_scaling" [1]. attention: transformers' attention implementation ("eager"
    where sdpa cannot run the model, as Gemma 2's soft-capping)."""
    torch.manual_seed(1234)
    config = config_cls(**{**COMMON, **extra}, architectures=[model_cls.__name__])
    config._attn_implementation = attention
    model = model_cls(config).eval().float()
    with torch.no_grad():  # large enough values that every parameter matters, f16-exact
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.3 * torch.randn_like(param))
            param.copy_(param.half().float())
    moe = hasattr(config, "num_experts_per_tok")
    if arch.endswith("_ties"):  # experts 1 and 2 get the same router row: their scores tie
        with torch.no_grad():
            for layer in model.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.weight[2] = layer.mlp.gate.weight[1]
    if arch.endswith("_bf16"):  # bf16, routers in fp32 fed fp32 input
        model.to(torch.bfloat16)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.float()
                layer.mlp.gate.register_forward_pre_hook(lambda m, args: (args[0].float(),))

    T = seq_len
    ids = torch.randint(0, config.vocab_size, (3, T))
    ids[0, 2] = 0  # the llama fixture's pad_token_id: its embedding row gets no gradient
    mask = torch.ones(3, T, dtype=torch.int64)
    mask[1, T - 2:] = 0
    mask[2, :3] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[2, 3] = -100
    rotary = model.model.rotary_emb
    built_inv_freq = rotary.inv_freq.clone() if rope_tables else None
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert torch.isfinite(out.loss), out.loss
    if rope_tables:
        extra_rope = [("rope:inv_freq", built_inv_freq.float()),
                      ("rope:inv_freq_after", rotary.inv_freq.detach().clone().float()),
                      ("rope:attention_scaling", torch.tensor([rotary.attention_scaling],
                                                              dtype=torch.float32))]
    out.loss.backward()
    extra = []
    if moe:
        with torch.no_grad():
            plain = model(input_ids=ids, attention_mask=mask, labels=labels,
                          output_router_logits=False)
            # Without a mask every position counts, padding too, whose hidden states are
            # unspecified: row 0 alone (no padding).
            experts = getattr(config, "num_experts", None) or config.num_local_experts
            row = model(input_ids=ids[:1], output_router_logits=True)
            no_mask = load_balancing_loss_func(row.router_logits, experts,
                                               config.num_experts_per_tok, None)
        assert torch.equal(plain.logits, out.logits)
        extra = [("total_loss", out.loss.detach().float()), ("aux_loss", out.aux_loss.detach().float()),
                 ("aux_loss_no_mask", no_mask.float())]
        print(arch, "aux_loss", out.aux_loss.item(), "router logits", len(out.router_logits))
        if arch.endswith("_ties"):  # some token must have had to choose between 1 and 2
            broken = 0
            for logits in out.router_logits:
                probs = logits.float().softmax(-1)
                chosen = probs.topk(config.num_experts_per_tok, -1).indices
                one = (chosen == 1).any(-1) ^ (chosen == 2).any(-1)
                broken += int((one & (probs[:, 1] == probs[:, 2])).sum())
            assert broken > 0, "no routing tie was broken"
            print(arch, "ties broken", broken)
        out.loss = plain.loss

    out_dir = HERE / arch
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)  # config.json
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    fused = {}
    if moe:
        state, fused = published(state, config)
    tensors = [(n, t.detach().half()) for n, t in sorted(state.items())]
    tensors += [("fused:" + n, t.detach().half()) for n, t in sorted(fused.items())]
    grads = {n: (p.grad.float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float))
             for n, p in model.named_parameters()}
    if moe:
        grads, _ = published(grads, config)
    tensors += [("input_ids", ids), ("attention_mask", mask), ("labels", labels),
                ("logits", out.logits.detach().float()), ("loss", out.loss.detach().float()),
                ("grad_norms", torch.stack([g.norm() for _, g in sorted(grads.items())]))]
    tensors += extra
    if rope_tables:
        tensors += extra_rope
    if arch == "llama":  # the full embedding gradient, and explicit position ids
        tensors.append(("grad:model.embed_tokens.weight", model.model.embed_tokens.weight.grad))
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate() derives them
        with torch.no_grad():
            shifted = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        tensors += [("position_ids", positions), ("logits_with_position_ids", shifted)]
    with torch.no_grad():
        for length in followups:
            tensors.append((f"logits_{length}", model(input_ids=ids[:, :length]).logits.float()))
    manifest, blob = [], bytearray()
    codes = {torch.float16: "f16", torch.float32: "f32", torch.int64: "i64"}
    for name, tensor in tensors:
        tensor = tensor.contiguous()
        manifest.append({"name": name, "dtype": codes[tensor.dtype],
                         "shape": list(tensor.shape), "offset": len(blob)})
        blob += tensor.numpy().astype(tensor.numpy().dtype.newbyteorder("<")).tobytes()
    (out_dir / "tensors.bin").write_bytes(bytes(blob))
    (out_dir / "manifest.json").write_text(json.dumps({
        "transformers_version": transformers.__version__, "torch_version": torch.__version__,
        "tensors": manifest}, indent=1) + "\n")
    print(arch, "loss", out.loss.item(), "bytes", len(blob))


if __name__ == "__main__":
    import sys
    for arch, (config_cls, model_cls, extra) in ARCHS.items():
        if len(sys.argv) < 2 or arch in sys.argv[1:]:  # make_fixtures.py [ARCH...]
            write(arch, config_cls, model_cls, extra)
