#!/usr/bin/env python3
"""Writes tests/quant/fixtures/qad_llama/: the expected numbers of `mdist train --teacher`
(tests/cli/qad_cli_test.cpp), modelopt 0.47's quantization-aware distillation (QAD) and plain
distillation of the tiny Llama of fixtures/ptq_llama.

  /work/venv-quant/bin/python tests/quant/make_qad_fixtures.py

The recipe is modelopt's QAD (examples/llm_qat with --distill, QADTrainer) reduced to a plain
loop, on make_qat_fixtures.py's data, data order, optimizer, schedule and clipping (imported from
it): mtq.quantize(student, CFG, calibration loop) when the case quantizes, then per step
  student logits (train mode); teacher logits under no_grad in eval mode (the teacher is never
  quantized or trained);
  kd = LogitsDistillationLoss(T, reduction="none") on logits[..., :-1, :].float() of both,
       reduced as modelopt's _standard_kd_loss: sum over tokens whose label (ids[..., 1:]) is not
       -100 / max(count, 1);
  ce = the student's causal-LM cross entropy;
  objective = kd + W * ce (W = 0: kd alone, modelopt's QAD).

Writes:
  teacher_wide/          a Llama of the same vocabulary, wider and deeper than the student
                         (hidden 40, 3 layers, untied head), seeded weights: the "other size"
  teacher_vocab96/       a tiny Llama of another vocabulary (96): what --teacher must refuse
  expected.safetensors   train_ids (as make_qat_fixtures.py) and per case:
    <case>.losses, <case>.kd_loss, <case>.cross_entropy   f64 [STEPS]
    <case>.<param>                                         f32, every student parameter after
                                                           the last step (HF names)
Cases (name: quant, teacher, T, W):
  qad_fp8:        fp8,  ptq_llama itself (the pre-quantization model), 1.0, 0
  qad_int8_wide:  int8, teacher_wide,                                  2.0, 0.5
  kd_wide:        none, teacher_wide,                                  1.5, 0
"""

import pathlib
import sys

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

import modelopt.torch.quantization as mtq
from modelopt.torch.distill.losses import LogitsDistillationLoss

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import make_qat_fixtures as qat  # noqa: E402  (data, order, schedule, calibration constants)

HERE = pathlib.Path(__file__).resolve().parent / "fixtures"
OUT = HERE / "qad_llama"
WIDE = OUT / "teacher_wide"
OTHER_VOCAB = OUT / "teacher_vocab96"

CASES = {
    "qad_fp8": ("fp8", qat.MODEL, 1.0, 0.0),
    "qad_int8_wide": ("int8", WIDE, 2.0, 0.5),
    "kd_wide": (None, WIDE, 1.5, 0.0),
}


def write_wide_teacher():
    config = transformers.LlamaConfig(
        vocab_size=transformers.AutoConfig.from_pretrained(qat.MODEL).vocab_size,
        hidden_size=40, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=10, max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attention_bias=False, initializer_range=0.2)
    torch.manual_seed(7)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(WIDE)
    small = transformers.LlamaConfig(
        vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    transformers.LlamaForCausalLM(small).to(torch.float32).save_pretrained(OTHER_VOCAB)


def kd_loss(student_logits, teacher_logits, labels, temperature):
    """modelopt's _standard_kd_loss with LogitsDistillationLoss(temperature, "none")."""
    s = student_logits[..., :-1, :].float()
    t = teacher_logits[..., :-1, :].float()
    per_token = LogitsDistillationLoss(temperature, reduction="none")(s, t)
    mask = labels[..., 1:] != -100
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def run(case, train_ids):
    quant, teacher_dir, temperature, weight = CASES[case]
    model = transformers.AutoModelForCausalLM.from_pretrained(qat.MODEL, dtype=torch.float32)
    model.train()
    if quant:
        calib = [train_ids[i : i + 1] for i in range(qat.CALIB)]

        def loop(m):
            with torch.no_grad():
                for ids in calib:
                    m(input_ids=ids)

        mtq.quantize(model, qat.config_for(quant), loop)
    teacher = transformers.AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    teacher.eval()
    params = [(n, p) for n, p in model.named_parameters()]
    matrices = [p for _, p in params if p.dim() >= 2]
    vectors = [p for _, p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": qat.WEIGHT_DECAY},
         {"params": vectors, "weight_decay": 0.0}],
        lr=qat.LR, betas=(0.9, 0.95), eps=1e-8)
    losses, kds, ces = [], [], []
    for step in range(1, qat.STEPS + 1):
        rows = [qat.window_of(k, qat.WINDOWS, qat.SEED)
                for k in range((step - 1) * qat.BATCH, step * qat.BATCH)]
        ids = train_ids[rows]
        for group in optimizer.param_groups:
            group["lr"] = qat.lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
        with torch.no_grad():
            teacher_logits = teacher(input_ids=ids).logits
        kd = kd_loss(logits, teacher_logits, ids, temperature)
        ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(),
                             ids[:, 1:].reshape(-1))
        loss = kd + weight * ce if weight > 0 else kd
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), qat.GRAD_CLIP)
        optimizer.step()
        losses.append(loss.item())
        kds.append(kd.item())
        ces.append(ce.item())
    after = {n: p.detach().clone().contiguous() for n, p in params}
    return losses, kds, ces, after


def main():
    qat.check_mt19937_64()
    OUT.mkdir(parents=True, exist_ok=True)
    write_wide_teacher()
    torch.manual_seed(0)
    vocab = transformers.AutoConfig.from_pretrained(qat.MODEL).vocab_size
    gen = torch.Generator().manual_seed(11)
    train_ids = torch.randint(0, vocab, (qat.WINDOWS, qat.T), generator=gen)
    tensors = {"train_ids": train_ids}
    for case in CASES:
        losses, kds, ces, after = run(case, train_ids)
        print(case, "losses", losses, "kd", kds, "ce", ces)
        tensors[f"{case}.losses"] = torch.tensor(losses, dtype=torch.float64)
        tensors[f"{case}.kd_loss"] = torch.tensor(kds, dtype=torch.float64)
        tensors[f"{case}.cross_entropy"] = torch.tensor(ces, dtype=torch.float64)
        for name, value in after.items():
            tensors[f"{case}.{name}"] = value
    save_file(tensors, OUT / "expected.safetensors")


if __name__ == "__main__":
    main()
