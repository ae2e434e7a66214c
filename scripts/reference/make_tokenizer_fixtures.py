#!/usr/bin/env python3
"""Makes the tokenizer reference fixtures under tests/fixtures/tokenizers/.

Two small real tokenizers are trained on the fortunes corpus (Debian package `fortunes`):
  gpt2/vocab.json, gpt2/merges.txt  a byte-level BPE (HF `tokenizers` ByteLevelBPETokenizer, vocab
                                    1000, with <|endoftext|>), read back by HF's GPT2Tokenizer;
  spm/tokenizer.model               a SentencePiece BPE (vocab 512) set up like Llama's: identity
                                    normalization, extra white space kept, digits split, byte fallback.
Then a set of tricky texts (contractions, numbers, accents, CJK, emoji, runs of spaces, newlines,
tabs, trailing white space, Unicode spaces, <|endoftext|> inside text) is encoded by the reference
implementations (transformers' GPT2Tokenizer, which runs the GPT-2 regex through the `regex` module;
and the `sentencepiece` Python package) and saved with the expected ids, the regex pieces and the
reference decodes as gpt2_cases.json and spm_cases.json. models/text/*.test.cpp compares troupe's
tokenizers against these files.

Needs transformers, tokenizers, sentencepiece and regex for /usr/bin/python3. Run from the
repository root:  /usr/bin/python3 scripts/reference/make_tokenizer_fixtures.py
"""
import json
import os
import sys
import tempfile

import regex
import sentencepiece as spm
import tokenizers
import transformers
from tokenizers import ByteLevelBPETokenizer
from transformers import GPT2Tokenizer

FORTUNES = "/usr/share/games/fortunes"
OUT = "tests/fixtures/tokenizers"
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

TEXTS = [
    "",
    "Hello world",
    "Hello, world! How are you?",
    "I'm sure you'll see they've said it's what we'd do, can't you? You're right.",
    "'s 't 're 've 'm 'll 'd 'S 'T 'RE 'x ''s !'s ' s",
    "IT'S DON'T o'clock rock'n'roll",
    "3.14159 1,000,000 42nd 2024-11-22 0x1F 1e-5 007",
    "café naïve Zürich façade señor Ærøskøbing",
    "cafe\u0301 (a decomposed e + combining acute)",
    "日本語のテキスト、中文字符，한국어 텍스트。",
    "emoji: 👍🏽 🎉🎉 🇫🇷 ❤️ 👨‍👩‍👧",
    "math: ∑ x² ½ ⅓ Ⅻ ٣٤ ①②",
    "Ελληνικά Русский текст مرحبا بالعالم नमस्ते สวัสดี",
    "a  b   c    d     e",
    "line one\nline two\n\n\nline five\n",
    "\tindented\t\ttext\t",
    "trailing spaces   ",
    "   leading spaces",
    "   \n\t \n  ",
    " ",
    "\n",
    "mixed \r\n line endings\r\n",
    "nbsp\u00a0here, ideographic\u3000space, line\u2028separator, next\u0085line",
    "controls \x1c\x1d\x1e\x1f and \x0b\x0c form feeds",
    "<|endoftext|>",
    "first document<|endoftext|>second document<|endoftext|> third",
    "for (int i = 0; i < n; ++i) {\n    x += y[i];  // sum\n}\n",
    "https://example.com/path?q=1&r=2 user@example.org",
    "Supercalifragilisticexpialidocious antidisestablishmentarianism",
    "don't!!! ??? ... --- ***",
    "'''quoted''' \"double\" `back`",
    "ALL CAPS and MiXeD cAsE",
]


def read_corpus():
    parts = []
    for name in sorted(os.listdir(FORTUNES)):
        path = os.path.join(FORTUNES, name)
        if name.endswith(".dat") or os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = ["" if line.rstrip("\n") == "%" else line.rstrip("\n") for line in f]
        parts.append("\n".join(lines))
    return "\n".join(parts)


def main():
    corpus = read_corpus()
    # A real passage too: the first fortunes of one file, with their blank lines and punctuation.
    passage = corpus[:1500]
    texts = TEXTS + [passage]
    os.makedirs(f"{OUT}/gpt2", exist_ok=True)
    os.makedirs(f"{OUT}/spm", exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        corpus_path = os.path.join(tmp, "fortunes.txt")
        with open(corpus_path, "w", encoding="utf-8") as f:
            f.write(corpus)

        bpe = ByteLevelBPETokenizer()  # add_prefix_space=False, as GPT-2
        bpe.train([corpus_path], vocab_size=1000, min_frequency=2,
                  special_tokens=["<|endoftext|>"], show_progress=False)
        bpe.save_model(f"{OUT}/gpt2")

        spm.SentencePieceTrainer.train(
            input=corpus_path, model_prefix=os.path.join(tmp, "tokenizer"), vocab_size=512,
            model_type="bpe", character_coverage=0.9995, byte_fallback=True,
            normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
            allow_whitespace_only_pieces=True, max_sentence_length=1 << 14, num_threads=1,
            minloglevel=2)
        with open(os.path.join(tmp, "tokenizer.model"), "rb") as f:
            model_bytes = f.read()
    with open(f"{OUT}/spm/tokenizer.model", "wb") as f:
        f.write(model_bytes)

    gpt2 = GPT2Tokenizer(f"{OUT}/gpt2/vocab.json", f"{OUT}/gpt2/merges.txt")
    pattern = regex.compile(GPT2_PATTERN)
    cases = []
    for text in texts:
        ids = gpt2.encode(text)
        cases.append({
            "text": text,
            "pieces": pattern.findall(text),
            "ids": ids,
            "decoded": gpt2.decode(ids, clean_up_tokenization_spaces=False),
        })
    meta = {
        "generator": "scripts/reference/make_tokenizer_fixtures.py",
        "reference": f"transformers {transformers.__version__} GPT2Tokenizer, "
                     f"regex {regex.__version__}, trained with tokenizers {tokenizers.__version__}",
        "vocab_size": len(gpt2.encoder),
        "eos_id": gpt2.eos_token_id,
    }
    with open(f"{OUT}/gpt2_cases.json", "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "cases": cases}, f, ensure_ascii=False, indent=0)

    sp = spm.SentencePieceProcessor(model_file=f"{OUT}/spm/tokenizer.model")
    cases = []
    for text in texts:
        ids = sp.encode(text)
        cases.append({"text": text, "ids": ids, "decoded": sp.decode(ids)})
    meta = {
        "generator": "scripts/reference/make_tokenizer_fixtures.py",
        "reference": f"sentencepiece {spm.__version__} (Python)",
        "vocab_size": sp.get_piece_size(),
        "bos_id": sp.bos_id(),
        "eos_id": sp.eos_id(),
    }
    with open(f"{OUT}/spm_cases.json", "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "cases": cases}, f, ensure_ascii=False, indent=0)

    total = 0
    for root, _, files in os.walk(OUT):
        for name in files:
            total += os.path.getsize(os.path.join(root, name))
    print(f"{OUT}: {len(texts)} texts, {total / 1024:.1f} KiB in all")


if __name__ == "__main__":
    sys.exit(main())
