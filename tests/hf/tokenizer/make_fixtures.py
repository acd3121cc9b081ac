#!/usr/bin/env python3
"""Parity fixtures for mdist::hf::Tokenizer (developer-run, not a test-time dependency).

  ~/.cache/mdist/bench-venv/bin/python tests/hf/tokenizer/make_fixtures.py

Trains small BPE tokenizers with the Python `tokenizers` library, configured like each open
causal-LM family, on fixtures/corpus.txt, adds added/special tokens, and writes per family
fixtures/<family>/{tokenizer.json,tokenizer_config.json,reference.json}: the ids (with and
without special tokens) and decode strings (with and without skip_special_tokens) of every line of
the corpus and of the whole file. The corpus holds invalid UTF-8 on purpose; Python reads it as
bytes.decode("utf-8", errors="replace").
"""
import json
import pathlib

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors, trainers

HERE = pathlib.Path(__file__).resolve().parent / "fixtures"

CORPUS_LINES = [
    "The quick brown fox jumps over the lazy dog. It's what they'd've done, isn't it?",
    "  Leading spaces, trailing spaces   ",
    "\tTabs\tand\t\tmore tabs\t",
    "Numbers: 1234567890 3.14159 -42 1e10 0x1F 12,345,678 and a long run 98765432109876543210",
    "def tokenize(text: str) -> list[int]:",
    "    return [vocab[t] for t in text.split()]  # comment",
    "if (x != nullptr && y->z[3] >= 0) { return std::move(w); }",
    "Hello<|endoftext|>world <|endoftext|> again",
    "A line with <s> and </s> inside, and <unk> too",
    "hello world said the hello world program; hello  world",
    "custom <|sp_l|> lstrip and <|sp_r|>   rstrip and <|sp_both|> both",
    "word words sword word. (word) wordy",
    "foo bar foobar  bar bar_baz",
    "Ünïcödé àccents: café naïve résumé façade",
    "Combining: cafe\u0301 n\u0303 a\u030a\u0323 q\u0307\u0323",
    "日本語のテキストです。東京は大きい都市です。",
    "中文文本：我喜欢学习自然语言处理。",
    "한국어 텍스트입니다",
    "العربية نص تجريبي مع أرقام ١٢٣",
    "हिन्दी में पाठ, देवनागरी लिपि",
    "Emoji: 😀 👍🏽 👨\u200d👩\u200d👧\u200d👦 🏳\ufe0f\u200d🌈 ❤\ufe0f",
    "Full width: ＡＢＣ １２３ ﬁ ligature ² ½ Ⅻ",
    "Mixed: abc日本def123ghi😀jkl",
    "",
    "   ",
    "Many    spaces     between      words",
    "Line with trailing newline run",
    "Quotes “double” ‘single’ «angle» — dash – en … ellipsis",
    "URL: https://example.com/path?q=1&r=2#frag email: a.b@c.org",
    "CamelCaseIdentifier snake_case_identifier kebab-case-identifier",
    "I'LL SHOUT IT'S WE'VE THEY'RE",
    "Turkish İstanbul ΣΊΣΥΦΟΣ Straße ǅemal",
]
# Invalid UTF-8: lone continuation bytes, truncated sequences, overlongs, surrogates, > U+10FFFF.
INVALID_LINES = [
    b"bad \x80 byte and \xff\xfe pair",
    b"truncated \xe6\x97 three and \xf0\x9f\x98 four",
    b"overlong \xc0\xaf and surrogate \xed\xa0\x80 and big \xf4\x90\x80\x80 end",
    b"\xe2\x82 euro cut then ok \xe2\x82\xac",
]


def corpus_bytes():
    lines = [line.encode() for line in CORPUS_LINES]
    lines[-3:-3] = INVALID_LINES
    text = b"\n".join(lines) + b"\n\n\n  \n\t\nend\n"
    return text


def train(model, pre_tokenizer, normalizer, text, vocab_size, byte_level, limit_alphabet=None,
          special=(), **trainer_args):
    tok = Tokenizer(model)
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    kwargs = dict(vocab_size=vocab_size, special_tokens=list(special), show_progress=False,
                  **trainer_args)
    if byte_level:
        kwargs["initial_alphabet"] = pre_tokenizers.ByteLevel.alphabet()
    if limit_alphabet is not None:
        kwargs["limit_alphabet"] = limit_alphabet
    tok.train_from_iterator([text] * 3, trainers.BpeTrainer(**kwargs))
    return tok


