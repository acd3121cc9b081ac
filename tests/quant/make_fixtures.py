#!/usr/bin/env python3
"""Writes tests/quant/fixtures/tensor_quantizer.safetensors: the expected numbers of
mdist::quant's tensor quantizer, produced by NVIDIA Model Optimizer (modelopt) 0.47.0 itself.

The environment (modelopt is never a run-time dependency of mdist):
  python3 -m venv /work/venv-quant && /work/venv-quant/bin/pip install torch==2.15.0 \
      nvidia-modelopt==0.47.0 transformers==5.24.0 safetensors requests
(modelopt 0.47 imports `requests` without declaring it.)
  /work/venv-quant/bin/python tests/quant/make_fixtures.py

Every case is run through modelopt's own `TensorQuantizer` (or `SequentialQuantizer`) on CPU,
configured as modelopt's presets configure their quantizers, and records: the input, the amax
buffer(s) after modelopt's max calibration (or as set), the forward output and the input
gradient for a seeded output gradient, with the clipped STE (`pass_through_bwd=False`) and with
modelopt's default identity STE (`pass_through_bwd=True`). Names are `CASE.WHAT`; each case
also has `CASE.meta` (an int64 vector, described above `KIND_INT` below) so that the C++ test
knows how modelopt was configured without parsing strings.

NVFP4: modelopt's fake quant for dynamic E2M1 blocks runs only as a Triton/CUDA kernel
(`kernels/quantization/gemm/fp4_kernel_hopper.py`, `fp4_fake_quant_kernel`); on CPU
`_dynamic_block_quantize_impl` asserts that amax is a CUDA tensor. Two sources are used:
  * `nvfp4_qtensor_*`: modelopt's own pure-torch CPU code, `NVFP4QTensor.quantize` followed by
    `NVFP4QTensor.dequantize` (the export path) with the same global scale. Its block-scale rule
    (clamp to [2^-9, 448], 0 -> 1) differs from the kernel's (`min(., 448)`, then a scale below
    1e-5 becomes 1) only for blocks whose scale falls under those floors, so these cases keep
    every block above them; the script asserts that the kernel transcription below agrees.
  * every other NVFP4 case: `TensorQuantizer.forward` (calibration, order of operations, the
    STE) with `tensor_quant.dynamic_block_quantize_op` rebound to `_fp4_kernel_reference`, a
    line-by-line pure-torch transcription of the Triton kernel written here, including the
    rules only the kernel has (scale < 1e-5 -> 1, zero global amax -> 1e-12, a zero-padded
    tail block when the last dim is not a multiple of 16).
"""

import pathlib

import torch
from safetensors.torch import save_file

import modelopt.torch.quantization.tensor_quant as tensor_quant
from modelopt.torch.quantization.config import QuantizerAttributeConfig
from modelopt.torch.quantization.nn.modules.tensor_quantizer import (
    SequentialQuantizer,
    TensorQuantizer,
)
from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
from nvfp4_kernel_reference import fp4_kernel_reference

OUT = pathlib.Path(__file__).resolve().parent / "fixtures" / "tensor_quantizer.safetensors"

# CASE.meta = [kind, num_bits_or_exponent, mantissa (-1 for integer), axis (-1 none, 0 per row),
#              block kind (0 none, 1 static, 2 dynamic), block size,
#              calibrated (0: amax set; 1: modelopt's max calibration on CASE.calib0, calib1, ...;
#              2: on CASE.x itself), has pqs]
KIND_INT, KIND_FLOAT, KIND_SEQ_W4A8 = 0, 1, 2

tensors: dict[str, torch.Tensor] = {}


def put(name, t):
    tensors[name] = t.detach().contiguous().clone()


# modelopt looks this global up at call time (`_dynamic_block_quantize_forward`).
tensor_quant.dynamic_block_quantize_op = fp4_kernel_reference


