"""PyTorch reference for `mdist train --ep` on a small Qwen3-MoE (bench/ep_train.sh): the same
training loop as bench/train_cli.py, on transformers' Qwen3MoeForCausalLM loaded from the same
directory, FSDP2 over every rank (no expert parallelism: PyTorch has none). Run with torchrun;
rank 0 prints one JSON line.
    ep_train.py --model DIR [--steps 20] [--warmup-steps 3] [--seq-len 64] [--global-batch 16]
                [--lr 1e-3] [--warmup 5] [--seed 1234] [--corpus data/corpus/macbeth.txt]
    ep_train.py --make-model DIR [--seed 1234]     # writes the bench's model (one process)

As mdist: output_router_logits, so the loss trained on is the LM loss plus router_aux_loss_coef
times the load-balancing loss (transformers' own); the data, schedule, AdamW and clip are
bench/train_cli.py's. Reported as there: median tokens/s after --warmup-steps, every rank's peak
RSS, rank 0's RSS after the imports, first and last loss (LM loss, mean over ranks).
"""
import argparse
import json
import statistics

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import transformers
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from train_cli import rss_mib, train_loop  # the same loop (bench/ is on the path)

# The bench's model: 4 sparse layers of 8 experts, top-2, byte vocabulary.
MODEL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, vocab_size=256, num_experts=8,
             num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True,
             router_aux_loss_coef=0.01, max_position_embeddings=1024, tie_word_embeddings=False)


def make_model(directory, seed):
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**MODEL)
    model = AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(directory)
    print(json.dumps({"model": directory, "params": sum(p.numel() for p in model.parameters())}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--make-model")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup-steps", type=int, default=3,
                        help="steps left out of the tokens/s median")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=5, help="learning-rate warm-up steps")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--corpus", default="data/corpus/macbeth.txt")
    args = parser.parse_args()
    if args.make_model:
        make_model(args.make_model, args.seed)
        return
    import_rss = rss_mib("VmRSS")

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if args.global_batch % world:
        raise SystemExit(
            f"bench: global batch {args.global_batch} does not split over {world} ranks")
    mesh = init_device_mesh("cpu", (world,))

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.config.output_router_logits = True
    params = sum(p.numel() for p in model.parameters())
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    model.train()

    coef = model.config.router_aux_loss_coef

    def step_loss(ids):
        # transformers adds coef x aux to the LM loss when it returns the router logits; the
        # LM loss alone is logged, as mdist logs it.
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        return out.loss, out.loss.item() - coef * out.aux_loss.item()

    losses, rates, rss = train_loop(model, args, world, rank, step_loss)

    if rank == 0:
        print(json.dumps({
            "impl": "py", "world": world, "steps": args.steps, "params": params,
            "tokens_per_s": statistics.median_low(rates), "peak_rss_mib": rss.tolist(),
            "import_rss_mib": import_rss, "first_loss": losses[0], "last_loss": losses[-1],
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__,
            "experts": getattr(model.config, "_experts_implementation", None),
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
