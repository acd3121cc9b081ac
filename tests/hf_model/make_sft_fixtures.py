#!/usr/bin/env python3
"""Writes the supervised fine-tuning (--format sft) fixtures of tests/hf_model/fixtures/sft
(run by a developer, not by CI):

    /work/venv-quant/bin/python tests/hf_model/make_sft_fixtures.py

tokenization.json: prompt / completion pairs tokenized by the Python tokenizers library with
the tokenizer fixtures of tests/hf/tokenizer (llama2: BOS added; qwen2: no BOS), by the rule
TRL's SFTTrainer applies to prompt-completion data with completion-only loss:
    prompt_ids = encode(prompt)                                  (special tokens added)
    ids        = encode(prompt + completion + eos_token)         (TRL's add_eos, on the text)
    completion tokens: ids[len(prompt_ids):]
The script checks that ids == encode(prompt + completion) + [eos_token_id], the rule mdist
implements (src/cli/sft_data.h), and stores ids and len(prompt_ids) per example.

parity.json: for the model fixtures llama, qwen3 and qwen3_sliding (a window of 5 on layer 1,
shorter than the packed rows) of make_fixtures.py / make_rope_fixtures.py (weights read back
from fixtures/<arch>/), examples as id lists with their prompt lengths, laid out as mdist lays
them out (src/cli/sft_data.h): "padded" (one example per row, right-padded, attention_mask,
labels -100 on prompt and padding) and "packed" (examples in order, greedily, per-example
position ids restarting at 0, no attention mask, labels -100 on each example's prompt and first
token and on the tail). "loss" is transformers' loss of model(input_ids, attention_mask |
position_ids, labels, use_cache=False) on each (packed: transformers detects the documents from
the position ids and masks per document, only without a cache, i.e. as in training). The script checks the packed loss equals the padded one (1e-6).
"""
import json
import os
import pathlib

import numpy as np
import tokenizers
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = pathlib.Path(__file__).resolve().parent
FIXTURES = ROOT / "fixtures"
TOKENIZERS = ROOT.parent / "hf" / "tokenizer" / "fixtures"
OUT = pathlib.Path(os.environ.get("MDIST_FIXTURES_DIR", FIXTURES)) / "sft"
T = 16

PAIRS = [("Question: what is 2+2?\nAnswer:", " 4"),
         ("Translate to French: cat", " chat"),
         ("caf\u00e9 \u00fcber", " na\u00efve r\u00e9sum\u00e9."),
         ("  leading spaces", "trailing spaces  "),
         ("x", "y\nz")]


def tokenization():
    out = {"tokenizers_version": tokenizers.__version__, "families": {}}
    for family in ("llama2", "qwen2"):
        tok = tokenizers.Tokenizer.from_file(str(TOKENIZERS / family / "tokenizer.json"))
        config = json.loads((TOKENIZERS / family / "tokenizer_config.json").read_text())
        eos = config["eos_token"]
        eos_id = tok.token_to_id(eos)
        examples = []
        for prompt, completion in PAIRS:
            prompt_ids = tok.encode(prompt).ids
            trl = tok.encode(prompt + completion + eos).ids
            mdist = tok.encode(prompt + completion).ids + [eos_id]
            assert trl == mdist, (family, prompt, completion, trl, mdist)
            assert trl[:len(prompt_ids)] == prompt_ids, (family, prompt)
            examples.append({"prompt": prompt, "completion": completion, "ids": trl,
                             "prompt_tokens": len(prompt_ids)})
        out["families"][family] = examples
    return out


def load_model(arch):
    directory = FIXTURES / arch
    config = AutoConfig.from_pretrained(directory)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).float().eval()
    manifest = json.loads((directory / "manifest.json").read_text())["tensors"]
    blob = (directory / "tensors.bin").read_bytes()
    state = {}
    for entry in manifest:
        if entry["dtype"] != "f16" or entry["name"].startswith("fused:"):
            continue
        count = int(np.prod(entry["shape"]))
        data = np.frombuffer(blob, dtype="<f2", count=count, offset=entry["offset"])
        state[entry["name"]] = torch.from_numpy(data.astype(np.float32).reshape(entry["shape"]))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model, config


def examples_for(vocab):
    generator = torch.Generator().manual_seed(31)
    examples = []
    for prompt, completion in [(3, 4), (1, 6), (4, 2), (2, 7), (5, 3), (2, 2), (3, 5)]:
        ids = torch.randint(0, vocab, (prompt + completion,), generator=generator).tolist()
        examples.append({"ids": ids, "prompt_tokens": prompt})
    return examples


def layout(examples, packing):
    rows, used = [], T
    for e in examples:
        if not packing or used + len(e["ids"]) > T:
            rows.append([])
            used = 0
        rows[-1].append(e)
        used += len(e["ids"])
    ids = torch.zeros(len(rows), T, dtype=torch.int64)
    labels = torch.full((len(rows), T), -100, dtype=torch.int64)
    mask = torch.zeros(len(rows), T, dtype=torch.int64)
    positions = torch.zeros(len(rows), T, dtype=torch.int64)
    for r, row in enumerate(rows):
        t = 0
        for e in row:
            for i, token in enumerate(e["ids"]):
                ids[r, t] = token
                labels[r, t] = token if i >= e["prompt_tokens"] and i > 0 else -100
                mask[r, t] = 1
                positions[r, t] = i
                t += 1
        positions[r, t:] = torch.arange(T - t)
    batch = {"input_ids": ids, "labels": labels}
    if packing:
        batch["position_ids"] = positions
    else:
        batch["attention_mask"] = mask
    return batch


def parity():
    out = {"transformers_version": transformers.__version__, "seq_len": T, "archs": {}}
    for arch in ("llama", "qwen3", "qwen3_sliding"):
        model, config = load_model(arch)
        examples = examples_for(config.vocab_size)
        entry = {"examples": examples}
        with torch.no_grad():
            for name, packing in (("padded", False), ("packed", True)):
                batch = layout(examples, packing)
                loss = model(**batch, use_cache=False).loss.item()
                entry[name] = {k: v.tolist() for k, v in batch.items()}
                entry[name]["loss"] = loss
        assert len(entry["packed"]["input_ids"]) < len(entry["padded"]["input_ids"])
        difference = abs(entry["packed"]["loss"] - entry["padded"]["loss"])
        assert difference < 1e-6, (arch, entry["packed"]["loss"], entry["padded"]["loss"])
        # The per-document mask matters: the packed rows without position ids differ.
        with torch.no_grad():
            packed = layout(examples, True)
            cross = model(input_ids=packed["input_ids"], labels=packed["labels"],
                          use_cache=False).loss.item()
        assert abs(cross - entry["packed"]["loss"]) > 1e-3, (arch, cross)
        print(arch, "padded", entry["padded"]["loss"], "packed", entry["packed"]["loss"],
              "unmasked", cross)
        out["archs"][arch] = entry
    return out


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "tokenization.json").write_text(json.dumps(tokenization(), indent=1) + "\n")
    (OUT / "parity.json").write_text(json.dumps(parity()) + "\n")
