#!/usr/bin/env python3
"""Writes tests/quant/fixtures/qat_llama/expected_bf16.safetensors: modelopt 0.47's
quantization-aware training of the fp32 Llama of fixtures/ptq_llama under torch FSDP2 with
MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32), what
`mdist train --quant F --param-dtype bf16` does (tests/cli/qat_cli_test.cpp's Bf16 tests).

The environment (modelopt is never a run-time dependency of mdist): see make_fixtures.py.
  /root/.cache/mdist/bench-venv/bin/python tests/quant/make_qat_bf16_fixtures.py

The recipe is make_qat_fixtures.py's (same model, data, data order, AdamW, schedule, clipping;
its helpers are imported), with the model wrapped first as modelopt's QATTrainer finds it
(accelerate's FSDP2, bf16 mixed precision): fully_shard on each decoder layer, then on the root,
in one process (a gloo group of one rank), then mtq.quantize on the wrapped model, then training.
So, as in modelopt:
  - calibration: max_calibrate's weight_only_quantize first gathers each weight whole from its
    fp32 shards (fsdp2_weight_access_and_writeback_context: DTensor.redistribute to Replicate),
    so the weight quantizer collects max |W| of the fp32 master; the forward loop's Linears then
    see FSDP2's bf16 gathered weight and collect again: the weight amax is the max of both,
    kept in fp32 (torch.max promotes); the input quantizers see bf16 activations only, their
    amax stays bf16;
  - training: every forward fake-quantizes the bf16 gathered weight and the bf16 inputs
    (computed in fp32, cast back to bf16); gradients flow back in bf16 and are reduce-scattered
    in fp32 onto the fp32 master shards that AdamW steps.
The script checks those claims on the calibrated quantizers and prints what it found (the
dtypes, and how many weight amaxes come from the fp32 master and how many from the bf16 copy).

Per case "<format>" (FP8_DEFAULT_CFG, INT8_DEFAULT_CFG, NVFP4_DEFAULT_CFG; modelopt's default
pass_through_bwd), "<format>_clipped" (pass_through_bwd False) and "plain" (no mtq.quantize: the
same training without quantization, `mdist train --param-dtype bf16`, which separates the bf16
forward's share of a gap from the quantization's):
  <case>.losses                f64 [STEPS]: each step's loss (before its update)
  <case>.<param>               f32: every parameter (the fp32 master) after the last step
  <case>.<quantizer>._amax     the calibrated amax in modelopt's dtype (frozen through training)
  train_ids                    int64 [WINDOWS, T] (make_qat_fixtures.py's, the same seed)
"""

import os
import pathlib
import sys

import torch
import torch.distributed as dist
import transformers
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import modelopt.torch.quantization as mtq
from modelopt.torch.quantization.nn import TensorQuantizer

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import make_qat_fixtures as qat  # noqa: E402  (also rebinds NVFP4's kernel to the CPU reference)

OUT = qat.OUT / "expected_bf16.safetensors"
CASES = ("fp8", "int8", "int8_clipped", "nvfp4", "plain")


def weight_amax(w, per_row):
    a = w.abs()
    return a.amax(dim=1, keepdim=True) if per_row else a.max()


def check_calibration(model, masters):
    """The amax modelopt calibrated on the wrapped model, against max |W| of the fp32 master and
    of its bf16 copy: returns (from the master, from the bf16 copy, equal in both) counts."""
    counts = [0, 0, 0]
    for name, module in model.named_modules():
        if not isinstance(module, TensorQuantizer) or not module.is_enabled:
            continue
        amax = getattr(module, "_amax", None)
        if amax is None:
            continue
        if name.endswith("input_quantizer"):
            assert amax.dtype == torch.bfloat16, (name, amax.dtype)
            continue
        assert name.endswith("weight_quantizer"), name
        assert amax.dtype == torch.float32, (name, amax.dtype)
        w = masters[name[: -len(".weight_quantizer")] + ".weight"]
        per_row = amax.dim() == 2 and amax.shape[0] == w.shape[0] and amax.shape[0] > 1
        fp32 = weight_amax(w, per_row)
        bf16 = weight_amax(w.to(torch.bfloat16), per_row).float()
        assert torch.equal(amax, torch.maximum(fp32, bf16)), name
        counts[0] += int(torch.equal(amax, fp32) and not torch.equal(amax, bf16))
        counts[1] += int(torch.equal(amax, bf16) and not torch.equal(amax, fp32))
        counts[2] += int(torch.equal(amax, fp32) and torch.equal(amax, bf16))
    return counts


def run(case, train_ids, mesh):
    model = transformers.AutoModelForCausalLM.from_pretrained(qat.MODEL, dtype=torch.float32)
    model.train()
    masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    calib = [train_ids[i : i + 1] for i in range(qat.CALIB)]

    def loop(m):
        with torch.no_grad():
            for ids in calib:
                m(input_ids=ids)

    if case != "plain":
        mtq.quantize(model, qat.config_for(case), loop)
        counts = check_calibration(model, masters)
        print(case, "weight amax from the fp32 master / the bf16 copy / both equal:", counts)
    amax = {k: v.detach().clone() for k, v in model.state_dict().items() if k.endswith("._amax")}
    params = list(model.named_parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for _, p in params if p.dim() >= 2], "weight_decay": qat.WEIGHT_DECAY},
         {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=qat.LR, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for step in range(1, qat.STEPS + 1):
        rows = [qat.window_of(k, qat.WINDOWS, qat.SEED)
                for k in range((step - 1) * qat.BATCH, step * qat.BATCH)]
        ids = train_ids[rows]
        for group in optimizer.param_groups:
            group["lr"] = qat.lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        assert loss.dtype == torch.float32
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), qat.GRAD_CLIP)
        optimizer.step()
        losses.append(loss.item())
    after = {n: p.full_tensor().detach().clone().contiguous() for n, p in params}
    for n, p in after.items():
        assert p.dtype == torch.float32, n
    for k, v in model.state_dict().items():
        if k in amax:
            assert torch.equal(v, amax[k]), k
    return losses, after, amax


def main():
    qat.check_mt19937_64()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    vocab = transformers.AutoConfig.from_pretrained(qat.MODEL).vocab_size
    gen = torch.Generator().manual_seed(11)
    train_ids = torch.randint(0, vocab, (qat.WINDOWS, qat.T), generator=gen)
    tensors = {"train_ids": train_ids}
    for case in CASES:
        losses, after, amax = run(case, train_ids, mesh)
        print(case, "losses", losses)
        tensors[f"{case}.losses"] = torch.tensor(losses, dtype=torch.float64)
        for name, value in after.items():
            tensors[f"{case}.{name}"] = value
        for name, value in amax.items():
            tensors[f"{case}.{name}"] = value.contiguous()
    save_file(tensors, OUT)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
