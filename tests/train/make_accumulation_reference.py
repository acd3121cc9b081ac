"""PyTorch FSDP2 reference for mdist's gradient accumulation (tests/train/accumulation_test.cpp,
Accumulation.EqualsPyTorchFsdp2OnTwoRanks): a tiny transformers Llama trained for a few steps
on 2 ranks with torch's own fully_shard, micro-batches with the gradient sync only on the last,
and the loss normalised as torchtitan does (the sum of the per-token losses over the step's
predicted tokens on every rank and micro-batch, divided by their global count); ragged labels,
right padding and a micro-batch with no predicted token included. Writes into OUT_DIR:
  config.json, model.safetensors  the initial weights (transformers' own initialisation)
  data.safetensors                ids, labels (-100: ignored), attention_mask [N, T]
  expected.safetensors            every parameter after the last step (full tensors)
  expected.json                   per step: loss (mean over the step's predicted tokens),
                                  grad_norm (before clipping), lr; and the run's settings
Run (bench venv: torch 2.15, transformers 5.24, safetensors):
  torchrun --nproc-per-node 2 tests/train/make_accumulation_reference.py \
      tests/train/fixtures/accumulation_fsdp2
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
from transformers import LlamaConfig, LlamaForCausalLM

STEPS = 3
SEQ_LEN = 8
PER_RANK = 4  # sequences per data-parallel rank per step
MICRO = 2  # sequences per forward: PER_RANK / MICRO micro-batches per step
PEAK_LR, WARMUP, MIN_RATIO = 1e-3, 1, 0.1
WEIGHT_DECAY, GRAD_CLIP = 0.1, 1.0
CONFIG = os.path.join(os.path.dirname(__file__), "..", "hf_model", "fixtures", "llama")


def lr_at(step):
    """mdist::train::LrSchedule::at (1-based step): linear warm-up, cosine to MIN_RATIO * peak."""
    if WARMUP > 0 and step <= WARMUP:
        return PEAK_LR * step / WARMUP
    decay = max(1, STEPS - WARMUP)
    progress = min(max((step - WARMUP) / decay, 0.0), 1.0)
    floor = PEAK_LR * MIN_RATIO
    return floor + (PEAK_LR - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_data(count, vocab):
    """Seeded ids; by position p in the stream: the first p % 5 labels ignored (a prompt), right
    padding after SEQ_LEN - p % 3 real tokens (id 0, mask 0, label ignored), and sequences at
    p % 8 in (2, 3) ignored whole: rank 0's second micro-batch of step 1 predicts nothing."""
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (count, SEQ_LEN), generator=generator)
    labels = ids.clone()
    mask = torch.ones_like(ids)
    for p in range(count):
        length = SEQ_LEN - p % 3
        labels[p, : p % 5] = -100
        ids[p, length:] = 0
        labels[p, length:] = -100
        mask[p, length:] = 0
        if p % 8 in (2, 3):
            labels[p] = -100
    return ids, labels, mask


def predicted(labels):
    return int((labels[:, 1:] != -100).sum())


def loss_sum(logits, labels):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(),
                           labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum")


def main():
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    config = LlamaConfig.from_pretrained(CONFIG)
    config.attn_implementation = "sdpa"
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).float()
    ids, labels, mask = make_data(STEPS * world * PER_RANK, config.vocab_size)
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        model.save_pretrained(out)  # config.json + model.safetensors, before any update
        save_file({"ids": ids, "labels": labels, "attention_mask": mask},
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
        global_tokens = predicted(labels[first:first + world * PER_RANK])
        mine = slice(first + rank * PER_RANK, first + (rank + 1) * PER_RANK)
        local_ids, local_labels, local_mask = ids[mine], labels[mine], mask[mine]
        total = torch.zeros((), dtype=torch.float64)
        micro_batches = PER_RANK // MICRO
        for k in range(micro_batches):
            part = slice(k * MICRO, (k + 1) * MICRO)
            model.set_requires_gradient_sync(k == micro_batches - 1)
            logits = model(input_ids=local_ids[part], attention_mask=local_mask[part]).logits
            summed = loss_sum(logits, local_labels[part])
            # FSDP averages the gradients over the ranks: x world undoes it.
            (summed * (world / global_tokens)).backward()
            total += summed.detach().double()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(total)
        steps.append({"step": step, "loss": float(total) / global_tokens,
                      "grad_norm": float(grad_norm), "lr": lr_at(step),
                      "predicted_tokens": global_tokens})

    weights = {name: p.full_tensor().contiguous() for name, p in model.named_parameters()}
    if rank == 0:
        save_file(weights, os.path.join(out, "expected.safetensors"))
        settings = {"ranks": world, "steps": STEPS, "seq_len": SEQ_LEN, "per_rank": PER_RANK,
                    "micro_batch": MICRO, "peak_lr": PEAK_LR, "warmup": WARMUP,
                    "min_ratio": MIN_RATIO, "weight_decay": WEIGHT_DECAY, "grad_clip": GRAD_CLIP,
                    "torch": torch.__version__}
        with open(os.path.join(out, "expected.json"), "w") as f:
            json.dump({"settings": settings, "steps": steps}, f, indent=1)
            f.write("\n")
        print(json.dumps(steps))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
