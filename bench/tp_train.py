"""PyTorch reference for bench/tp_train.cpp: the Llama-shaped stack of bench/llama_stack.py
split with torch's own tensor parallelism (torch.distributed.tensor.parallel) over the "tp"
dimension of a 2-D CPU DeviceMesh (dp, tp) on Gloo, then sharded with FSDP2 (fully_shard per
decoder layer, then the root) over its "dp" dimension; AdamW, the same weights, data and steps.
Run with torchrun; rank 0 prints one JSON line.
    tp_train.py [tensor_parallel=2] [timed_steps=8] [warmup=3] [global_batch=4] [seq_len=128]

The plan is torchtitan's without sequence parallelism, which is what mdist's hf::parallelize
does (Megatron-style):
  embed_tokens           RowwiseParallel(input_layouts=Replicate()): vocab-parallel rows,
                         output all-reduced (Partial -> Replicate)
  q/k/v_proj, gate/up    ColwiseParallel()
  o_proj, down_proj      RowwiseParallel()
  lm_head                ColwiseParallel(output_layouts=Shard(-1), use_local_output=False), the
                         loss under loss_parallel() (vocab-parallel cross entropy, no full logits)
  norms                  replicated (plain tensors)
llama_stack.Attention has no head attribute and views its projections with the global head
count, so each attention module's forward is replaced by one that uses its local head count
(heads / tp, torchtitan's n_local_heads); the weights and module names stay llama_stack's.
The causal-LM loss is HF's (logits at t against tokens at t + 1, as mdist's plan->loss): the
shifted labels are padded with -100 at the last position rather than slicing the sharded
logits. Everything here runs on CPU Gloo in this torch version with no substitutes.
At tp = 1 the model is not parallelized (as mdist's parallelize leaves a 1-rank group alone):
plain FSDP2 over the dp dimension."""
import json
import os
import statistics
import sys
import time
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_stack  # noqa: E402

HEAD_DIM = llama_stack.DIM // llama_stack.HEADS


def peak_rss_mib():
    """VmHWM: the most resident memory this process has had."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def tp_attention_forward(self, x, cos, sin):
    """llama_stack.Attention.forward with this rank's heads (self.n_local_heads)."""
    batch, time_, _ = x.shape
    split = lambda t: t.view(batch, time_, self.n_local_heads, HEAD_DIM).transpose(1, 2)
    q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
    q = q * cos + llama_stack.rotate_half(q) * sin
    k = k * cos + llama_stack.rotate_half(k) * sin
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.o_proj(out.transpose(1, 2).reshape(batch, time_, self.n_local_heads * HEAD_DIM))


def apply_tp(model, tp_mesh):
    parallelize_module(model, tp_mesh, {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    })
    layer_plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, layer_plan)
        attn = layer.self_attn
        attn.n_local_heads = llama_stack.HEADS // tp_mesh.size()
        attn.forward = types.MethodType(tp_attention_forward, attn)


def causal_lm_loss(logits, ids, parallel):
    """HF's shifted cross entropy: logits at t against ids at t + 1 (the last position has no
    target: -100, ignored), mean over the B (T - 1) targets."""
    labels = torch.cat((ids[:, 1:], torch.full_like(ids[:, :1], -100)), dim=1)
    if parallel:
        with loss_parallel():
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def main():
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    timed = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    warmup = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    global_batch = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    seq_len = int(sys.argv[5]) if len(sys.argv) > 5 else 128

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tp:
        raise SystemExit(f"bench: tensor parallel {tp} does not divide the world of {world} ranks")
    dp = world // tp
    if global_batch % dp:
        raise SystemExit(f"bench: global batch {global_batch} does not split over {dp} "
                         "data-parallel ranks")
    per_rank = global_batch // dp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()

    model = llama_stack.LlamaStack()
    llama_stack.init_weights(model)
    param_count = sum(p.numel() for p in model.parameters())
    checksum = sum(p.double().sum().item() for p in model.parameters())

    parallel = tp > 1
    if parallel:
        apply_tp(model, mesh["tp"])
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=True)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, times = [], {"step": [], "forward": [], "backward": [], "optimizer": []}
    for step in range(warmup + timed):
        ids, _ = llama_stack.batch_tokens(step, dp_rank * per_rank, per_rank, seq_len)
        start = time.perf_counter()
        optimizer.zero_grad()
        logits = model(ids)
        loss = causal_lm_loss(logits, ids, parallel)
        forward_done = time.perf_counter()
        if parallel:
            with loss_parallel():
                loss.backward()
        else:
            loss.backward()
        backward_done = time.perf_counter()
        optimizer.step()
        stop = time.perf_counter()
        if step >= warmup:
            times["step"].append(stop - start)
            times["forward"].append(forward_done - start)
            times["backward"].append(backward_done - forward_done)
            times["optimizer"].append(stop - backward_done)
        value = loss.full_tensor() if isinstance(loss, DTensor) else loss
        losses.append(value.item())

    # statistics.median_low: the same sample the C++ side reports (no averaging of two).
    mine = {f"{k}_s": statistics.median_low(v) for k, v in times.items()}
    mine.update({"peak_rss_mib": peak_rss_mib(), "losses": losses})
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        # The ranks run in lockstep; the slowest one's median is the job's step time.
        step = max(r["step_s"] for r in everyone)
        # Each rank's loss is its dp group's (the same on its tp ranks): the mean over all
        # ranks is the global batch's loss.
        mean_losses = [sum(r["losses"][i] for r in everyone) / world for i in range(len(losses))]
        print(json.dumps({
            "impl": "torch TP+FSDP2 (Python)",
            "world": world,
            "dp": dp,
            "tp": tp,
            "threads": torch.get_num_threads(),
            "params": param_count,
            "init_checksum": checksum,
            "global_batch": global_batch,
            "seq_len": seq_len,
            "warmup": warmup,
            "steps": timed,
            "step_s": step,
            "step_s_per_rank": [r["step_s"] for r in everyone],
            "forward_s": max(r["forward_s"] for r in everyone),
            "backward_s": max(r["backward_s"] for r in everyone),
            "optimizer_s": max(r["optimizer_s"] for r in everyone),
            "tokens_per_s": global_batch * seq_len / step,
            "peak_rss_mib": [r["peak_rss_mib"] for r in everyone],
            "first_loss": mean_losses[0],
            "last_loss": mean_losses[-1],
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
