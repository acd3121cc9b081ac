#!/usr/bin/env python3
"""Writes tests/quant/fixtures/ptq_<arch>/: modelopt 0.47's post-training quantization of a tiny
Hugging Face model, the expected numbers of mdist::quant::quantize (tests/quant/ptq_test.cpp).

The environment (modelopt is never a run-time dependency of mdist): see make_fixtures.py.
  /work/venv-quant/bin/python tests/quant/make_ptq_fixtures.py

For each architecture a seeded random model is built with transformers in fp32 (and
ptq_qwen3_bf16: the Qwen3 model in bf16) and saved with
save_pretrained (config.json + model.safetensors: the checkpoint the C++ test loads). Then, on
CPU, for each preset (fp8 = mtq.FP8_DEFAULT_CFG, int8 = mtq.INT8_DEFAULT_CFG, int8_sq =
mtq.INT8_SMOOTHQUANT_CFG: SmoothQuant with alpha 1.0; nvfp4 = mtq.NVFP4_DEFAULT_CFG, its fake
quant on nvfp4_kernel_reference.py; for llama also int8_sq_alpha0.5, that
config with alpha 0.5), a fresh copy of
that model goes through modelopt's own
    mtq.quantize(model, CFG, lambda m: [m(input_ids=b) for b in calib])
and expected.safetensors records:
  calib            int64 [batches, rows, T]: the calibration token batches, in forward order
  eval_ids         int64 [rows, T]: the held-out batch
  loss             f32 []: the unquantized model's loss on eval_ids (labels = eval_ids)
  <preset>.loss    f32 []: the quantized model's loss on eval_ids
  nvfp4.export_loss f32 []: that loss once q/k/v and gate/up share their group's largest
                   weight and input amax, as modelopt's export makes them share weight_scale_2
                   and input_scale: the loss of the NVFP4 export read back
  <preset>.<quantizer name>._amax   every `_amax` buffer modelopt's state dict holds after
                   quantize (e.g. fp8.model.layers.0.self_attn.q_proj.weight_quantizer._amax)
  <preset>.<quantizer name>._pre_quant_scale   SmoothQuant's per-channel scales (int8_sq), in
                   the model's dtype
  <preset>.enabled int64 [n]: 1 where the quantizer named in metadata "<preset>.quantizers"
                   (comma-separated, model order) is enabled after quantize, else 0; metadata
                   "<preset>.parents" names the class of each one's module as modelopt's
                   QuantModuleRegistry does ("nn.Linear", "nn.Embedding", "other")
so that the C++ test also checks which quantizers the configuration enables (and that no
enabled one lacks an amax). export_<preset>/ holds modelopt's export_hf_checkpoint of that
quantized model (model.safetensors, config.json, hf_quant_config.json; its
generation_config.json is dropped: mdist does not write one).

fixtures/exclude_modules.json: [unquantized names, quantized names, modelopt's summary] for
modelopt's `_prefix_wildcard_summarize_exclude_modules` on dense and MoE-like layouts.

fixtures/wildcards.json: [pattern, name, fnmatch.fnmatch(name, pattern)] for modelopt's default
exclusion patterns against names of Llama / Qwen3-MoE / Mixtral modules, and for the corners
of fnmatch (sets, negation, ranges, '?', an unclosed '[').
"""

import copy
import fnmatch
import json
import pathlib

import torch
import transformers
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import modelopt.torch.quantization as mtq
import modelopt.torch.quantization.tensor_quant as tensor_quant
from modelopt.torch.export import export_hf_checkpoint
from modelopt.torch.quantization.config import _default_disabled_quantizer_cfg
from modelopt.torch.quantization.nn import QuantModuleRegistry, TensorQuantizer
from nvfp4_kernel_reference import fp4_kernel_reference

# NVFP4's fake quant has only a CUDA kernel in modelopt: its quantized forward (the loss) runs
# on the pure-torch copy of that kernel's math; calibration (max, quantization off) and the
# export (NVFP4QTensor) are modelopt's own CPU code.
tensor_quant.dynamic_block_quantize_op = fp4_kernel_reference

HERE = pathlib.Path(__file__).resolve().parent / "fixtures"
COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=64, max_position_embeddings=64,
              rms_norm_eps=1e-6)
