"""Developer check (not run by CI; needs transformers): transformers loads a checkpoint that
mdist's save_pretrained wrote, and computes the same logits mdist did.
  build/bin/save_for_transformers tests/hf_model/fixtures/llama /tmp/out
  python tests/hf_model/check_transformers_loads.py /tmp/out
Works for every fixture, the mixtures of experts included (mdist writes their published
per-expert layout, which transformers 5 fuses on load)."""
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def main(path):
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ids = (torch.arange(16) % model.config.vocab_size).view(2, 8)
    with torch.no_grad():
        logits = model(ids).logits
    ours = torch.from_numpy(np.fromfile(f"{path}/mdist_logits.bin", dtype=np.float32)).view_as(logits)
    diff = (logits - ours).abs().max().item()
    print(f"{path}: transformers loaded {sum(p.numel() for p in model.parameters())} parameters; "
          f"max |logits difference| = {diff:.3g}")
    return 0 if diff < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
