"""Developer check (not run by CI; needs transformers): transformers loads a checkpoint that
mdist's save_pretrained wrote, and computes the same logits mdist did.
  build/bin/save_for_transformers tests/hf_model/fixtures/llama /tmp/out [LENGTH]
  python tests/hf_model/check_transformers_loads.py /tmp/out
Works for every fixture, the mixtures of experts included (mdist writes their published
per-expert layout, which transformers 5 fuses on load), and the RoPE / layer-type fixtures of
make_rope_fixtures.py (rope_yarn, rope_longrope, rope_dynamic, qwen3_sliding, ...: the rope
object and layer_types that mdist's config.json writes are read back by transformers), and
make_family_fixtures.py's phi3, phi3_bf16, olmo2, gemma2, gemma2_bf16, gemma3 and gemma3_bf16
(LENGTH 24: beyond Phi-3's original_max_position_embeddings, so its long factors run, and
beyond the Gemma fixtures' window of 5)."""
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def main(path):
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ours = torch.from_numpy(np.fromfile(f"{path}/mdist_logits.bin", dtype=np.float32))
    length = ours.numel() // (2 * model.config.vocab_size)  # save_for_transformers' LENGTH
    ids = (torch.arange(2 * length) % model.config.vocab_size).view(2, length)
    with torch.no_grad():
        logits = model(ids).logits
    ours = ours.view_as(logits)
    diff = (logits - ours).abs().max().item()
    print(f"{path}: transformers loaded {sum(p.numel() for p in model.parameters())} parameters; "
          f"max |logits difference| = {diff:.3g}")
    return 0 if diff < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
