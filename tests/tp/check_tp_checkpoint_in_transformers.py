"""Developer check (not run by CI; needs transformers): a checkpoint `mdist train --tp T` saved
loads in transformers, with the logits and the greedy continuation of a checkpoint trained the
same way without tensor parallelism.
  mdistrun --nproc-per-node 4 build/bin/mdist train --tp 1 --steps 6 --out /tmp/tp1
  mdistrun --nproc-per-node 4 build/bin/mdist train --tp 4 --steps 6 --out /tmp/tp4
  python tests/tp/check_tp_checkpoint_in_transformers.py \\
      /tmp/tp1/checkpoints/step-00000006 /tmp/tp4/checkpoints/step-00000006"""
import sys

import torch
from transformers import AutoModelForCausalLM


def main(reference, split):
    a = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(split, dtype=torch.float32).eval()
    ids = torch.tensor([list(b"MACBETH.\nWhat is done")]) % a.config.vocab_size
    with torch.no_grad():
        diff = (a(ids).logits - b(ids).logits).abs().max().item()
        prompt = ids[:, :9]
        same = torch.equal(a.generate(prompt, max_new_tokens=20, do_sample=False),
                           b.generate(prompt, max_new_tokens=20, do_sample=False))
    print(f"max |logits difference| = {diff:.3g}; greedy continuations equal: {same}")
    return 0 if diff < 1e-4 and same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
