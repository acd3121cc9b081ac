"""PyTorch reference for bench/fsdp_train.cpp: the Llama-shaped stack of bench/llama_stack.py
trained with torch's own FSDP2 (fully_shard per decoder layer, then the root) on a CPU device
mesh over Gloo, AdamW, the same data and steps. Run with torchrun; rank 0 prints one JSON
line.
    fsdp_train.py [timed_steps=8] [warmup=3] [global_batch=4] [seq_len=128]
FSDP_BENCH_DEVICE=cuda: on cuda:LOCAL_RANK with NCCL; FSDP_BENCH_PARAM_DTYPE=bf16: bf16 gather and
compute, fp32 gradient reduction (MixedPrecisionPolicy), as bench/fsdp_train.cpp reads them."""
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_stack  # noqa: E402

MIB = 1024.0 * 1024.0


def peak_rss_mib():
    """VmHWM: the most resident memory this process has had."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def local_nbytes(t):
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def persistent_bytes(model, optimizer):
    """What this rank holds between steps: its shards, their gradients and the AdamW state."""
    total = 0
    for p in model.parameters():
        total += local_nbytes(p) + (local_nbytes(p.grad) if p.grad is not None else 0)
    for state in optimizer.state.values():
        total += sum(local_nbytes(state[k]) for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
                     if k in state)
    return total


class UnshardWatch:
    """The most FSDP units holding full parameters at once, sampled when each decoder layer
    has just gathered its parameters for forward and when its backward has just finished
    (before its gradients are reduce-scattered and it reshards). A unit counts while it is
    unsharded and also while its (prefetch) all-gather is in flight, since its output buffer
    is allocated then; both are read from FSDP2's private state."""

    def __init__(self, units):
        self.units = units  # (fsdp module, bytes of its full parameters, is a decoder layer)
        self.max_units = 0  # the root included
        self.max_layer_units = 0
        self.max_bytes = 0
        self.backward_samples = 0

    def sample(self):
        live = []
        for module, full_bytes, is_layer in self.units:
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None and (
                group.is_unsharded or getattr(group, "_all_gather_result", None) is not None
            ):
                live.append((full_bytes, is_layer))
        self.max_units = max(self.max_units, len(live))
        self.max_layer_units = max(self.max_layer_units, sum(1 for _, layer in live if layer))
        self.max_bytes = max(self.max_bytes, sum(b for b, _ in live))

    def sample_backward(self):
        self.backward_samples += 1
        self.sample()

    def attach(self, layer):
        def pre_hook(module, args):
            self.sample()
            if torch.is_grad_enabled() and args[0].requires_grad:
                args[0].register_hook(lambda grad: self.sample_backward())

        layer.register_forward_pre_hook(pre_hook)


def main():
    timed = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    warmup = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    global_batch = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    seq_len = int(sys.argv[4]) if len(sys.argv) > 4 else 128

    device_name = os.environ.get("FSDP_BENCH_DEVICE", "cpu")
    if device_name not in ("cpu", "cuda"):
        raise SystemExit(f"bench: FSDP_BENCH_DEVICE is cpu or cuda, not {device_name}")
    dtype_name = os.environ.get("FSDP_BENCH_PARAM_DTYPE", "fp32")
    if dtype_name not in ("fp32", "bf16"):
        raise SystemExit(f"bench: FSDP_BENCH_PARAM_DTYPE is fp32 or bf16, not {dtype_name}")
    if device_name == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    mp_policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                 if dtype_name == "bf16" else MixedPrecisionPolicy())

    def sync():
        # Kernels are asynchronous on CUDA: phase boundaries wait for them.
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    world, rank = dist.get_world_size(), dist.get_rank()
    if global_batch % world:
        raise SystemExit(f"bench: global batch {global_batch} does not split over {world} ranks")
    per_rank = global_batch // world
    mesh = init_device_mesh(device.type, (world,))

    model = llama_stack.LlamaStack()
    llama_stack.init_weights(model)
    model.to(device)
    param_count = sum(p.numel() for p in model.parameters())
    checksum = sum(p.double().sum().item() for p in model.parameters())
    # Per-parameter padding each rank may carry beyond total / W (dim-0 chunks rounded up).
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    pad_bytes = 0
    for p in model.parameters():
        rows = p.size(0)
        chunk = -(-rows // world)
        pad_bytes += (chunk * world - rows) * (p.numel() // rows) * p.element_size()

    units = []
    for layer in model.layers:
        units.append((layer, sum(p.numel() * p.element_size() for p in layer.parameters()), True))
        fully_shard(layer, mesh=mesh, reshard_after_forward=True, mp_policy=mp_policy)
    root_bytes = full_bytes - sum(b for _, b, _ in units)
    fully_shard(model, mesh=mesh, reshard_after_forward=True, mp_policy=mp_policy)
    units.append((model, root_bytes, False))
    watch = UnshardWatch(units)
    for layer in model.layers:
        watch.attach(layer)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, times = [], {"step": [], "forward": [], "backward": [], "optimizer": []}
    persistent = 0
    for step in range(warmup + timed):
        inputs, targets = llama_stack.batch_tokens(step, rank * per_rank, per_rank, seq_len)
        inputs, targets = inputs.to(device), targets.to(device)
        sync()
        start = time.perf_counter()
        optimizer.zero_grad()
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
        sync()
        forward_done = time.perf_counter()
        loss.backward()
        sync()
        backward_done = time.perf_counter()
        optimizer.step()
        sync()
        stop = time.perf_counter()
        if step >= warmup:
            times["step"].append(stop - start)
            times["forward"].append(forward_done - start)
            times["backward"].append(backward_done - forward_done)
            times["optimizer"].append(stop - backward_done)
        losses.append(loss.item())
        if step == warmup + timed - 1:
            # Gradients are still set here (zero_grad at the next step's start drops them).
            persistent = persistent_bytes(model, optimizer)

    # statistics.median_low: the same sample the C++ side reports (no averaging of two).
    mine = {f"{k}_s": statistics.median_low(v) for k, v in times.items()}
    mine.update({
        "peak_rss_mib": peak_rss_mib(),
        "persistent_bytes": persistent,
        "losses": losses,
        "max_units": watch.max_units,
        "max_layer_units": watch.max_layer_units,
        "max_full_param_bytes": watch.max_bytes,
        "backward_samples": watch.backward_samples,
    })
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        # The ranks run in lockstep; the slowest one's median is the job's step time.
        step = max(r["step_s"] for r in everyone)
        mean_losses = [sum(r["losses"][i] for r in everyone) / world for i in range(len(losses))]
        print(json.dumps({
            "impl": "torch FSDP2 (Python)",
            "adamw": "torch.optim.AdamW (defaults: for-loop on CPU)",
            "world": world,
            "device": str(device),
            "param_dtype": dtype_name,
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
            "persistent_bytes": [r["persistent_bytes"] for r in everyone],
            # Parameters, gradients, exp_avg and exp_avg_sq: four times the parameter bytes.
            "persistent_expected_bytes": 4 * full_bytes / world,
            "padding_allowance_bytes": 4 * pad_bytes / world,
            "optimizer_state": "optimizer.state",
            "max_full_units": max(r["max_units"] for r in everyone),
            "max_full_layer_units": max(r["max_layer_units"] for r in everyone),
            "max_full_param_mib": max(r["max_full_param_bytes"] for r in everyone) / MIB,
            "backward_probe_samples": min(r["backward_samples"] for r in everyone),
            "first_loss": mean_losses[0],
            "last_loss": mean_losses[-1],
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
