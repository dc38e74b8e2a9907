#!/usr/bin/env python3
"""Writes the byte-level BPE test fixture of tests/models/TestTokenizer.cpp:

  tests/data/tiny_bpe_tokenizer.json  a Hugging Face tokenizer.json laid out like GPT-NeoX's
                                      (special tokens <|endoftext|> = 0 and <|padding|> = 1, the 256
                                      byte tokens, BPE merges trained here on a small multilingual
                                      corpus, whitespace-run added tokens at the end, NFC normalizer,
                                      ByteLevel pre-tokenizer / decoder)
  tests/data/tiny_bpe_expected.json   encodings of test strings computed by an independent Python
                                      encoder (the `regex` module's \\p{L}/\\p{N} classes and GPT-2's
                                      original bpe() from openai/gpt-2 encoder.py)

Needs Python 3 and the `regex` module (Debian: python3-regex). Deterministic. Usage, from the
repository root:  python3 scripts/make_bpe_fixture.py
"""
import collections
import json
import os
import sys

import regex

GPT2_PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
NUM_MERGES = 400
SPECIAL = ["<|endoftext|>", "<|padding|>"]
WHITESPACE_TOKENS = [" " * 8, " " * 4]  # non-special added tokens, as GPT-NeoX's runs of spaces

CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog didn't care; it's been there before, and
they'll say we're tired of the same old story. I'm sure you've heard it: the fox, the dog, the end.
Mamba is a selective state space model. The state is updated token by token, and the model keeps
a fixed-size state while it reads the sequence. Tokens 12345 and 67890 were seen 3 times in 2024.
def forward(self, x):
    return self.out_proj(self.mixer(self.norm(x)))  # residual in fp32
    if x is None:
        raise ValueError("x must not be None")
Les élèves étudient à l'école; l'été dernier, ils sont allés à la mer. Çà et là, des cafés.
Über den Wolken muss die Freiheit wohl grenzenlos sein. Größe, Straße, schön, für, Mädchen.
Москва — столица России. Привет, мир! Съешь же ещё этих мягких французских булок.
Γειά σου κόσμε. Αυτό είναι ένα τεστ.
東京は日本の首都です。私は猫が好きです。今日はいい天気ですね。
北京是中国的首都。我喜欢学习机器学习。你好，世界！
서울은 한국의 수도입니다. 안녕하세요, 세계!
مرحبا بالعالم. هذا اختبار.
नमस्ते दुनिया। यह एक परीक्षण है।
Emoji: 😀 😂 🎉 👍 ❤️ 🚀 🐍 and flags 🇫🇷 🇯🇵, family 👨‍👩‍👧‍👦, skin tones 👋🏽.
Numbers: ١٢٣ ४५६ Ⅻ ½ ²³ and currency €100, £50, ¥1000, $3.50.
Tabs\tand\ttabs, new
lines, and    runs of     spaces        here.
"""

TEST_STRINGS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "it's, they'll, we're, I'm, you've, he'd, don't, 'S",
    "  leading spaces, trailing spaces   ",
    "a\nb\n\nc\r\n\td",
    "12345 67890 3.14159 2024",
    "def f(x):\n    return x  # comment\n        deep",
    "Les élèves étudient à l'école.",
    "Größe Straße",
    "Привет, мир!",
    "東京は日本の首都です。",
    "你好，世界！",
    "안녕하세요",
    "😀🎉 👍🏽 👨‍👩‍👧‍👦 🇫🇷",
    "<|endoftext|>",
    "text<|endoftext|>more text<|padding|><|endoftext|>",
    " <|endoftext|> spaced ",
    "x" + " " * 13 + "y",
    "Ⅻ ½ ²³ ١٢٣",
    "tab\there\u00a0nbsp\u3000ideographic space",
    "it\u0085's next\u0085line \u0085 x\x1cfile\ufeffbom\u200bzw",  # \s is White_Space: U+0085 yes, U+001C/FEFF/200B no
    "",
]


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


BYTE_ENCODER = bytes_to_unicode()


def to_byte_level(text):
    return "".join(BYTE_ENCODER[b] for b in text.encode("utf-8"))


def train(corpus):
    words = collections.Counter(tuple(to_byte_level(w)) for w in GPT2_PATTERN.findall(corpus))
    merges = []
    for _ in range(NUM_MERGES):
        pairs = collections.Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged = collections.Counter()
        for word, count in words.items():
            out = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return merges


def gpt2_bpe(token, ranks):
    """openai/gpt-2 encoder.py: bpe()."""
    word = tuple(token)
    pairs = set(zip(word, word[1:]))
    if not pairs:
        return [token]
    while True:
        bigram = min(pairs, key=lambda pair: ranks.get(pair, float("inf")))
        if bigram not in ranks:
            break
        first, second = bigram
        new_word = []
        i = 0
        while i < len(word):
            try:
                j = word.index(first, i)
                new_word.extend(word[i:j])
                i = j
            except ValueError:
                new_word.extend(word[i:])
                break
            if word[i] == first and i < len(word) - 1 and word[i + 1] == second:
                new_word.append(first + second)
                i += 2
            else:
                new_word.append(word[i])
                i += 1
        word = tuple(new_word)
        if len(word) == 1:
            break
        pairs = set(zip(word, word[1:]))
    return list(word)


def encode(text, vocab, ranks, added):
    """Added tokens first (leftmost, longest), then GPT-2 split + BPE of the pieces between them."""
    ids = []
    piece_start = 0
    i = 0
    by_length = sorted(added, key=len, reverse=True)
    while i < len(text):
        match = next((a for a in by_length if text.startswith(a, i)), None)
        if match is None:
            i += 1
            continue
        ids += encode_piece(text[piece_start:i], vocab, ranks)
        ids.append(added[match])
        i += len(match)
        piece_start = i
    return ids + encode_piece(text[piece_start:], vocab, ranks)


def encode_piece(text, vocab, ranks):
    ids = []
    for word in GPT2_PATTERN.findall(text):
        ids += [vocab[t] for t in gpt2_bpe(to_byte_level(word), ranks)]
    return ids


def main():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    merges = train(CORPUS)
    vocab = {token: i for i, token in enumerate(SPECIAL)}
    for b in range(256):
        vocab[BYTE_ENCODER[b]] = len(vocab)
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    added = dict((token, i) for i, token in enumerate(SPECIAL))
    for token in WHITESPACE_TOKENS:
        added[token] = len(vocab) + len(added) - len(SPECIAL)
    added_tokens = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                     "normalized": False, "special": True} for i, t in enumerate(SPECIAL)]
    added_tokens += [{"id": added[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": True, "special": False} for t in WHITESPACE_TOKENS]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "vocab": vocab, "merges": ["%s %s" % m for m in merges]},
    }
    ranks = {m: i for i, m in enumerate(merges)}
    expected = [{"text": s, "ids": encode(s, vocab, ranks, added)} for s in TEST_STRINGS]
    data = os.path.join(root, "tests", "data")
    os.makedirs(data, exist_ok=True)
    with open(os.path.join(data, "tiny_bpe_tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer, f, ensure_ascii=False, indent=1)
        f.write("\n")
    with open(os.path.join(data, "tiny_bpe_expected.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print("wrote %d merges, vocabulary %d + %d added" % (len(merges), len(vocab), len(WHITESPACE_TOKENS)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