ARCHS = {
    # biases on q/k/v/o, a tied head (no lm_head module in mdist; disabled in modelopt anyway)
    "llama": (LlamaConfig, LlamaForCausalLM, dict(rope_theta=10000.0, attention_bias=True,
                                                  tie_word_embeddings=True)),
    # GQA with q/k norms, an untied lm_head
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(rope_theta=1000000.0, head_dim=8,
                                                  tie_word_embeddings=False)),
}
PRESETS = {"fp8": mtq.FP8_DEFAULT_CFG, "int8": mtq.INT8_DEFAULT_CFG,
           "int8_sq": mtq.INT8_SMOOTHQUANT_CFG, "nvfp4": mtq.NVFP4_DEFAULT_CFG}
# INT8_SMOOTHQUANT_CFG with another SmoothQuant alpha (mdist quantize --sq-alpha 0.5), on the
# fp32 Llama only.
INT8_SQ_ALPHA_HALF = copy.deepcopy(mtq.INT8_SMOOTHQUANT_CFG)
INT8_SQ_ALPHA_HALF["algorithm"] = {"method": "smoothquant", "alpha": 0.5}
EXTRA_PRESETS = {"llama": {"int8_sq_alpha0.5": INT8_SQ_ALPHA_HALF}}
BATCHES, ROWS, T = 3, 2, 16


def build(config_cls, model_cls, extra):
    torch.manual_seed(2024)
    config = config_cls(**COMMON, **extra, architectures=[model_cls.__name__])
    config._attn_implementation = "sdpa"
    model = model_cls(config).eval().float()
    with torch.no_grad():  # values large enough that every quantizer's rounding matters
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.3 * torch.randn_like(param))
    return model


def parent_class(module):
    for registered in ("nn.Linear", "nn.Embedding"):
        if isinstance(module, QuantModuleRegistry[registered]):
            return registered
    return "other"


def fused_amax_loss(quantized, eval_ids):
    """The loss of an NVFP4-quantized model after the amax change modelopt's export makes
    (`preprocess_linear_fusion`: q/k/v and gate/up get their group's largest weight and input
    amax), on a copy: what reading the export back must give."""
    model = copy.deepcopy(quantized)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for group in ([attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]):
            for name in ("weight_quantizer", "input_quantizer"):
                amax = torch.max(torch.stack([getattr(m, name).amax for m in group]))
                for m in group:
                    getattr(m, name).amax = amax
    with torch.no_grad():
        return model(input_ids=eval_ids, labels=eval_ids).loss.float()


def write_wildcards():
    names = ["model.layers.0.self_attn.q_proj.weight_quantizer", "lm_head.input_quantizer",
             "model.layers.3.mlp.gate.weight_quantizer", "model.layers.3.mlp.gate_proj.input_quantizer",
             "model.layers.1.block_sparse_moe.gate.weight_quantizer",
             "model.layers.1.block_sparse_moe.experts.0.w1.weight_quantizer",
             "model.layers.2.mlp.shared_expert_gate.input_quantizer", "output.weight_quantizer",
             "model.output.weight_quantizer", "mtp.layers.0.weight_quantizer",
             "model.embed_tokens.weight_quantizer", "a[b", "ab", "a]", "a-", "abc", "a.c", ""]
    patterns = [e["quantizer_name"] for e in _default_disabled_quantizer_cfg]
    patterns += ["*", "?", "a?c", "a[bc]", "a[!b]*", "[!a]*", "a[b-d]", "a[]]", "a[!]]", "a[-]",
                 "a[b", "a[b-]", "*weight_quantizer", "*input_quantizer", "**", "a*c*", "", "[a-c]b"]
    cases = [[p, n, fnmatch.fnmatch(n, p)] for p in dict.fromkeys(patterns) for n in names]
    (HERE / "wildcards.json").write_text(json.dumps(cases, indent=0) + "\n")


