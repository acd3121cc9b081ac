#!/usr/bin/env python3
"""Writes tests/hf/fixtures/hf_official.safetensors with the official safetensors library.

Run once with a Python that has torch and safetensors (e.g. the bench venv:
~/.cache/mdist/bench-venv/bin/pip install safetensors); the output is committed, and
safetensors_test checks that mdist reads it bit-exactly. Values are arange-based, so the
test knows them without Python.
"""
import pathlib

import torch
from safetensors.torch import save_file

out = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf_official.safetensors"
out.parent.mkdir(parents=True, exist_ok=True)
tensors = {
    "f32": torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) * 0.5,
    "f16": torch.arange(6, dtype=torch.float16).reshape(3, 2) - 2,
    "bf16": torch.arange(5, dtype=torch.bfloat16) * 0.25,
    "f64": torch.arange(4, dtype=torch.float64) / 3,
    "i64": torch.arange(-3, 4, dtype=torch.int64),
    "i32": torch.arange(10, dtype=torch.int32).reshape(5, 2),
    "i16": torch.arange(-2, 2, dtype=torch.int16),
    "i8": torch.arange(-4, 4, dtype=torch.int8),
    "u8": torch.arange(250, 256, dtype=torch.uint8),
    "bool": torch.arange(5) % 2 == 0,
    "scalar": torch.tensor(7.0, dtype=torch.float32),
    "empty": torch.zeros(0, 3, dtype=torch.float32),
}
save_file(tensors, str(out), metadata={"format": "pt", "source": "mdist fixture"})
print(out, out.stat().st_size, "bytes")
