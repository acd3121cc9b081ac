#!/usr/bin/env python3
"""Writes tests/quant/fixtures/awq_<arch>/: modelopt 0.47's AWQ-lite (mtq.INT4_AWQ_CFG and
mtq.W4A8_AWQ_BETA_CFG) on a tiny Hugging Face model whose Linears all have in_features divisible
by INT4's block of 128, the expected numbers of mdist::quant::quantize with formats int4_awq and
w4a8_awq (tests/quant/awq_test.cpp). W4A8's weight quantizer is modelopt's SequentialQuantizer
(INT4 blocks, then FP8 per tensor): its amaxes are stored as `weight_quantizer.0._amax` and
`weight_quantizer.1._amax`, modelopt's state-dict keys.

  /work/venv-quant/bin/python tests/quant/make_awq_fixtures.py

The layout of expected.safetensors is make_ptq_fixtures.py's (calib, eval_ids, loss,
<preset>.loss, <preset>.<quantizer>._amax, <preset>.<quantizer>._pre_quant_scale,
<preset>.enabled with metadata <preset>.quantizers / <preset>.parents), and export_<preset>/
holds modelopt's export_hf_checkpoint of the quantized model; <preset>.export_loss is that
export's held-out loss read back in plain torch (dequantized weights, pre_quant_scale hooks). The models are fp32 (and
awq_qwen3_bf16, the Qwen3 model in bf16), hidden 128, intermediate 256, 2 layers: the smallest
sizes whose every Linear input is a whole number of blocks.
"""

import copy
import json
import pathlib

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import modelopt.torch.quantization as mtq
from modelopt.torch.export import export_hf_checkpoint
from modelopt.torch.quantization.nn import QuantModuleRegistry, TensorQuantizer

HERE = pathlib.Path(__file__).resolve().parent / "fixtures"
COMMON = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=64, max_position_embeddings=64,
              rms_norm_eps=1e-6)
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(rope_theta=10000.0, attention_bias=True,
                                                  tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(rope_theta=1000000.0, head_dim=32,
                                                  tie_word_embeddings=False)),
}
PRESETS = {"int4_awq": mtq.INT4_AWQ_CFG, "w4a8_awq": mtq.W4A8_AWQ_BETA_CFG}
BATCHES, ROWS, T = 3, 2, 16


def build(config_cls, model_cls, extra):
    torch.manual_seed(2025)
    config = config_cls(**COMMON, **extra, architectures=[model_cls.__name__])
    config._attn_implementation = "sdpa"
    model = model_cls(config).eval().float()
    with torch.no_grad():
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


def dequantized_int4(export, name):
    """An exported W4A16_AWQ weight as fp32: two int4 rows per byte (low nibble first) times
    the per-row, per-block weight_scale."""
    packed = export[name].to(torch.int32)
    nibbles = torch.stack([packed & 15, (packed >> 4) & 15], 1).reshape(2 * packed.shape[0], -1)
    codes = torch.where(nibbles >= 8, nibbles - 16, nibbles).float()
    scale = export[name[: -len("weight")] + "weight_scale"].float()
    return codes * scale.repeat_interleave(codes.shape[1] // scale.shape[1], 1)


def fake_e4m3(x, scale):
    """FP8 E4M3 fake quant with amax = scale * 448 (fp32), modelopt's `_fp8_eager` arithmetic:
    x * (448 / amax), clamped, cast to e4m3 (round half to even), back, times 1 / (448 / amax)."""
    amax = scale.float().reshape(()) * 448.0
    s = 448.0 / amax
    y = (x.float() * s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * (1.0 / s)
    return y.to(x.dtype)


def export_loss(model, export_dir, eval_ids):
    """The held-out loss of the export read back in plain torch (no modelopt): the unquantized
    model with the export's dequantized weights and norms, and x * pre_quant_scale before the
    Linears that keep one (what mdist eval of the export must give). W4A8_AWQ: the INT4 weight
    then fake-quantized to FP8 with weight_scale_2 (the second stage of the SequentialQuantizer),
    the input (after its pre_quant_scale) to FP8 with input_scale."""
    export = load_file(str(export_dir / "model.safetensors"))
    readback = copy.deepcopy(model)
    state = {}
    for name, value in export.items():
        if name.endswith(("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale")):
            continue
        if value.dtype == torch.uint8:
            weight = dequantized_int4(export, name)
            scale_2 = export.get(name[: -len("weight")] + "weight_scale_2")
            state[name] = weight if scale_2 is None else fake_e4m3(weight, scale_2)
        else:
            state[name] = value
    readback.load_state_dict(state, strict=False)
    hooks = []
    for name, value in export.items():
        if name.endswith(".weight") and value.dtype == torch.uint8:
            module = name[: -len(".weight")]
            pre = export.get(module + ".pre_quant_scale")
            input_scale = export.get(module + ".input_scale")

            def hook(m, a, pre=pre, input_scale=input_scale):
                x = a[0] if pre is None else a[0] * pre
                return (x if input_scale is None else fake_e4m3(x, input_scale),)

            hooks.append(readback.get_submodule(module).register_forward_pre_hook(hook))
    with torch.no_grad():
        loss = readback(input_ids=eval_ids, labels=eval_ids).loss.float()
    for hook in hooks:
        hook.remove()
    return loss


def write(arch, config_cls, model_cls, extra, dtype=torch.float32):
    model = build(config_cls, model_cls, extra).to(dtype)
    out_dir = HERE / f"awq_{arch}"
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    gen = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size
    calib = torch.randint(0, vocab, (BATCHES, ROWS, T), generator=gen)
    eval_ids = torch.randint(0, vocab, (ROWS, T), generator=gen)
    tensors = {"calib": calib, "eval_ids": eval_ids}
    metadata = {"producer": "modelopt 0.47.0, tests/quant/make_awq_fixtures.py",
                "transformers": transformers.__version__}
    with torch.no_grad():
        tensors["loss"] = model(input_ids=eval_ids, labels=eval_ids).loss.float()
    for preset, cfg in PRESETS.items():
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
        # Copies taken before the export, which rewrites some buffers in place.
        for key, value in quantized.state_dict().items():
            if key.endswith("._amax"):
                tensors[f"{preset}.{key}"] = value.clone().float()
            elif key.endswith("._pre_quant_scale"):
                tensors[f"{preset}.{key}"] = value.clone()
        export_dir = out_dir / f"export_{preset}"
        export_hf_checkpoint(quantized, dtype=dtype, export_dir=str(export_dir))
        (export_dir / "generation_config.json").unlink(missing_ok=True)
        tensors[f"{preset}.export_loss"] = export_loss(model, export_dir, eval_ids)
        print(arch, preset, "loss", tensors["loss"].item(), "->", loss.item(),
              sum(enabled), "of", len(names), "quantizers enabled")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "expected.safetensors"),
              metadata=metadata)


for arch, (config_cls, model_cls, extra) in ARCHS.items():
    write(arch, config_cls, model_cls, extra)
write("qwen3_bf16", *ARCHS["qwen3"], dtype=torch.bfloat16)
