#!/usr/bin/env python3
"""Writes tests/quant/fixtures/ptq_qwen3_moe/: modelopt 0.47's post-training quantization of a
tiny Qwen3-MoE built with transformers 5.24, whose routed experts are fused tensors
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]); the expected numbers
of mdist::quant::quantize on a mixture of experts (tests/quant/ptq_moe_test.cpp).

The environment (modelopt is never a run-time dependency of mdist):
  /root/.cache/mdist/bench-venv/bin/python tests/quant/make_ptq_moe_fixtures.py

As make_ptq_fixtures.py, in fp32 on CPU: the seeded model is saved with save_pretrained
(config.json + model.safetensors; transformers 5.24 writes the experts per expert,
`mlp.experts.E.gate_proj.weight`, and fuses them again when it loads), then for each preset (fp8, int8, int8_sq, nvfp4: its fake quant on
nvfp4_kernel_reference.py) a fresh copy goes through modelopt's own
    mtq.quantize(model, CFG, lambda m: [m(input_ids=b) for b in calib])
and expected.safetensors records the same keys as make_ptq_fixtures.py's (calib, eval_ids, loss,
<preset>.loss, every <preset>.<quantizer>._amax under modelopt's names, SmoothQuant's
<preset>.<quantizer>._pre_quant_scale, <preset>.enabled with metadata <preset>.quantizers and
<preset>.parents). modelopt's fused-experts module (_QuantFusedExperts) names its quantizers
    model.layers.L.mlp.experts.gate_up_proj_input_quantizer    (one, shared by every expert)
    model.layers.L.mlp.experts.down_proj_input_quantizer       (one, shared by every expert)
    model.layers.L.mlp.experts.gate_up_proj_weight_quantizers.E  (per expert: gate and up rows)
    model.layers.L.mlp.experts.down_proj_weight_quantizers.E     (per expert)
export_<preset>/ holds modelopt's export_hf_checkpoint of that quantized model (it splits the
fused experts into per-expert gate_proj / up_proj / down_proj with their own scales; its
generation_config.json is dropped: mdist does not write one). The script prints how the export
names and shares the experts' scales, for docs/quantization.md.
"""

import copy
import pathlib

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import modelopt.torch.quantization as mtq
import modelopt.torch.quantization.tensor_quant as tensor_quant
from modelopt.torch.export import export_hf_checkpoint
from modelopt.torch.quantization.nn import QuantModuleRegistry, TensorQuantizer
from nvfp4_kernel_reference import fp4_kernel_reference

tensor_quant.dynamic_block_quantize_op = fp4_kernel_reference

HERE = pathlib.Path(__file__).resolve().parent / "fixtures"
PRESETS = {"fp8": mtq.FP8_DEFAULT_CFG, "int8": mtq.INT8_DEFAULT_CFG,
           "int8_sq": mtq.INT8_SMOOTHQUANT_CFG, "nvfp4": mtq.NVFP4_DEFAULT_CFG}
BATCHES, ROWS, T = 3, 2, 16


def build():
    torch.manual_seed(2024)
    config = Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=8, vocab_size=64, max_position_embeddings=64,
                            rms_norm_eps=1e-6, num_experts=4, num_experts_per_tok=2,
                            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                            rope_theta=1000000.0, tie_word_embeddings=False,
                            architectures=["Qwen3MoeForCausalLM"])
    config._attn_implementation = "sdpa"
    model = Qwen3MoeForCausalLM(config).eval().float()
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


def main():
    model = build()
    out_dir = HERE / "ptq_qwen3_moe"
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    (out_dir / "generation_config.json").unlink(missing_ok=True)
    print("checkpoint tensors:", sorted(load_file(str(out_dir / "model.safetensors")))[:12])
    gen = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size
    calib = torch.randint(0, vocab, (BATCHES, ROWS, T), generator=gen)
    eval_ids = torch.randint(0, vocab, (ROWS, T), generator=gen)
    tensors = {"calib": calib, "eval_ids": eval_ids}
    metadata = {"producer": "modelopt 0.47.0, tests/quant/make_ptq_moe_fixtures.py",
                "transformers": transformers.__version__}
    with torch.no_grad():
        tensors["loss"] = model(input_ids=eval_ids, labels=eval_ids).loss.float()
    for preset, cfg in PRESETS.items():
        quantized = copy.deepcopy(model)
        mtq.quantize(quantized, cfg, lambda m: [m(input_ids=b) for b in calib])
        if preset == "fp8":
            print(quantized.model.layers[0].mlp)
        with torch.no_grad():
            loss = quantized(input_ids=eval_ids, labels=eval_ids).loss.float()
        tensors[f"{preset}.loss"] = loss
        names, enabled, parents = [], [], []
        for name, module in quantized.named_modules():
            if isinstance(module, TensorQuantizer):
                names.append(name)
                enabled.append(int(module.is_enabled))
                parent = quantized.get_submodule(name.rpartition(".")[0])
                if isinstance(parent, torch.nn.ModuleList):  # per-expert weight quantizers
                    parent = quantized.get_submodule(name.rsplit(".", 2)[0])
                parents.append(parent_class(parent))
        metadata[f"{preset}.parents"] = ",".join(parents)
        tensors[f"{preset}.enabled"] = torch.tensor(enabled, dtype=torch.int64)
        metadata[f"{preset}.quantizers"] = ",".join(names)
        state = quantized.state_dict()
        for key, value in state.items():
            if key.endswith("._amax"):
                tensors[f"{preset}.{key}"] = value.clone().float()
            elif key.endswith("._pre_quant_scale"):
                tensors[f"{preset}.{key}"] = value.clone()
        export_dir = out_dir / f"export_{preset}"
        export_hf_checkpoint(quantized, dtype=torch.float32, export_dir=str(export_dir))
        (export_dir / "generation_config.json").unlink(missing_ok=True)
        exported = load_file(str(export_dir / "model.safetensors"))
        experts = sorted(k for k in exported if ".mlp.experts.0." in k and "layers.0." in k)
        print(preset, "loss", tensors["loss"].item(), "->", loss.item(), sum(enabled), "of",
              len(names), "quantizers enabled; layer 0 expert 0 exports", experts)
        print("  amax keys of layer 0 experts:",
              sorted(k for k in state if k.endswith("_amax") and "layers.0.mlp.experts" in k)[:6])
        for k in experts:
            if k.endswith("scale") or k.endswith("scale_2"):
                print("  ", k, exported[k].flatten()[:3].tolist())
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "expected.safetensors"),
              metadata=metadata)


if __name__ == "__main__":
    main()
