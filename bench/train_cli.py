"""PyTorch reference for `mdist train` on the embedded default (bench/train_cli.sh): the same
training loop written with transformers + PyTorch FSDP2. Run with torchrun; rank 0 prints one
JSON line.
    train_cli.py [--steps 60] [--warmup-steps 5] [--seq-len 128] [--global-batch 16]
                 [--lr 3e-3] [--warmup 30] [--seed 1234] [--config data/default]
                 [--corpus data/corpus/macbeth.txt]

What is the same as `mdist train`:
- model: transformers' LlamaForCausalLM built from the local config.json only (no hub access),
  transformers' own initialisation (normal std initializer_range=0.02 for Linear/Embedding,
  RMSNorm ones) after torch.manual_seed(seed), fp32, SDPA attention (transformers' default; the
  C++ model calls at::scaled_dot_product_attention too);
- data: the corpus as raw bytes (tokens 0..255), the first 90% of them; non-overlapping windows
  of seq_len tokens, input_ids = labels = the window (HF's shifted causal-LM loss); each step
  takes the run's next global_batch windows (a fresh seeded permutation per epoch, sequences
  counted across epochs), rank r the contiguous global_batch/W slice. The permutations and the
  initial weights come from torch's RNG, not mdist's, so the exact batches and weights differ:
  the losses are comparable, not equal;
- AdamW betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices only; linear warm-up over
  `warmup` steps, then cosine decay to 0.1*lr at the last step (mdist's formula); global-norm
  grad clip 1.0;
- fully_shard on each decoder layer then on the root (reshard_after_forward=True) over a CPU
  device mesh with Gloo; torch.set_num_threads(1).

Reported (rank 0): median tokens/s over the steps after --warmup-steps (global tokens of a step
/ rank 0's wall time for it: slicing the batch, forward, backward, clip, optimizer step, and as
in mdist the loss's all-reduce and the all-gather of every rank's peak RSS), peak RSS (VmHWM) of
every rank in MiB and rank 0's RSS right after the imports, the loss (mean over ranks) at the
first and last step.
"""
import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import transformers
from transformers import LlamaConfig, LlamaForCausalLM


def rss_mib(field="VmHWM"):
    """VmHWM: the most resident memory this process has had; VmRSS: what it has now."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def lr_at(step, steps, lr, warmup):
    """mdist's schedule (include/mdist/train/lr_schedule.h), `step` 1-based: linear warm-up to lr over `warmup`
    steps, then cosine decay to 0.1*lr reached at the last step."""
    min_lr = 0.1 * lr
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    progress = min(1.0, max(0.0, (step - warmup) / max(1, steps - warmup)))
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


class Windows:
    """Non-overlapping seq_len windows of the training bytes. The k-th sequence of the run (k
    counts across epochs) is window perm_e[k mod count] of epoch e = k div count, a fresh seeded
    permutation per epoch, as in mdist (src/cli/token_data.h)."""

    def __init__(self, path, seq_len, seed):
        data = open(path, "rb").read()
        train = data[: len(data) * 9 // 10]
        count = len(train) // seq_len
        if count < 1:
            raise SystemExit(f"bench: the data is shorter than one window of {seq_len} bytes")
        tokens = torch.frombuffer(bytearray(train[: count * seq_len]), dtype=torch.uint8)
        self.windows = tokens.view(count, seq_len).long()
        self.seed = seed
        self.epoch, self.order = -1, None

    def window_of(self, k):
        epoch, index = divmod(k, self.windows.size(0))
        if epoch != self.epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self.epoch, self.order = epoch, torch.randperm(self.windows.size(0), generator=gen)
        return int(self.order[index])

    def batch(self, first, size):
        """Sequences first .. first+size-1 of the run."""
        return self.windows[[self.window_of(k) for k in range(first, first + size)]]


def train_loop(model, args, world, rank, step_loss, data=None):
    """The measured loop, shared with bench/ep_train.py and bench/train_qat.py: AdamW with
    decoupled weight decay on matrices only (norm weights are not decayed, as in mdist), mdist's
    schedule, clip 1.0. step_loss(ids) -> (loss to backpropagate, loss to log); data: the
    windows (default Windows of --corpus). Returns the per-step losses (mean over ranks), the
    tokens/s of the steps after --warmup-steps and every rank's peak RSS."""
    per_rank = args.global_batch // world
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    if data is None:
        data = Windows(args.corpus, args.seq_len, args.seed)
    step_tokens = args.global_batch * args.seq_len
    losses, rates = [], []
    rss = torch.empty(world, dtype=torch.float64)
    for step in range(args.steps):
        start = time.perf_counter()
        ids = data.batch(step * args.global_batch + rank * per_rank, per_rank)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step + 1, args.steps, args.lr, args.warmup)
        optimizer.zero_grad(set_to_none=True)
        loss, logged_loss = step_loss(ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        # Per step, as mdist logs them: the mean over ranks of their losses (= the global
        # batch's loss, the slices being equal) and every rank's peak RSS.
        logged = torch.tensor([float(logged_loss)], dtype=torch.float64)
        dist.all_reduce(logged)
        losses.append(logged.item() / world)
        dist.all_gather_into_tensor(rss, torch.tensor([rss_mib()], dtype=torch.float64))
        elapsed = time.perf_counter() - start
        if step >= args.warmup_steps:
            rates.append(step_tokens / elapsed)
    return losses, rates, rss


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup-steps", type=int, default=5,
                        help="steps left out of the tokens/s median")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=30, help="learning-rate warm-up steps")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--config", default="data/default")
    parser.add_argument("--corpus", default="data/corpus/macbeth.txt")
    parser.add_argument("--param-dtype", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), "
                             "as mdist train --param-dtype bf16")
    args = parser.parse_args()
    # What torch (the CUDA build's libraries too) and transformers hold once imported.
    import_rss = rss_mib("VmRSS")

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if args.global_batch % world:
        raise SystemExit(
            f"bench: global batch {args.global_batch} does not split over {world} ranks")
    if args.steps <= args.warmup_steps:
        raise SystemExit(f"bench: --steps {args.steps} leaves no step after --warmup-steps")
    mesh = init_device_mesh("cpu", (world,))

    config = LlamaConfig.from_json_file(os.path.join(args.config, "config.json"))
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).float()  # transformers' _init_weights: std initializer_range
    params = sum(p.numel() for p in model.parameters())
    mp_policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                 if args.param_dtype == "bf16" else MixedPrecisionPolicy())
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=True, mp_policy=mp_policy)
    model.train()

    losses, rates, rss = train_loop(
        model, args, world, rank, lambda ids: (model(input_ids=ids, labels=ids).loss,) * 2)

    if rank == 0:
        print(json.dumps({
            "impl": "transformers + torch FSDP2 (Python)", "world": world, "steps": args.steps,
            "warmup_steps": args.warmup_steps, "params": params,
            "tokens_per_s": statistics.median_low(rates), "peak_rss_mib": rss.tolist(),
            "import_rss_mib": import_rss,
            "first_loss": losses[0], "last_loss": losses[-1],
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__,
            "attn": getattr(model.config, "_attn_implementation", None),
            "param_dtype": args.param_dtype,
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
