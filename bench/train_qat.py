"""modelopt reference for `mdist train --quant` / `--teacher` (bench/train_cli.sh with QAT=1): the
Python modelopt 0.47 QAT and QAD loops, written as tests/quant/make_qat_fixtures.py and
make_qad_fixtures.py write them, on bench/train_cli.py's FSDP2 training loop. Run with torchrun;
rank 0 prints one JSON line.
    train_qat.py --model DIR [--quant none|fp8|int8] [--teacher DIR] [--calib-sequences 64]
                 [--steps 60] [--warmup-steps 5] [--seq-len 128] [--global-batch 16]
                 [--lr 3e-3] [--warmup 30] [--seed 1234] [--corpus data/corpus/macbeth.txt]
    train_qat.py --write-model DIR [--seed 1234] [--config data/default]
        (no torchrun): the starting model both sides load, transformers' seeded initialisation
        of the config, saved as a Hugging Face directory; it is also the QAD teacher.

What is the same as `mdist train --model DIR --quant F [--teacher DIR]` (so that the first
step's losses agree, not only compare):
- the model: both sides load DIR (fp32), each decoder layer then the root fully_shard'ed
  (reshard_after_forward) over a CPU mesh with Gloo, torch.set_num_threads(1);
- the data: the corpus's first 90% as bytes in seq_len windows, taken in mdist's order (its
  seeded std::mt19937_64 epoch permutation, reproduced by make_qat_fixtures.epoch_order), rank
  r the contiguous global_batch/W slice of each step's sequences;
- calibration (--quant): mtq.quantize(model, FP8_DEFAULT_CFG / INT8_DEFAULT_CFG, loop) on the
  FSDP2-wrapped model (as modelopt's QATTrainer calibrates the accelerate-wrapped one), the
  loop one sequence per forward under no_grad: the first --calib-sequences windows in file
  order, rank r windows r, r+W, ... (a rank with none left runs window 0, as mdist does);
  modelopt's max_calibrate all-reduces each amax (MAX) over the world, a Hugging Face model's
  default data-parallel group; the amax stay frozen while training;
- QAD (--teacher): the teacher loaded from its directory, fully_shard'ed as its own root, eval
  mode, forward under no_grad; loss = modelopt's LogitsDistillationLoss at temperature 1, masked
  and averaged as its _standard_kd_loss (make_qad_fixtures.kd_loss), KD only (modelopt's QAD);
- optimizer, schedule, clipping, timing and RSS: bench/train_cli.py's train_loop.

Reported (rank 0): median tokens/s over the steps after --warmup-steps, the calibration's wall
time (barrier to barrier, quantizer insertion included), every rank's peak RSS, the loss at the
first and last step (mean over ranks).
"""
import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import transformers

from train_cli import Windows, rss_mib, train_loop  # bench/ is on the path

# The fixture generators' helpers: mdist's window order, the modelopt configs, the KD loss.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests" / "quant"))
import make_qad_fixtures as qad  # noqa: E402
import make_qat_fixtures as qat  # noqa: E402

import modelopt  # noqa: E402
import modelopt.torch.quantization as mtq  # noqa: E402


class MdistOrderWindows(Windows):
    """train_cli.Windows in mdist's epoch order instead of torch's."""

    def window_of(self, k):
        epoch, index = divmod(k, self.windows.size(0))
        if epoch != self.epoch:
            self.epoch = epoch
            self.order = qat.epoch_order(self.windows.size(0), self.seed, epoch)
        return self.order[index]


def shard(model, mesh):
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)


def calibrate(model, quant, data, sequences, world, rank):
    """mtq.quantize with mdist's calibration split; returns its wall time in seconds."""
    count = min(sequences, data.windows.size(0)) if sequences > 0 else data.windows.size(0)
    mine = list(range(rank, count, world))
    rounds = (count + world - 1) // world

    def loop(m):
        with torch.no_grad():
            for i in range(rounds):
                m(input_ids=data.windows[mine[i] if i < len(mine) else 0].unsqueeze(0))

    dist.barrier()
    start = time.perf_counter()
    mtq.quantize(model, qat.config_for(quant), loop)
    dist.barrier()
    return time.perf_counter() - start, count


def write_model(args):
    config = transformers.LlamaConfig.from_json_file(os.path.join(args.config, "config.json"))
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(config).float()
    model.save_pretrained(args.write_model)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="the starting model (a Hugging Face directory)")
    parser.add_argument("--write-model", metavar="DIR", help="write the starting model and exit")
    parser.add_argument("--config", default="data/default")
    parser.add_argument("--quant", choices=("none", "fp8", "int8"), default="none")
    parser.add_argument("--teacher", help="QAD / distillation: the teacher's directory")
    parser.add_argument("--calib-sequences", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup-steps", type=int, default=5,
                        help="steps left out of the tokens/s median")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=30, help="learning-rate warm-up steps")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--corpus", default="data/corpus/macbeth.txt")
    args = parser.parse_args()
    if args.write_model:
        write_model(args)
        return
    if not args.model:
        raise SystemExit("bench: --model DIR (or --write-model DIR) is required")
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
    data = MdistOrderWindows(args.corpus, args.seq_len, args.seed)

    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    shard(model, mesh)
    model.train()
    calib_s, calib_count = None, 0
    if args.quant != "none":
        calib_s, calib_count = calibrate(model, args.quant, data, args.calib_sequences, world,
                                         rank)

    if args.teacher:
        teacher = transformers.AutoModelForCausalLM.from_pretrained(args.teacher,
                                                                    dtype=torch.float32)
        teacher.requires_grad_(False)
        shard(teacher, mesh)
        teacher.eval()

        def step_loss(ids):
            logits = model(input_ids=ids).logits
            with torch.no_grad():
                teacher_logits = teacher(input_ids=ids).logits
            kd = qad.kd_loss(logits, teacher_logits, ids, 1.0)
            return kd, kd
    else:
        def step_loss(ids):
            loss = model(input_ids=ids, labels=ids).loss
            return loss, loss

    losses, rates, rss = train_loop(model, args, world, rank, step_loss, data)

    if rank == 0:
        print(json.dumps({
            "impl": ("modelopt + torch FSDP2 (Python)" if args.quant != "none" or args.teacher
                     else "transformers + torch FSDP2 (Python)"),
            "world": world, "steps": args.steps,
            "warmup_steps": args.warmup_steps, "quant": args.quant,
            "teacher": bool(args.teacher), "calib_s": calib_s, "calib_sequences": calib_count,
            "tokens_per_s": statistics.median_low(rates), "peak_rss_mib": rss.tolist(),
            "import_rss_mib": import_rss, "first_loss": losses[0], "last_loss": losses[-1],
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "modelopt": modelopt.__version__,
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
