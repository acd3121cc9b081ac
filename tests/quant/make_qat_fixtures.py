#!/usr/bin/env python3
"""Writes tests/quant/fixtures/qat_*/expected*.safetensors: modelopt 0.47's quantization-aware
training (QAT) of the tiny models of fixtures/ptq_llama (fp32, biases, tied head), ptq_qwen3
(GQA, q/k norms, untied head) and awq_llama (hidden 128, for INT4's blocks of 128), the expected
numbers of `mdist train --quant` (tests/cli/qat_cli_test.cpp); see OUTPUTS for which cases go
where. NVFP4's forward runs on nvfp4_kernel_reference.py (modelopt's kernel is CUDA only).

The environment (modelopt is never a run-time dependency of mdist): see make_fixtures.py.
  /work/venv-quant/bin/python tests/quant/make_qat_fixtures.py [qat_llama qat_qwen3 ...]

The recipe is modelopt's examples/llm_qat reduced to a plain loop (its simple_qat_train.py):
  mtq.quantize(model, CFG, calibration loop)   # insert quantizers, max calibration, amax frozen
  then ordinary training of the fake-quantized model,
with mdist train's optimizer and schedule mirrored exactly (src/cli/train.cpp,
include/mdist/train/lr_schedule.h): AdamW betas (0.9, 0.95), eps 1e-8, decoupled weight decay
on matrices only (dim >= 2), linear warm-up over `warmup` steps then cosine decay to
min_lr_ratio * lr at the last step, global-norm gradient clipping, the mean token cross entropy
of the whole global batch per step.

Data: `train_ids` int64 [WINDOWS, T], the training file's windows in file order (the test writes
them as a .u32 token file). Calibration: the first CALIB windows, one sequence per forward (what
`mdist train --quant --calib-sequences CALIB` does by default). Step s (1-based) trains on
sequences k = (s-1)*B .. s*B-1 of the run, window order[k] of mdist's seeded epoch order
(src/cli/token_data.cpp: Fisher-Yates driven by std::mt19937_64 seeded with
seed * 0x9E3779B97F4A7C15 + epoch, reproduced here).

Per case "<format>" (FP8_DEFAULT_CFG, INT8_DEFAULT_CFG, INT4_AWQ_CFG, NVFP4_DEFAULT_CFG;
modelopt's default pass_through_bwd), "<format>_kv" (FP8_KV_CFG merged in) and
"<format>_clipped" (the same config with pass_through_bwd False: the clipped STE):
  <case>.losses     f64 [STEPS]: each step's loss (before its update)
  <case>.<param>    f32: every parameter after the last step, HF names (tied head once)
  <case>.<quantizer>._amax   the calibrated amax (frozen through training)
  <case>.<quantizer>._pre_quant_scale   AWQ's input scale (its 1/s folded into the weight
                                        before training, as modelopt folds it)
The cases of EXPORTED also write export_<case>/ beside their file: modelopt's
export_hf_checkpoint of the trained fake-quantized model right after its last step (fp32;
model.safetensors, config.json, hf_quant_config.json; generation_config.json dropped, as mdist
writes none), the unified checkpoint `mdist train --quant F --export-quantized` must equal
(tests/cli/qat_export_cli_test.cpp). modelopt's export is pure torch: NVFP4's runs on CPU.
"""

import copy
import math
import pathlib
import sys

import torch
import transformers
from safetensors.torch import save_file

import modelopt.torch.quantization as mtq
from modelopt.torch.export import export_hf_checkpoint
from modelopt.torch.quantization import tensor_quant

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from nvfp4_kernel_reference import fp4_kernel_reference  # noqa: E402

# NVFP4's fake quant has only a CUDA kernel in modelopt: its forward runs on the pure-torch copy
# of that kernel's math (as make_ptq_fixtures.py); the backward stays modelopt's own STE
# (DynamicBlockQuantizationFunction calls the op inside its autograd forward).
tensor_quant.dynamic_block_quantize_op = fp4_kernel_reference

HERE = pathlib.Path(__file__).resolve().parent / "fixtures"
MODEL = HERE / "ptq_llama"
OUT = HERE / "qat_llama"

