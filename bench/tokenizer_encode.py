"""Single-threaded encode throughput of Hugging Face `tokenizers` (Rust, via Python) on one
corpus, per line and as one whole text: the reference for bench/tokenizer_encode.cpp.
  python tokenizer_encode.py TOKENIZER_DIR CORPUS lines|whole [SECONDS=1.0]
Per line uses encode_batch with parallelism off, so that the Python loop is not what is timed.
"""
import json
import os
import sys
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["RAYON_NUM_THREADS"] = "1"
from tokenizers import Tokenizer  # noqa: E402


def main():
    directory, corpus, mode = sys.argv[1:4]
    seconds = float(sys.argv[4]) if len(sys.argv) > 4 else 1.0
    tok = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    raw = open(corpus, "rb").read()
    text = raw.decode("utf-8", errors="replace")
    lines = [line.decode("utf-8", errors="replace") for line in raw.split(b"\n")]
    if lines and lines[-1] == "":
        lines.pop()

    def run_once():
        if mode == "whole":
            return len(tok.encode(text, add_special_tokens=False).ids)
        return sum(len(e.ids) for e in tok.encode_batch(lines, add_special_tokens=False))

    run_once()
    begin = time.perf_counter()
    tokens = iterations = 0
    while True:
        tokens += run_once()
        iterations += 1
        elapsed = time.perf_counter() - begin
        if elapsed >= seconds:
            break
    print(json.dumps({"impl": "tokenizers (Rust via Python)", "mode": mode,
                      "mb_per_s": len(raw) * iterations / elapsed / 1e6,
                      "tokens_per_s": tokens / elapsed, "iterations": iterations}))


if __name__ == "__main__":
    main()