GPT2_RE = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
             r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
            r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

SP_TOKENS = [
    AddedToken("<|sp_l|>", special=True, lstrip=True, normalized=False),
    AddedToken("<|sp_r|>", special=True, rstrip=True, normalized=False),
    AddedToken("<|sp_both|>", special=True, lstrip=True, rstrip=True, normalized=False),
]
PLAIN_TOKENS = [
    AddedToken("hello world", normalized=True),
    AddedToken(" bar", normalized=False),
    AddedToken("word", single_word=True, normalized=False),
]


def byte_level_family(name, text, split_re, normalizer, bos, eos, ignore_merges, prefix_space,
                      use_split, specials):
    if use_split:
        pre = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split_re), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=prefix_space, trim_offsets=False,
                                     use_regex=False)])
    else:
        pre = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space, use_regex=True)
    tok = train(models.BPE(), pre, normalizer, text, 256 + 900, True, special=specials)
    tok.decoder = decoders.ByteLevel()
    if bos is not None:
        single = f"{bos}:0 $A:0" + (f" {eos}:0" if eos else "")
        pair = f"{bos}:0 $A:0" + (f" {eos}:0" if eos else "") + f" {bos}:1 $B:1"
        special_ids = [(bos, tok.token_to_id(bos))] + ([(eos, tok.token_to_id(eos))] if eos else [])
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=single, pair=pair, special_tokens=special_ids)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    data = json.loads(tok.to_str())
    if ignore_merges:
        data["model"]["ignore_merges"] = True
    return Tokenizer.from_str(json.dumps(data))