T = 16           # --seq-len
WINDOWS = 24     # windows in the training file (more than one epoch's worth is not needed)
CALIB = 6        # --calib-sequences
STEPS = 5        # --steps
BATCH = 4        # --global-batch
LR = 1e-3        # --lr
WARMUP = 2       # --warmup
MIN_LR_RATIO = 0.1
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
SEED = 3         # --seed (the data order; the model comes from MODEL)

MASK64 = (1 << 64) - 1


class MT19937_64:
    """std::mt19937_64 (C++11's parameters)."""

    def __init__(self, seed):
        self.mt = [0] * 312
        self.mt[0] = seed & MASK64
        for i in range(1, 312):
            prev = self.mt[i - 1]
            self.mt[i] = (6364136223846793005 * (prev ^ (prev >> 62)) + i) & MASK64
        self.index = 312

    def __call__(self):
        if self.index >= 312:
            for i in range(312):
                x = (self.mt[i] & 0xFFFFFFFF80000000) | (self.mt[(i + 1) % 312] & 0x7FFFFFFF)
                xa = x >> 1
                if x & 1:
                    xa ^= 0xB5026F5AA96619E9
                self.mt[i] = self.mt[(i + 156) % 312] ^ xa
            self.index = 0
        y = self.mt[self.index]
        self.index += 1
        y ^= (y >> 29) & 0x5555555555555555
        y ^= (y << 17) & 0x71D67FFFEDA60000
        y ^= (y << 37) & 0xFFF7EEE000000000
        y ^= y >> 43
        return y & MASK64


def check_mt19937_64():
    rng = MT19937_64(5489)
    for _ in range(9999):
        rng()
    assert rng() == 9981545732273789042, "mt19937_64 does not match the C++ standard's check value"


def epoch_order(count, seed, epoch):
    """mdist's WindowOrder::shuffle_epoch."""
    rng = MT19937_64((seed * 0x9E3779B97F4A7C15 + epoch) & MASK64)
    perm = list(range(count))
    for i in range(count - 1, 0, -1):
        j = rng() % (i + 1)
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def window_of(k, count, seed):
    epoch, at = divmod(k, count)
    return epoch_order(count, seed, epoch)[at]


