"""Reference for bench/tokenize.sh: what `mdist tokenize` does, with Hugging Face `tokenizers`.

Reads the corpus as lines (a trailing "\\r" removed, empty lines skipped), encodes them with
Tokenizer.encode_batch(lines, add_special_tokens=True) in batches of --batch lines (Rust threads:
the library's default, all cores), appends the EOS id of tokenizer_config.json to each, and writes
little-endian uint32 ids to --out. Prints one JSON line: tokens, documents, seconds (encoding and
writing, after the tokenizer is loaded).
"""
import argparse
import array
import json
import sys
import time

import tokenizers


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="directory with tokenizer.json")
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=4096)
    args = parser.parse_args()
    tokenizer = tokenizers.Tokenizer.from_file(f"{args.model}/tokenizer.json")
    config = json.load(open(f"{args.model}/tokenizer_config.json"))
    eos = config["eos_token"]
    eos_id = tokenizer.token_to_id(eos if isinstance(eos, str) else eos["content"])
    began = time.perf_counter()
    tokens = documents = 0
    with open(args.data, "rb") as corpus, open(args.out, "wb") as out:
        batch = []

        def flush():
            nonlocal tokens, documents
            ids = array.array("I")
            for encoding in tokenizer.encode_batch(batch, add_special_tokens=True):
                ids.extend(encoding.ids)
                ids.append(eos_id)
            if sys.byteorder != "little":
                ids.byteswap()
            out.write(ids.tobytes())
            tokens += len(ids)
            documents += len(batch)
            batch.clear()

        for raw in corpus:
            line = raw.rstrip(b"\n")
            if line.endswith(b"\r"):
                line = line[:-1]
            if line:
                batch.append(line.decode("utf-8", errors="replace"))
            if len(batch) == args.batch:
                flush()
        if batch:
            flush()
    print(json.dumps({"tokens": tokens, "documents": documents,
                      "seconds": time.perf_counter() - began, "tokenizers": tokenizers.__version__}))


if __name__ == "__main__":
    main()
