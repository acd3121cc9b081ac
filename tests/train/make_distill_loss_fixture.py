#!/usr/bin/env python3
"""Writes tests/train/fixtures/distill_loss.safetensors: modelopt 0.47's knowledge-distillation
loss on random logits, the expected numbers of tests/train/distill_loss_test.cpp.

The loss is what modelopt's QAD trains on: LogitsDistillationLoss(temperature, reduction="none")
(modelopt/torch/distill/losses.py) per token, reduced as its Hugging Face plugin's
_standard_kd_loss does: sum over the tokens whose label is not -100 / max(their count, 1). The
logits are already shifted (the test passes [N, V] and labels [N]).

  /work/venv-quant/bin/python tests/train/make_distill_loss_fixture.py

Per case "<name>": <name>.student, <name>.teacher f32 [N, V]; <name>.labels i64 [N];
<name>.temperature f64 [1]; <name>.loss f64 []; <name>.grad f32 [N, V] (d loss / d student).
"""

import pathlib

import torch
from safetensors.torch import save_file

from modelopt.torch.distill.losses import LogitsDistillationLoss

OUT = pathlib.Path(__file__).resolve().parent / "fixtures" / "distill_loss.safetensors"
N, V = 13, 60  # V divisible by 1, 2, 3 and 4 ranks


def reduce_like_modelopt(per_token, labels):
    mask = labels != -100
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def case(name, temperature, scale, ignored, gen, tensors):
    student = (torch.randn(N, V, generator=gen) * scale).requires_grad_(True)
    # A teacher close to the student (the distillation of a quantized copy) plus noise.
    teacher = student.detach() + torch.randn(N, V, generator=gen) * 0.5 * scale
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[ignored] = -100
    per_token = LogitsDistillationLoss(temperature, reduction="none")(student, teacher)
    loss = reduce_like_modelopt(per_token, labels)
    loss.backward()
    tensors[f"{name}.student"] = student.detach().contiguous()
    tensors[f"{name}.teacher"] = teacher.contiguous()
    tensors[f"{name}.labels"] = labels
    tensors[f"{name}.temperature"] = torch.tensor([temperature], dtype=torch.float64)
    tensors[f"{name}.loss"] = loss.detach().to(torch.float64)
    tensors[f"{name}.grad"] = student.grad.contiguous()
    print(name, loss.item())


def main():
    gen = torch.Generator().manual_seed(29)
    tensors = {}
    case("t1", 1.0, 2.0, [0, 5, 6], gen, tensors)
    case("t2", 2.0, 3.0, [3], gen, tensors)
    case("t05", 0.5, 1.0, [], gen, tensors)
    case("large", 1.0, 30.0, [12], gen, tensors)  # logits of tens: stable exponents needed
    case("all_ignored", 1.5, 1.0, list(range(N)), gen, tensors)  # 0, no NaN (modelopt's clamp)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, OUT)


if __name__ == "__main__":
    main()