def make_quantizer(cfg, pass_through_bwd):
    q = TensorQuantizer(QuantizerAttributeConfig(**cfg, pass_through_bwd=pass_through_bwd))
    return q


def calibrate(q, batches):
    """modelopt's max calibration (`max_calibrate`): every quantizer in calibration mode with
    quantization off, the batches forwarded, then `load_calib_amax` and back to quantizing. In a
    SequentialQuantizer the first one then passes its input through, so both see the input."""
    parts = list(q) if isinstance(q, SequentialQuantizer) else [q]
    for p in parts:
        p.disable_quant()
        p.enable_calib()
    with torch.no_grad():
        for b in batches:
            q(b)
    for p in parts:
        p.load_calib_amax()
        p.enable_quant()
        p.disable_calib()


def run_case(name, cfg, meta, x, *, amax=None, calib=None, pqs=None, grad_seed=0,
             sequential=None):
    """Forward + backward through a fresh quantizer for each STE mode; records everything.

    The same output gradient is used for both modes; with `pass_through_bwd=True` (modelopt's
    default) modelopt's input gradient is asserted to be that gradient (without a
    pre_quant_scale), so only the clipped one is stored."""
    put(f"{name}.x", x)
    put(f"{name}.meta", torch.tensor(meta, dtype=torch.int64))
    if calib is not None and not (len(calib) == 1 and calib[0] is x):
        for i, b in enumerate(calib):
            put(f"{name}.calib{i}", b)
    if pqs is not None:
        put(f"{name}.pqs", pqs)
    grad_out = None
    for ptb in (False, True):
        if sequential is not None:
            q = SequentialQuantizer(*(make_quantizer(c, ptb) for c in sequential))
        else:
            q = make_quantizer(cfg, ptb)
        if pqs is not None:
            q.pre_quant_scale = pqs
        if calib is not None:
            calibrate(q, calib)
        if amax is not None:
            q.amax = amax
        xi = x.clone().requires_grad_(True)
        y = q(xi)
        if grad_out is None:
            g = torch.Generator().manual_seed(grad_seed)
            grad_out = torch.randn(y.shape, generator=g).to(y.dtype)
        y.backward(grad_out)
        if not ptb:
            put(f"{name}.y", y)
            put(f"{name}.grad_out", grad_out)
            put(f"{name}.grad_clip", xi.grad)
            if sequential is not None:
                put(f"{name}.amax0", q[0].amax)
                put(f"{name}.amax1", q[1].amax)
            else:
                put(f"{name}.amax", q.amax)
        else:
            assert torch.equal(y, tensors[f"{name}.y"]), name
            if pqs is None:
                assert torch.equal(xi.grad, grad_out), name
            else:  # the gradient of x * pre_quant_scale is not the identity
                put(f"{name}.grad_ptb", xi.grad)


def meta(kind, bits, mant, axis, block_kind, block_size, calibrated, has_pqs=False):
    return [kind, bits, mant, axis, block_kind, block_size, int(calibrated), int(has_pqs)]


ON_X = 2  # `calibrated`: on the input itself (a weight quantizer)


gen = torch.Generator().manual_seed(1234)


def randn(*shape, scale=1.0):
    return torch.randn(*shape, generator=gen) * scale


FP8 = {"num_bits": (4, 3), "axis": None}
INT8_ROW = {"num_bits": 8, "axis": 0}
INT8_TENSOR = {"num_bits": 8, "axis": None}
INT4_BLK = {"num_bits": 4, "block_sizes": {-1: 128, "type": "static"}}
NVFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}

# --- FP8 E4M3 per tensor (FP8_DEFAULT_CFG's weight and input quantizers) ---
x = randn(8, 32, scale=2.0)
x[0, :6] = torch.tensor([0.0, -0.0, 3.5, -3.5, 100.0, -100.0])  # zeros, beyond amax
run_case("fp8_f32", FP8, meta(KIND_FLOAT, 4, 3, -1, 0, 0, False), x,
         amax=torch.tensor(3.1))