def lr_at(step):
    """mdist's schedule, `step` 1-based."""
    min_lr = MIN_LR_RATIO * LR
    if WARMUP > 0 and step <= WARMUP:
        return LR * step / WARMUP
    progress = min(1.0, max(0.0, (step - WARMUP) / max(1, STEPS - WARMUP)))
    return min_lr + (LR - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def per_expert(name, value):
    """A parameter under the names save_pretrained writes (mdist's checkpoint names): transformers
    5's fused experts `experts.gate_up_proj` [E, 2I, H] (each expert's gate rows, then its up
    rows) and `experts.down_proj` [E, H, I] as `experts.E.{gate,up,down}_proj.weight`."""
    if name.endswith(".experts.gate_up_proj"):
        block = name[: -len("gate_up_proj")]
        out = {}
        for e, w in enumerate(value):
            gate, up = w.chunk(2, dim=0)
            out[f"{block}{e}.gate_proj.weight"] = gate.contiguous()
            out[f"{block}{e}.up_proj.weight"] = up.contiguous()
        return out
    if name.endswith(".experts.down_proj"):
        block = name[: -len("down_proj")]
        return {f"{block}{e}.down_proj.weight": w.contiguous() for e, w in enumerate(value)}
    return {name: value.contiguous()}


PRESETS = {"fp8": mtq.FP8_DEFAULT_CFG, "int8": mtq.INT8_DEFAULT_CFG,
           "int4_awq": mtq.INT4_AWQ_CFG, "nvfp4": mtq.NVFP4_DEFAULT_CFG}


def config_for(case):
    """"<preset>[_kv][_clipped]": the preset, FP8_KV_CFG merged in as hf_ptq.py does (_kv), the
    clipped STE (_clipped)."""
    preset = next(p for p in sorted(PRESETS, key=len, reverse=True) if case.startswith(p))
    cfg = copy.deepcopy(PRESETS[preset])
    if "_kv" in case:
        cfg = mtq.utils.update_quant_cfg_with_kv_cache_quant(cfg, mtq.FP8_KV_CFG["quant_cfg"])
    if case.endswith("_clipped"):
        for rule in cfg["quant_cfg"]:
            if "cfg" in rule:
                rule["cfg"]["pass_through_bwd"] = False
    return cfg


# The cases whose trained model is also exported (fp8 and int8 exports are checked against
# mdist's own export of the run's checkpoint: their arithmetic is PTQ's, tested there).
EXPORTED = ("int4_awq", "nvfp4", "fp8_kv")


def run(case, train_ids, model_dir=MODEL, export_dir=None):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    calib = [train_ids[i : i + 1] for i in range(CALIB)]

    def loop(m):
        with torch.no_grad():
            for ids in calib:
                m(input_ids=ids)

    mtq.quantize(model, config_for(case), loop)
    # The quantizers' state: amax, and AWQ's pre_quant_scale (its weights are folded already).
    amax = {k: v.detach().clone() for k, v in model.state_dict().items()
            if k.endswith("._amax") or k.endswith("._pre_quant_scale")}
    params = [(n, p) for n, p in model.named_parameters()]
    matrices = [p for _, p in params if p.dim() >= 2]
    vectors = [p for _, p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": WEIGHT_DECAY},
         {"params": vectors, "weight_decay": 0.0}],
        lr=LR, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for step in range(1, STEPS + 1):
        rows = [window_of(k, WINDOWS, SEED) for k in range((step - 1) * BATCH, step * BATCH)]
        ids = train_ids[rows]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        losses.append(loss.item())
    after = {}
    for n, p in params:
        after.update(per_expert(n, p.detach().clone()))
    # The amax stays frozen through training (modelopt's QAT): checked, not assumed.
    for k, v in model.state_dict().items():
        if k in amax:
            assert torch.equal(v, amax[k]), k
    if export_dir is not None:
        # After the parameters are copied out: the export folds AWQ's scales into the norms of
        # the model it is given.
        model.config.architectures = [type(model).__name__]
        export_hf_checkpoint(model, dtype=torch.float32, export_dir=str(export_dir))
        (export_dir / "generation_config.json").unlink(missing_ok=True)
    return losses, after, amax


# (model, output file, cases): every file has the same layout and its own train_ids.
OUTPUTS = [
    (MODEL, OUT / "expected.safetensors", ("fp8", "int8", "fp8_clipped", "int8_clipped")),
    # NVFP4 (global amax calibrated, dynamic E2M1 blocks of 16) and FP8 with the FP8 KV cache.
    (MODEL, OUT / "expected_formats.safetensors", ("nvfp4", "fp8_kv")),
    # Qwen3: GQA, q/k norms, an untied (unquantized) lm_head.
    (HERE / "ptq_qwen3", HERE / "qat_qwen3" / "expected.safetensors", ("fp8", "int8")),
    # INT4 AWQ needs in_features in whole blocks of 128: awq_llama (hidden 128).
    (HERE / "awq_llama", HERE / "qat_awq_llama" / "expected.safetensors", ("int4_awq",)),
    # Qwen3-MoE (make_ptq_moe_fixtures.py's): transformers 5's fused experts, which modelopt
    # quantizes with one input quantizer per fused projection shared by the block's experts and
    # a weight quantizer per expert; the gradients reach every expert through the shared ones.
    # Its config's output_router_logits is false: the loss is the cross entropy alone, as
    # mdist train's default (no load-balancing term).
    (HERE / "ptq_qwen3_moe", HERE / "qat_qwen3_moe" / "expected.safetensors", ("fp8", "int8")),
]


def main():
    check_mt19937_64()
    only = set(sys.argv[1:])  # output directory names to write (default: all)
    for model_dir, out, cases in OUTPUTS:
        if only and out.parent.name not in only:
            continue
        torch.manual_seed(0)
        vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
        gen = torch.Generator().manual_seed(11)
        train_ids = torch.randint(0, vocab, (WINDOWS, T), generator=gen)
        tensors = {"train_ids": train_ids}
        for case in cases:
            export_dir = out.parent / f"export_{case}" if case in EXPORTED else None
            losses, after, amax = run(case, train_ids, model_dir, export_dir)
            print(out.parent.name, case, "losses", losses)
            tensors[f"{case}.losses"] = torch.tensor(losses, dtype=torch.float64)
            for name, value in after.items():
                tensors[f"{case}.{name}"] = value
            for name, value in amax.items():
                tensors[f"{case}.{name}"] = value.contiguous()
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, out)


if __name__ == "__main__":
    main()
