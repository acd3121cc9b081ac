"""PyTorch reference for bench/sync_obj_latency.cpp: all_gather_object of one float (what the
spec's get_dist_syncd_obj does) and a raw all_gather_into_tensor of one float, over Gloo.
Run with torchrun; prints one JSON object per measurement on rank 0."""
import json
import sys
import time

import torch
import torch.distributed as dist


def time_calls(warmup, calls, fn):
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return samples


def summarize(samples):
    samples = sorted(samples)
    at = lambda q: samples[int(q * (len(samples) - 1))]
    return {"median_us": round(at(0.5), 2), "p10_us": round(at(0.1), 2), "p90_us": round(at(0.9), 2)}


def main():
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = 0.25 * rank

    def sync():
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        return max(gathered)

    sync_samples = time_calls(100, calls, sync)
    assert sync() == 0.25 * (world - 1)
    inp, out = torch.full((1,), mine), torch.empty(world)
    raw_samples = time_calls(100, calls, lambda: dist.all_gather_into_tensor(out, inp))
    if rank == 0:
        for impl, op, samples in (
            ("torch.distributed (Python)", "all_gather_object(float) + max", sync_samples),
            ("torch.distributed (Python)", "all_gather_into_tensor(float[1])", raw_samples),
        ):
            print(json.dumps({"impl": impl, "op": op, "world": world, "calls": calls, **summarize(samples)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
