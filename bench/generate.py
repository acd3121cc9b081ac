"""Generation speed of transformers' model.generate (DynamicCache, greedy, batch 1) on one
thread: the reference for bench/generate.cpp, the same JSON fields.
  python generate.py MODEL_DIR [PROMPT=16] [NEW=256]
  python generate.py --write MODEL_DIR   writes the bench model (seeded, save_pretrained)
"""
import json
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, StoppingCriteria

torch.set_num_threads(1)


def write(directory):
    torch.manual_seed(0)
    # Llama-shaped, ~19 M parameters: 6 layers, hidden 384, GQA 6 / 2 heads, vocab 8192.
    config = LlamaConfig(hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                         num_attention_heads=6, num_key_value_heads=2, vocab_size=8192,
                         max_position_embeddings=2048, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(config).save_pretrained(directory)


class Stamps(StoppingCriteria):
    """Called once per new token: the time each token was chosen."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def main():
    if sys.argv[1] == "--write":
        return write(sys.argv[2])
    directory = sys.argv[1]
    prompt_length = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    new_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 256
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    ids = torch.tensor([[(7 * i + 3) % vocab for i in range(prompt_length)]])

    def run(n, stamps):
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                  pad_token_id=0, stopping_criteria=[stamps])

    run(8, Stamps())  # warm-up
    stamps = Stamps()
    begin = time.perf_counter()
    out = run(new_tokens, stamps)
    seconds = time.perf_counter() - begin
    row = {"impl": f"transformers {transformers.__version__}",
           "tokens_per_s": (out.shape[1] - prompt_length) / seconds}
    t = stamps.times
    length = 64
    while length <= prompt_length + new_tokens:
        steps = [t[i] - t[i - 1] for i in range(max(1, length - 32 - prompt_length),
                                                min(length - prompt_length, len(t)))]
        if steps:
            row[f"step_ms_{length}"] = 1e3 * sum(steps) / len(steps)
        length *= 2
    print(json.dumps(row))


if __name__ == "__main__":
    main()