def write_exclude_cases():
    """modelopt's summary of unquantized module names (exclude_modules) on a few layouts."""
    from modelopt.torch.export.quant_utils import _prefix_wildcard_summarize_exclude_modules
    dense = [f"model.layers.{i}.{m}" for i in range(3)
             for m in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj")]
    moe = [f"model.layers.{i}.mlp.experts.{e}.{m}" for i in range(2) for e in range(2)
           for m in ("gate_proj", "down_proj")]
    cases = [
        (["model.embed_tokens", "lm_head"], dense),
        (["model.embed_tokens", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "lm_head"],
         moe),
        (["model.layers.2.self_attn.q_proj", "model.layers.2.self_attn.o_proj",
          "model.layers.2.mlp.down_proj", "model.layers.20.mlp.down_proj"], dense[:6]),
        (["model.layers.1.mlp.experts.0.gate_proj", "model.layers.1.mlp.experts.0.down_proj",
          "model.layers.1.mlp.experts.1.gate_proj", "lm_head"], moe[:4] + moe[7:]),
    ]
    out = [[u, q, sorted(_prefix_wildcard_summarize_exclude_modules(u, q))] for u, q in cases]
    (HERE / "exclude_modules.json").write_text(json.dumps(out, indent=1) + "\n")
    for case in out:
        print("exclude_modules", case[2])


def write(arch, config_cls, model_cls, extra, dtype=torch.float32, presets=PRESETS):
    model = build(config_cls, model_cls, extra).to(dtype)
    out_dir = HERE / f"ptq_{arch}"
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    gen = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size
    calib = torch.randint(0, vocab, (BATCHES, ROWS, T), generator=gen)
    eval_ids = torch.randint(0, vocab, (ROWS, T), generator=gen)
    tensors = {"calib": calib, "eval_ids": eval_ids}
    metadata = {"producer": "modelopt 0.47.0, tests/quant/make_ptq_fixtures.py",
                "transformers": transformers.__version__}
    with torch.no_grad():
        tensors["loss"] = model(input_ids=eval_ids, labels=eval_ids).loss.float()
    for preset, cfg in presets.items():
        quantized = copy.deepcopy(model)
        mtq.quantize(quantized, cfg, lambda m: [m(input_ids=b) for b in calib])
        with torch.no_grad():
            loss = quantized(input_ids=eval_ids, labels=eval_ids).loss.float()
        tensors[f"{preset}.loss"] = loss
        names, enabled, parents = [], [], []
        for name, module in quantized.named_modules():
            if isinstance(module, TensorQuantizer):
                names.append(name)
                enabled.append(int(module.is_enabled))
                parents.append(parent_class(quantized.get_submodule(name.rpartition(".")[0])))
        metadata[f"{preset}.parents"] = ",".join(parents)
        tensors[f"{preset}.enabled"] = torch.tensor(enabled, dtype=torch.int64)
        metadata[f"{preset}.quantizers"] = ",".join(names)
        # Copies, taken now: state_dict() values share the buffers' storage, and the export
        # below rewrites some in place (its fused-layer preprocessing averages the
        # pre_quant_scales of q/k/v and of gate/up and gives them the group's largest input
        # amax), which would record the export's values instead of quantize's (invisible with
        # alpha 1, where those scales are already equal).
        amax = {k: v.clone() for k, v in quantized.state_dict().items() if k.endswith("._amax")}
        for key, value in amax.items():
            tensors[f"{preset}.{key}"] = value.float()
        # SmoothQuant's per-input-channel scales, in the weights' dtype as modelopt keeps them.
        for key, value in quantized.state_dict().items():
            if key.endswith("._pre_quant_scale"):
                tensors[f"{preset}.{key}"] = value.clone()
        if preset == "nvfp4":
            tensors["nvfp4.export_loss"] = fused_amax_loss(quantized, eval_ids)
        # modelopt's unified HF export of the same quantized model (it modifies the model).
        # dtype given: without it modelopt 0.47 takes transformers 5's config.dtype, here the
        # string "float32", and fails in weight.to("float32") ("Invalid device string").
        export_dir = out_dir / f"export_{preset}"
        export_hf_checkpoint(quantized, dtype=dtype, export_dir=str(export_dir))
        (export_dir / "generation_config.json").unlink(missing_ok=True)
        print(arch, preset, "loss", tensors["loss"].item(), "->", loss.item(),
              len(amax), "amax buffers,", sum(enabled), "of", len(names), "quantizers enabled")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "expected.safetensors"),
              metadata=metadata)


write_wildcards()
write_exclude_cases()
for arch, (config_cls, model_cls, extra) in ARCHS.items():
    write(arch, config_cls, model_cls, extra, presets={**PRESETS, **EXTRA_PRESETS.get(arch, {})})
# The same Qwen3 in bf16 (its own checkpoint): modelopt's export arithmetic differs by dtype.
write("qwen3_bf16", *ARCHS["qwen3"], dtype=torch.bfloat16)