xb = randn(8, 32, scale=1.5).to(torch.bfloat16)
# 1.703125 is above the fp32 amax 1.7001 but equal to it in bf16: modelopt's backward compares
# |x| <= amax with a 0-d fp32 amax, which type promotion evaluates in bf16.
xb[0, :4] = torch.tensor([1.703125, -1.703125, 1.6953125, 2.0], dtype=torch.bfloat16)
run_case("fp8_bf16", FP8, meta(KIND_FLOAT, 4, 3, -1, 0, 0, False), xb,
         amax=torch.tensor(1.7001))
run_case("fp8_bf16_calib", FP8, meta(KIND_FLOAT, 4, 3, -1, 0, 0, True),
         randn(4, 48, scale=0.3).to(torch.bfloat16),
         calib=[randn(4, 48, scale=0.3).to(torch.bfloat16) for _ in range(3)])
run_case("fp8_tiny_amax", FP8, meta(KIND_FLOAT, 4, 3, -1, 0, 0, False), randn(4, 16),
         amax=torch.tensor(2.0**-25))

# --- INT8 per output row (INT8_DEFAULT_CFG's weight quantizer) ---
w = randn(8, 64, scale=0.05)
w[3] = 0.0                                    # a zero row: amax 0 -> output 0
w[5, :3] = torch.tensor([1e-9, -1e-9, 0.0])   # amax below 2^-24 -> output 0
w[5, 3:] = 0.0
run_case("int8_row_calib", INT8_ROW, meta(KIND_INT, 8, -1, 0, 0, 0, ON_X), w, calib=[w])
# Ties for round-half-even: amax 127 gives scale 1, so k + 0.5 lies exactly on a tie.
t = torch.arange(-8, 8, dtype=torch.float32).repeat(4, 1) + 0.5
t[1] = torch.linspace(-200, 200, 16)          # beyond amax: clamped to [-128, 127]
amax_rows = torch.tensor([[127.0], [127.0], [2.0**-24], [63.5]])
run_case("int8_row_ties", INT8_ROW, meta(KIND_INT, 8, -1, 0, 0, 0, False), t, amax=amax_rows)
# INT8 per tensor (the input quantizer) on bf16 activations, with a pre_quant_scale
# (SmoothQuant's order: x * pqs first; fp32 pqs promotes the bf16 input to fp32).
xa = randn(2, 5, 32).to(torch.bfloat16)
run_case("int8_tensor_bf16_pqs", INT8_TENSOR, meta(KIND_INT, 8, -1, -1, 0, 0, True, True), xa,
         calib=[randn(2, 5, 32).to(torch.bfloat16) for _ in range(2)],
         pqs=torch.rand(32, generator=gen) + 0.5)
run_case("int8_tensor_bf16", INT8_TENSOR, meta(KIND_INT, 8, -1, -1, 0, 0, False),
         randn(3, 32).to(torch.bfloat16), amax=torch.tensor(1.25))

# --- INT4 static blocks of 128 (INT4_AWQ_CFG's weight quantizer) ---
w4 = randn(3, 256, scale=0.1)
w4[1, 128:] = 0.0                             # an all-zero block
w4[2, :128] = (torch.arange(128) % 14 - 7).float() + 0.5  # ties: amax 7 gives scale 1
w4[2, 0] = 7.0
run_case("int4_blk128", INT4_BLK, meta(KIND_INT, 4, -1, -1, 1, 128, ON_X), w4, calib=[w4])
w4b = randn(2, 256, scale=0.1).to(torch.bfloat16)
run_case("int4_blk128_bf16", INT4_BLK, meta(KIND_INT, 4, -1, -1, 1, 128, ON_X), w4b,
         calib=[w4b])
