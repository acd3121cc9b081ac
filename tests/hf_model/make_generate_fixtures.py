#!/usr/bin/env python3
"""Writes fixtures/<arch>/generate.json: transformers' greedy generate on the parity models
(run by a developer, not by CI; after make_fixtures.py, with the same venv).

    /work/venv-quant/bin/python tests/hf_model/make_generate_fixtures.py [ARCH...]

Each fixture model (config.json, and the f16-exact weights of tensors.bin loaded into fp32) runs
model.generate(do_sample=False, max_new_tokens=N) with its DynamicCache (transformers'
default), with the config's eos_token_id, on seeded prompts: each alone, then all of them as one
left-padded batch (attention mask given, as a tokenizer with padding_side="left" makes it).
generate.json holds {"max_new_tokens", "eos_token_id", "cases": [{"prompts": [[ids]],
"outputs": [[new ids]]}]}: each output the tokens after its prompt, up to and including the
first end-of-sequence token (the padding transformers adds after it left out).
"""
import json
import pathlib
import sys

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

HERE = pathlib.Path(__file__).resolve().parent / "fixtures"
# phi3 (make_family_fixtures.py): longrope with original_max_position_embeddings 16, so the
# generation crosses it, where transformers' Phi-3 drops its cache and recomputes the whole
# sequence on the long factors.
ARCHS = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen3_moe_norm", "qwen3_moe_ties",
         "qwen2_moe", "mixtral", "phi3", "olmo2", "gemma2", "gemma3"]
MAX_NEW_TOKENS = 24  # with a 7-token prompt, well past mistral's sliding window of 5
CODES = {"f16": np.float16, "f32": np.float32, "i64": np.int64}


def fixture_tensors(arch):
    manifest = json.loads((HERE / arch / "manifest.json").read_text())
    blob = (HERE / arch / "tensors.bin").read_bytes()
    tensors = {}
    for entry in manifest["tensors"]:
        dtype = np.dtype(CODES[entry["dtype"]]).newbyteorder("<")
        count = int(np.prod(entry["shape"])) if entry["shape"] else 1
        array = np.frombuffer(blob, dtype=dtype, count=count, offset=entry["offset"])
        tensors[entry["name"]] = torch.from_numpy(array.copy()).reshape(entry["shape"])
    return tensors


def load_model(arch):
    config = AutoConfig.from_pretrained(HERE / arch)
    # Gemma 2: eager, as its parity fixtures (sdpa cannot soft-cap its scores).
    config._attn_implementation = "eager" if config.model_type == "gemma2" else "sdpa"
    # The MoE fixtures were saved with output_router_logits=True (for their aux_loss); generate
    # needs no aux_loss, and transformers' load-balancing loss fails on a cached step's shapes.
    config.output_router_logits = False
    model = AutoModelForCausalLM.from_config(config).eval().float()
    tensors = fixture_tensors(arch)
    state = {}
    for key in model.state_dict():
        # Dense keys are stored as they are; transformers 5's fused experts (and Mixtral's
        # router, named mlp.gate there) under "fused:<key>".
        source = tensors.get(key, tensors.get("fused:" + key))
        if source is None and key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        assert source is not None, (arch, key)
        state[key] = source.float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model, config


def eos_ids(config):
    eos = config.eos_token_id
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def generate(model, config, prompts):
    width = max(len(p) for p in prompts)
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    ids = torch.full((len(prompts), width), pad, dtype=torch.int64)
    mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=MAX_NEW_TOKENS, pad_token_id=pad,
                             eos_token_id=eos_ids(config) or None)
    outputs = []
    for row in out[:, width:].tolist():
        new = []
        for token in row:
            new.append(token)
            if token in eos_ids(config):
                break
        outputs.append(new)
    return outputs


def write(arch):
    model, config = load_model(arch)
    generator = torch.Generator().manual_seed(4321)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=generator).tolist()
               for n in (7, 3, 5)]
    cases = [{"prompts": [p], "outputs": generate(model, config, [p])} for p in prompts]
    batch = generate(model, config, prompts)
    # Batch rows are independent: left padding must not change a row's tokens. Except with
    # longrope (phi3): the factors switch for the whole batch when its longest row (and the
    # cache recomputation when the padded width) passes original_max_position_embeddings, which
    # is earlier for the shorter rows than alone.
    if arch != "phi3":
        assert batch == [c["outputs"][0] for c in cases], (arch, batch, cases)
    cases.append({"prompts": prompts, "outputs": batch})
    (HERE / arch / "generate.json").write_text(json.dumps({
        "transformers_version": transformers.__version__, "torch_version": torch.__version__,
        "max_new_tokens": MAX_NEW_TOKENS, "eos_token_id": eos_ids(config), "cases": cases},
        indent=1) + "\n")
    print(arch, [len(o) for o in batch], batch[0][:8])


if __name__ == "__main__":
    for arch in ARCHS:
        if len(sys.argv) < 2 or arch in sys.argv[1:]:
            write(arch)
