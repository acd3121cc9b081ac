#!/usr/bin/env python3
"""Writes tests/quant/fixtures/ptq_<family>/ for the families of tests/hf_model's
make_family_fixtures.py (gemma2, gemma3, phi3, olmo2): modelopt 0.47's FP8 post-training
quantization and export of a tiny model of each, the expected results of `mdist quantize
--format fp8` (tests/cli/quantize_cli_test.cpp, FamiliesMatchModelopt).

    /work/venv-quant/bin/python tests/quant/make_family_ptq_fixtures.py

Each model has the configuration of that family's parity fixture (tests/hf_model/fixtures/<name>:
the same config arguments and attention implementation, fp32) with the weights of
make_ptq_fixtures.py (seed 2024, norms 1 + 0.2 N(0, 1), the rest 0.3 N(0, 1)), saved with
save_pretrained (config.json + model.safetensors). On CPU, a fresh copy goes through
    mtq.quantize(model, mtq.FP8_DEFAULT_CFG, lambda m: [m(input_ids=b) for b in calib])
and export_hf_checkpoint (export_fp8/: model.safetensors, config.json, hf_quant_config.json;
generation_config.json dropped, as mdist writes none). expected.safetensors records, as
make_ptq_fixtures.py does:
  calib      int64 [3, 2, 16]: the calibration batches, in forward order
  eval_ids   int64 [2, 16]: the held-out batch
  loss       f32 []: the unquantized model's loss on eval_ids (labels = eval_ids)
  fp8.loss   f32 []: the fake-quantized model's loss on eval_ids
The 16 tokens stay within Phi-3's original_max_position_embeddings (short factors) and pass
the sliding window (5) of Gemma's sliding layers.
"""

import copy
import pathlib
import sys

import torch
import transformers
from safetensors.torch import save_file

import modelopt.torch.quantization as mtq
from modelopt.torch.export import export_hf_checkpoint

ROOT = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "hf_model"))
from make_family_fixtures import FIXTURES  # noqa: E402
from make_fixtures import COMMON  # noqa: E402

HERE = ROOT / "fixtures"
FAMILIES = ("gemma2", "gemma3", "phi3", "olmo2")
BATCHES, ROWS, T = 3, 2, 16


def build(config_cls, model_cls, extra, attention):
    torch.manual_seed(2024)
    config = config_cls(**{**COMMON, **extra}, architectures=[model_cls.__name__])
    config._attn_implementation = attention
    model = model_cls(config).eval().float()
    with torch.no_grad():  # values large enough that every quantizer's rounding matters
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.3 * torch.randn_like(param))
    return model


def write(family):
    (config_cls, model_cls, extra), options = FIXTURES[family]
    model = build(config_cls, model_cls, extra, options.get("attention", "sdpa"))
    out_dir = HERE / f"ptq_{family}"
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    (out_dir / "generation_config.json").unlink(missing_ok=True)
    gen = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size
    calib = torch.randint(0, vocab, (BATCHES, ROWS, T), generator=gen)
    eval_ids = torch.randint(0, vocab, (ROWS, T), generator=gen)
    tensors = {"calib": calib, "eval_ids": eval_ids}
    with torch.no_grad():
        tensors["loss"] = model(input_ids=eval_ids, labels=eval_ids).loss.float()
    quantized = copy.deepcopy(model)
    mtq.quantize(quantized, mtq.FP8_DEFAULT_CFG, lambda m: [m(input_ids=b) for b in calib])
    with torch.no_grad():
        tensors["fp8.loss"] = quantized(input_ids=eval_ids, labels=eval_ids).loss.float()
    # dtype given: see make_ptq_fixtures.py (transformers 5's config.dtype is a string).
    export_dir = out_dir / "export_fp8"
    export_hf_checkpoint(quantized, dtype=torch.float32, export_dir=str(export_dir))
    (export_dir / "generation_config.json").unlink(missing_ok=True)
    metadata = {"producer": "modelopt 0.47.0, tests/quant/make_family_ptq_fixtures.py",
                "transformers": transformers.__version__}
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(out_dir / "expected.safetensors"), metadata=metadata)
    print(family, "loss", tensors["loss"].item(), "-> fp8", tensors["fp8.loss"].item())


for family in sys.argv[1:] or FAMILIES:
    write(family)