# A last dim that 128 does not divide: modelopt pads each row with zeros to 256, quantizes,
# and slices the padding off (`_setup_for_blockquant`).
w4p = randn(2, 200, scale=0.1)
run_case("int4_blk128_pad", INT4_BLK, meta(KIND_INT, 4, -1, -1, 1, 128, ON_X), w4p,
         calib=[w4p])

# --- W4A8 (W4A8_AWQ_BETA_CFG's weight quantizer): INT4 blocks of 128, then FP8 per tensor ---
ws = randn(2, 256, scale=0.1)
run_case("w4a8_seq", None, meta(KIND_SEQ_W4A8, 4, -1, -1, 1, 128, ON_X), ws, calib=[ws],
         sequential=[INT4_BLK, FP8])

# --- NVFP4 (NVFP4_DEFAULT_CFG): E2M1 in dynamic blocks of 16, E4M3 block scales ---
x4 = randn(4, 64)
x4[0, :16] = 0.0                               # an all-zero block
x4[1, :8] = torch.tensor([9.0, -9.0, 0.0, 8.0, 1.0, -0.5, 3.0, 6.0])  # above the global amax
run_case("nvfp4_f32", NVFP4, meta(KIND_FLOAT, 2, 1, -1, 2, 16, False), x4,
         amax=torch.tensor(4.0))
run_case("nvfp4_bf16_calib", NVFP4, meta(KIND_FLOAT, 2, 1, -1, 2, 16, True),
         randn(2, 3, 32).to(torch.bfloat16),
         calib=[randn(2, 3, 32).to(torch.bfloat16) for _ in range(2)])
# Small values under a large global amax: block scales below 1e-5 become 1 (kernel-only rule).
xs = randn(2, 48, scale=1e-4)
xs[0, :16] = randn(16, scale=3.0)
run_case("nvfp4_small_scales", NVFP4, meta(KIND_FLOAT, 2, 1, -1, 2, 16, False), xs,
         amax=torch.tensor(8.0))
run_case("nvfp4_zero_amax", NVFP4, meta(KIND_FLOAT, 2, 1, -1, 2, 16, False), randn(2, 32),
         amax=torch.tensor(0.0))
run_case("nvfp4_pad", NVFP4, meta(KIND_FLOAT, 2, 1, -1, 2, 16, True), randn(3, 40),
         calib=[randn(3, 40) * 1.5])

# modelopt's own CPU code for NVFP4: NVFP4QTensor.quantize + dequantize with the global scale of
# the fake quant. Blocks stay well above both scale floors, so kernel and export path agree.
for name, xq in (("nvfp4_qtensor_f32", randn(6, 64)),
                 ("nvfp4_qtensor_bf16", randn(4, 32, scale=0.5).to(torch.bfloat16))):
    global_amax = xq.abs().amax().float()
    gs = global_amax.float() / (6.0 * 448.0)
    qt, scale, scale_2 = NVFP4QTensor.quantize(xq, 16, weights_scaling_factor_2=gs)
    yq = qt.dequantize(dtype=xq.dtype, scale=scale, double_scale=scale_2,
                       block_sizes={-1: 16})
    assert torch.equal(yq, fp4_kernel_reference(xq, 16, global_amax, 4, 2, 8, 4)), name
    put(f"{name}.x", xq)
    put(f"{name}.amax", global_amax)
    put(f"{name}.y", yq)

# --- calibration: running max over batches, per output row (the C++ test calibrates itself) ---
batches = [randn(6, 16, scale=s) for s in (0.5, 2.0, 1.0)]
q = make_quantizer(INT8_ROW, True)
calibrate(q, batches)
for i, b in enumerate(batches):
    put(f"calib_row.calib{i}", b)
put("calib_row.amax", q.amax)

OUT.parent.mkdir(parents=True, exist_ok=True)
save_file(tensors, str(OUT), metadata={"producer": "modelopt 0.47.0, tests/quant/make_fixtures.py"})
print(f"{OUT}: {len(tensors)} tensors, {OUT.stat().st_size} bytes")
