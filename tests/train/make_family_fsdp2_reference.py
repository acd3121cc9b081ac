"""PyTorch FSDP2 references for mdist's training of the newer families
(tests/train/accumulation_test.cpp, Accumulation.FamiliesEqualPyTorchFsdp2OnTwoRanks): one
tiny transformers model of FAMILY (tests/hf_model/fixtures/FAMILY/config.json: phi3, olmo2,
gemma2, gemma3) trained for 3 steps on 2 ranks with torch's own fully_shard (each decoder layer,
then the root), the global batch split over the ranks, AdamW with mdist's warm-up and cosine
schedule, decay on matrices only, and clipping. Sequences of 24 tokens: beyond Phi-3's
original_max_position_embeddings 16 (the long factors) and Gemma's window 5. Writes into OUT_DIR:
  config.json, model.safetensors  the initial weights (transformers' own initialisation)
  data.safetensors                ids, labels, attention_mask [N, T] (every token real)
  expected.safetensors            every parameter after the last step (full tensors)
  expected.json                   per step: loss, grad_norm (before clipping), lr; the settings
Run (bench venv: torch 2.15, transformers 5.24, safetensors), once per family:
  torchrun --nproc-per-node 2 tests/train/make_family_fsdp2_reference.py \
      phi3 tests/train/fixtures/family_fsdp2/phi3
"""
import json
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

STEPS = 3
SEQ_LEN = 24
PER_RANK = 2  # sequences per data-parallel rank per step
PEAK_LR, WARMUP, MIN_RATIO = 1e-3, 1, 0.1
WEIGHT_DECAY, GRAD_CLIP = 0.1, 1.0
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "hf_model", "fixtures")
# Gemma 2's soft-capping needs eager attention (sdpa has no hook for it), as mdist runs it.
ATTENTION = {"phi3": "sdpa", "olmo2": "sdpa", "gemma2": "eager", "gemma3": "sdpa"}


def lr_at(step):
    """mdist::train::LrSchedule::at (1-based step): linear warm-up, cosine to MIN_RATIO * peak."""
    if WARMUP > 0 and step <= WARMUP:
        return PEAK_LR * step / WARMUP
    decay = max(1, STEPS - WARMUP)
    progress = min(max((step - WARMUP) / decay, 0.0), 1.0)
    floor = PEAK_LR * MIN_RATIO
    return floor + (PEAK_LR - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def loss_sum(logits, labels):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(),
                           labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum")


def main():
    family, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    config = AutoConfig.from_pretrained(os.path.join(FIXTURES, family))
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION[family]).float()
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, config.vocab_size, (STEPS * world * PER_RANK, SEQ_LEN),
                        generator=generator)
    mask = torch.ones_like(ids)
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        model.save_pretrained(out)  # config.json + model.safetensors, before any update
        save_file({"ids": ids, "labels": ids.clone(), "attention_mask": mask},
                  os.path.join(out, "data.safetensors"))
    dist.barrier()

    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=PEAK_LR, betas=(0.9, 0.95), eps=1e-8)

    steps = []
    for step in range(1, STEPS + 1):
        first = (step - 1) * world * PER_RANK
        global_tokens = world * PER_RANK * (SEQ_LEN - 1)
        mine = slice(first + rank * PER_RANK, first + (rank + 1) * PER_RANK)
        logits = model(input_ids=ids[mine], attention_mask=mask[mine]).logits
        summed = loss_sum(logits, ids[mine])
        # FSDP averages the gradients over the ranks: x world undoes it.
        (summed * (world / global_tokens)).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.step()
        optimizer.zero_grad()
        total = summed.detach().double()
        dist.all_reduce(total)
        steps.append({"step": step, "loss": float(total) / global_tokens,
                      "grad_norm": float(grad_norm), "lr": lr_at(step)})

    weights = {name: p.full_tensor().contiguous() for name, p in model.named_parameters()}
    if rank == 0:
        save_file(weights, os.path.join(out, "expected.safetensors"))
        settings = {"family": family, "ranks": world, "steps": STEPS, "seq_len": SEQ_LEN,
                    "per_rank": PER_RANK, "peak_lr": PEAK_LR, "warmup": WARMUP,
                    "min_ratio": MIN_RATIO, "weight_decay": WEIGHT_DECAY,
                    "grad_clip": GRAD_CLIP, "attention": ATTENTION[family],
                    "torch": torch.__version__}
        with open(os.path.join(out, "expected.json"), "w") as f:
            json.dump({"settings": settings, "steps": steps}, f, indent=1)
            f.write("\n")
        print(family, json.dumps(steps))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
