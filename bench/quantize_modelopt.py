"""Python reference for `mdist quantize` (bench/quantize.sh): modelopt 0.47's post-training
quantization of a Hugging Face causal LM, as `mdist quantize` does it, on one process.
    quantize_modelopt.py make --out DIR [--hidden 512 --layers 12 --intermediate 1536 --vocab 256]
    quantize_modelopt.py run --model DIR --format F --data FILE --eval-data FILE --seq-len N
                             --calib-sequences N --eval-sequences N --batch-size B --out DIR

`make` writes a random-initialised LlamaForCausalLM (seeded, fp32, safetensors) for both sides.

`run` does what `mdist quantize` does, phase by phase, and prints one JSON line with each
phase's seconds and the losses: load the model (fp32, SDPA attention), the held-out loss before
quantization, `mtq.quantize` with the format's preset config and a forward loop of one
calibration sequence per forward, the held-out loss of the fake-quantized model, then
`export_hf_checkpoint`. Data are read as bytes (token ids 0..255), in non-overlapping windows of
--seq-len, the first --calib-sequences of --data and the first --eval-sequences of --eval-data,
as mdist reads a byte-level text for a model directory without a tokenizer. The held-out loss is
the mean over all predicted tokens (batches of --batch-size windows), as `mdist eval`.

NVFP4: modelopt 0.47's dynamic-block fake quant runs only on CUDA (reference doc section 6); on
CPU its `dynamic_block_quantize_op` is replaced with a pure-torch version of the same kernel math
(E2M1 values in blocks of 16, E4M3 block scales under the global amax), so calibration and the
held-out loss run; the export is modelopt's own code either way.
"""
import argparse
import json
import os
import time


def rss_mib(field="VmHWM"):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def make(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 128,
                         max_position_embeddings=4096, tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(args.out, safe_serialization=True)
    print(json.dumps({"parameters": sum(p.numel() for p in model.parameters())}))


def windows(path, seq_len, count):
    import torch

    data = open(path, "rb").read()
    total = len(data) // seq_len
    count = total if count <= 0 else min(count, total)
    ids = torch.tensor(list(data[: count * seq_len]), dtype=torch.long)
    return ids.view(count, seq_len)


def pure_torch_nvfp4(inputs, block_size, amax, *_):
    """modelopt's fp4 fake-quant kernel math (fp4_kernel_hopper.py) in torch ops, for CPU: E2M1
    in blocks of 16 (ties to the even code), E4M3 block scales under amax / (6 * 448)."""
    import torch

    shape, dtype, n = inputs.shape, inputs.dtype, inputs.shape[-1]
    rows = inputs.float().reshape(-1, n)
    pad = (block_size - n % block_size) % block_size
    tile = torch.nn.functional.pad(rows, (0, pad)).reshape(rows.shape[0], -1, block_size)
    global_scale = amax.float().amax() / (6.0 * 448.0)
    global_scale = torch.where(global_scale > 0, global_scale, torch.tensor(1e-12))
    magnitude = tile.abs()
    scale = (magnitude.amax(-1, keepdim=True) / (global_scale * 6.0)).clamp(max=448.0)
    scale = scale.to(torch.float8_e4m3fn).float() * global_scale
    scale = torch.where(scale >= 1e-5, scale, torch.ones_like(scale))
    a = magnitude / scale
    q = torch.where(a <= 5.0, 4.0, 6.0)
    for bound, value, inclusive in ((3.5, 3.0, False), (2.5, 2.0, True), (1.75, 1.5, False),
                                    (1.25, 1.0, True), (0.75, 0.5, False), (0.25, 0.0, True)):
        q = torch.where(a <= bound if inclusive else a < bound, value, q)
    y = torch.where(tile >= 0, q * scale, -q * scale)
    return y.reshape(rows.shape[0], -1)[:, :n].reshape(shape).to(dtype)


def run(args):
    import torch

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    seconds = {"imports": time.perf_counter() - t0}
    configs = {"fp8": mtq.FP8_DEFAULT_CFG, "int8": mtq.INT8_DEFAULT_CFG,
               "int8_sq": mtq.INT8_SMOOTHQUANT_CFG, "int4_awq": mtq.INT4_AWQ_CFG,
               "w4a8_awq": mtq.W4A8_AWQ_BETA_CFG, "nvfp4": mtq.NVFP4_DEFAULT_CFG}
    config = configs[args.format]
    if args.format == "nvfp4" and not torch.cuda.is_available():
        from modelopt.torch.quantization import tensor_quant
        tensor_quant.dynamic_block_quantize_op = pure_torch_nvfp4

    t = time.perf_counter()
    # SDPA, as mdist's Llama attention (at::scaled_dot_product_attention) and the PTQ fixtures:
    # eager attention rounds differently (ulps), which moves activation amaxes by an ulp and
    # flips FP8 codes, so the losses after quantization would differ in the 4th-5th digit.
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    seconds["load"] = time.perf_counter() - t
    calib = windows(args.data, args.seq_len, args.calib_sequences)
    held_out = windows(args.eval_data, args.seq_len, args.eval_sequences)

    def loss():
        total, tokens = 0.0, 0
        with torch.no_grad():
            for batch in held_out.split(args.batch_size):
                n = batch.numel() - batch.shape[0]
                total += model(input_ids=batch, labels=batch).loss.item() * n
                tokens += n
        return total / tokens

    t = time.perf_counter()
    loss_before = loss()
    seconds["held_out_before"] = time.perf_counter() - t
    t = time.perf_counter()

    def forward_loop(m):
        with torch.no_grad():
            for row in calib:
                m(input_ids=row.unsqueeze(0))

    mtq.quantize(model, config, forward_loop)
    seconds["calibrate"] = time.perf_counter() - t
    t = time.perf_counter()
    loss_after = loss()
    seconds["held_out_after"] = time.perf_counter() - t
    t = time.perf_counter()
    export_hf_checkpoint(model, export_dir=args.out)
    seconds["export"] = time.perf_counter() - t
    seconds["total"] = time.perf_counter() - t0
    print(json.dumps({"loss_before": loss_before, "loss_after": loss_after, "seconds": seconds,
                      "peak_rss_mib": rss_mib(), "threads": torch.get_num_threads()}))


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", required=True)
    m.add_argument("--hidden", type=int, default=512)
    m.add_argument("--layers", type=int, default=12)
    m.add_argument("--intermediate", type=int, default=1536)
    m.add_argument("--vocab", type=int, default=256)
    m.add_argument("--seed", type=int, default=1234)
    r = sub.add_parser("run")
    for flag in ("--model", "--format", "--data", "--eval-data", "--out"):
        r.add_argument(flag, required=True)
    for flag, default in (("--seq-len", 256), ("--calib-sequences", 32), ("--eval-sequences", 8),
                          ("--batch-size", 4), ("--threads", 1)):
        r.add_argument(flag, type=int, default=default)
    args = parser.parse_args()
    make(args) if args.command == "make" else run(args)


if __name__ == "__main__":
    main()