def byte_fallback_family(text, normalizer_style, prepend_scheme, split, eos):
    # Trained with a Metaspace pre-tokenizer (words; newlines removed, so that as in Llama 2's
    # vocabulary no merge involves a newline), then configured as the family is.
    tok = train(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True),
                pre_tokenizers.Sequence([
                    pre_tokenizers.Split("\n", behavior="removed"),
                    pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)]),
                None, text, 600, False, limit_alphabet=80, special=["<unk>", "<s>", "</s>"])
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    if normalizer_style == "prepend_replace":
        data["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
        data["pre_tokenizer"] = None
        data["decoder"] = {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    else:
        data["normalizer"] = {"type": "NFKC"} if split else None
        data["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁",
                                 "prepend_scheme": prepend_scheme, "split": split}
        data["decoder"] = {"type": "Sequence", "decoders": [
            {"type": "ByteFallback"}, {"type": "Metaspace", "replacement": "▁",
                                       "prepend_scheme": prepend_scheme, "split": split}]}
    tok = Tokenizer.from_str(json.dumps(data))
    single = "<s>:0 $A:0" + (" </s>:0" if eos else "")
    pair = "<s>:0 $A:0 <s>:1 $B:1"
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair,
        special_tokens=[("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))])
    return tok


def families(text):
    yield "gpt2", byte_level_family("gpt2", text, GPT2_RE, None, None, None, False, False, False,
                                    ["<|endoftext|>"]), \
        {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "add_bos_token": False}
    yield "llama3", byte_level_family(
        "llama3", text, LLAMA3_RE, None, "<|begin_of_text|>", None, True, False, True,
        ["<|begin_of_text|>", "<|end_of_text|>"]), \
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    yield "qwen2", byte_level_family(
        "qwen2", text, QWEN2_RE, normalizers.NFC(), None, None, False, False, True,
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]), \
        {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    yield "bytelevel_prefix_nfkc", byte_level_family(
        "bytelevel_prefix_nfkc", text, GPT2_RE, normalizers.NFKC(), "<bos>", "<eos>", False, True,
        False, ["<bos>", "<eos>", "<pad>"]), \
        {"bos_token": {"content": "<bos>", "special": True}, "eos_token": "<eos>",
         "pad_token": "<pad>"}
    yield "llama2", byte_fallback_family(text, "prepend_replace", None, False, False), \
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": False}
    yield "mistral", byte_fallback_family(text, "metaspace", "first", False, False), \
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    yield "metaspace_split", byte_fallback_family(text, "metaspace", "always", True, True), \
        {"bos_token": "<s>", "eos_token": "</s>"}


def variant_families(text):
    """Components the main families do not use, so that each supported one has a reference."""
    # WordPiece-like BPE: continuing_subword_prefix (tokenizers 0.23.3 panics loading a trained
    # model that also has an end_of_word_suffix, so that one has no fixture), <unk> without byte fallback or
    # fusing; NFD + Lowercase + Strip + regex Replace; Split with String and Regex patterns and
    # the MergedWithPrevious / MergedWithNext / Contiguous / Removed behaviors; Roberta
    # post-processor; no decoder (tokens joined by spaces).
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(" ", behavior="merged_with_previous"),
        pre_tokenizers.Split(Regex(r"[,.;:!?]"), behavior="merged_with_next"),
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="contiguous"),
        pre_tokenizers.Split(Regex(r"[\t\n]"), behavior="removed")])
    norm = normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase(), normalizers.Strip(),
                                 normalizers.Replace(Regex(r"\d{4,}"), "#")])
    tok = train(models.BPE(unk_token="<unk>", continuing_subword_prefix="##"), pre, norm, text,
                700, False, limit_alphabet=60, special=["<unk>", "<cls>", "<sep>"],
                continuing_subword_prefix="##")
    data = json.loads(tok.to_str())
    data["model"]["continuing_subword_prefix"] = "##"
    data["model"]["fuse_unk"] = False
    data["post_processor"] = {"type": "RobertaProcessing", "sep": ["<sep>", 2], "cls": ["<cls>", 1],
                              "trim_offsets": True, "add_prefix_space": False}
    yield "subword_split_variants", Tokenizer.from_str(json.dumps(data)), \
        {"bos_token": "<cls>", "eos_token": "<sep>", "pad_token": None}
    # Split with invert (the matches are the pieces), NFKD, fuse_unk without byte fallback,
    # Metaspace "never"; decoders Replace (regex) + Metaspace + Fuse + Strip.
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\w+|[^\w\s]+"), behavior="removed", invert=True),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)])
    tok = train(models.BPE(unk_token="<unk>", fuse_unk=True), pre, normalizers.NFKD(), text, 600,
                False, limit_alphabet=50, special=["<unk>", "<s>"])
    data = json.loads(tok.to_str())
    data["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"Regex": "▁+"}, "content": " "},
        {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "never", "split": False},
        # Strip with stop > 0 panics in tokenizers 0.23.3 on a token shorter than `stop`, so
        # only `start` has a reference here.
        {"type": "Fuse"}, {"type": "Strip", "content": "<", "start": 1, "stop": 0}]}
    data["post_processor"] = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        {"type": "TemplateProcessing",
         "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                    {"SpecialToken": {"id": "<s>", "type_id": 0}}],
         "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
         "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}]}
    yield "invert_nfkd_unk", Tokenizer.from_str(json.dumps(data)), {"bos_token": "<s>"}


def reference(tok, text):
    with_sp = tok.encode(text, add_special_tokens=True).ids
    without = tok.encode(text, add_special_tokens=False).ids
    return {"ids": without, "ids_special": with_sp,
            "decode": tok.decode(with_sp, skip_special_tokens=False),
            "decode_skip": tok.decode(with_sp, skip_special_tokens=True)}


def main():
    HERE.mkdir(parents=True, exist_ok=True)
    raw = corpus_bytes()
    (HERE / "corpus.txt").write_bytes(raw)
    text = raw.decode("utf-8", errors="replace")
    for name, tok, config in list(families(text)) + list(variant_families(text)):
        tok.add_special_tokens(SP_TOKENS)
        tok.add_tokens(PLAIN_TOKENS)
        out = HERE / name
        out.mkdir(exist_ok=True)
        tok.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
        lines = [line.decode("utf-8", errors="replace") for line in raw.split(b"\n")]
        ref = {"lines": [reference(tok, line) for line in lines], "whole": reference(tok, text),
               "vocab_size": tok.get_vocab_size(with_added_tokens=True),
               "id_to_token": {str(i): tok.id_to_token(i) for i in tok.get_added_tokens_decoder()}}
        (out / "reference.json").write_text(json.dumps(ref, ensure_ascii=False) + "\n")
        print(name, tok.get_vocab_size(with_added_tokens=True), len(ref["whole"]["ids"]))


if __name__ == "__main__":
    main()
