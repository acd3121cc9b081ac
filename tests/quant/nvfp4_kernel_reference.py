"""The Triton kernel behind modelopt 0.47's NVFP4 fake quant (`fp4_fake_quant_kernel` in
`kernels/quantization/gemm/fp4_kernel_hopper.py`) in pure torch ops, for the fixture scripts:
modelopt has no CPU path for dynamic E2M1 blocks, so the scripts rebind
`tensor_quant.dynamic_block_quantize_op` (looked up at call time) to this function.
"""

import torch


def fp4_kernel_reference(x, block_size, amax, num_bits, exponent_bits, scale_num_bits,
                         scale_exponent_bits):
    """The Triton `fp4_fake_quant_kernel` (with its wrapper `fp4_fake_quant_block`) in torch ops."""
    assert (num_bits, exponent_bits, scale_num_bits, scale_exponent_bits) == (4, 2, 8, 4)
    # The wrapper always launches with its default block size of 16 (it is not passed on).
    block = 16
    shape, dtype = x.shape, x.dtype
    x = x.reshape(-1, shape[-1])
    n = x.shape[-1]
    pad = (-n) % block
    # The kernel loads the tail of a row with padding_option="zero".
    tile = torch.nn.functional.pad(x.float(), (0, pad)).reshape(x.shape[0], -1, block)
    global_scale = amax.float() / (6.0 * 448.0)
    global_scale_safe = torch.where(global_scale > 0.0, global_scale,
                                    torch.tensor(1e-12, dtype=torch.float32))
    x_abs = tile.abs()
    block_max = x_abs.amax(dim=-1, keepdim=True)
    scale = block_max / (6.0 * global_scale_safe)
    scale = torch.minimum(scale, torch.tensor(448.0))
    scale = scale.to(torch.float8_e4m3fn).to(torch.float32) * global_scale_safe
    scale = torch.where(scale >= 1e-5, scale, torch.tensor(1.0))
    abs_scaled = x_abs / scale
    q = torch.where(
        abs_scaled <= 0.25, 0.0,
        torch.where(abs_scaled < 0.75, 0.5,
                    torch.where(abs_scaled <= 1.25, 1.0,
                                torch.where(abs_scaled < 1.75, 1.5,
                                            torch.where(abs_scaled <= 2.5, 2.0,
                                                        torch.where(abs_scaled < 3.5, 3.0,
                                                                    torch.where(abs_scaled <= 5.0,
                                                                                4.0, 6.0)))))))
    y = q * scale
    y = torch.where(tile >= 0, y, -y)
    y = y.reshape(x.shape[0], -1)[:, :n]
    return y.to(dtype).reshape(shape)
