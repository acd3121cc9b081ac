#!/usr/bin/env python3
"""Writes the KV-cache fixtures beside make_ptq_fixtures.py's: modelopt 0.47's FP8 KV-cache
quantization (FP8_KV_CFG) of the same tiny models, the expected numbers of mdist::quant's
`--kv-cache fp8` (tests/quant/ptq_test.cpp, tests/cli/quantize_cli_test.cpp).

The environment (modelopt is never a run-time dependency of mdist): see make_fixtures.py.
  /work/venv-quant/bin/python tests/quant/make_kv_fixtures.py        (after make_ptq_fixtures.py)

For ptq_llama and ptq_qwen3 (fp32) it loads the checkpoint and the calibration / held-out
batches make_ptq_fixtures.py wrote (config.json, model.safetensors, expected.safetensors), and
for each model preset (fp8, int8, int8_sq) merges FP8_KV_CFG into it as hf_ptq.py does,
    cfg = mtq.utils.update_quant_cfg_with_kv_cache_quant(PRESET, mtq.FP8_KV_CFG["quant_cfg"])
(the `*[kv]_bmm_quantizer` rule appended last), then runs modelopt's own
    mtq.quantize(model, cfg, lambda m: [m(input_ids=b) for b in calib])
and writes ptq_<arch>/expected_kv.safetensors with make_ptq_fixtures.py's keys under the
presets "<preset>_kv" (loss, every `_amax` including
model.layers.N.self_attn.k_bmm_quantizer._amax / v_bmm_quantizer._amax, pre_quant_scales,
enabled flags with the quantizers' names and parent classes in the metadata), and
ptq_<arch>/export_<preset>_kv/: modelopt's export_hf_checkpoint of that model (k_proj.k_scale,
v_proj.v_scale, kv_cache_quant_algo FP8; generation_config.json dropped).
"""

import pathlib

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import modelopt.torch.quantization as mtq
from modelopt.torch.export import export_hf_checkpoint
from modelopt.torch.quantization.nn import QuantModuleRegistry, TensorQuantizer

HERE = pathlib.Path(__file__).resolve().parent / "fixtures"
PRESETS = {"fp8": mtq.FP8_DEFAULT_CFG, "int8": mtq.INT8_DEFAULT_CFG,
           "int8_sq": mtq.INT8_SMOOTHQUANT_CFG}


def parent_class(module):
    for registered in ("nn.Linear", "nn.Embedding"):
        if isinstance(module, QuantModuleRegistry[registered]):
            return registered
    return "other"


def load(out_dir):
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    return model.eval()


def write(arch):
    out_dir = HERE / f"ptq_{arch}"
    base = load_file(str(out_dir / "expected.safetensors"))
    calib, eval_ids = base["calib"], base["eval_ids"]
    tensors = {}
    metadata = {"producer": "modelopt 0.47.0, tests/quant/make_kv_fixtures.py",
                "transformers": transformers.__version__}
    for preset, preset_cfg in PRESETS.items():
        name = f"{preset}_kv"
        cfg = mtq.utils.update_quant_cfg_with_kv_cache_quant(preset_cfg, mtq.FP8_KV_CFG["quant_cfg"])
        model = load(out_dir)
        with torch.no_grad():
            unquantized = model(input_ids=eval_ids, labels=eval_ids).loss.float()
        assert torch.equal(unquantized, base["loss"]), "the checkpoint is not the fixture's model"
        mtq.quantize(model, cfg, lambda m: [m(input_ids=b) for b in calib])
        with torch.no_grad():
            loss = model(input_ids=eval_ids, labels=eval_ids).loss.float()
        tensors[f"{name}.loss"] = loss
        names, enabled, parents = [], [], []
        for qname, module in model.named_modules():
            if isinstance(module, TensorQuantizer):
                names.append(qname)
                enabled.append(int(module.is_enabled))
                parents.append(parent_class(model.get_submodule(qname.rpartition(".")[0])))
        metadata[f"{name}.parents"] = ",".join(parents)
        metadata[f"{name}.quantizers"] = ",".join(names)
        tensors[f"{name}.enabled"] = torch.tensor(enabled, dtype=torch.int64)
        # Copies: the export rewrites some buffers in place (see make_ptq_fixtures.py).
        for key, value in model.state_dict().items():
            if key.endswith("._amax"):
                tensors[f"{name}.{key}"] = value.clone().float()
            elif key.endswith("._pre_quant_scale"):
                tensors[f"{name}.{key}"] = value.clone()
        export_dir = out_dir / f"export_{name}"
        export_hf_checkpoint(model, dtype=torch.float32, export_dir=str(export_dir))
        (export_dir / "generation_config.json").unlink(missing_ok=True)
        kv = [k for k in tensors if k.startswith(name) and "_bmm_quantizer" in k]
        print(arch, name, "loss", base["loss"].item(), "->", loss.item(), len(kv), "k/v amax")
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(out_dir / "expected_kv.safetensors"), metadata=metadata)


for arch in ("llama", "qwen3"):
    write(arch)
