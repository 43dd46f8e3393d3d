"""Kimi's tokenizer layout: tiktoken.model (base64 token + rank a line) with the special tokens in
tokenizer_config.json, no tokenizer.json. hetmoe builds a byte-level BPE from the ranks; its ids and text are
compared with the ``tiktoken`` library's own encoding of the same ranks, split pattern and special tokens over varied
text. The ranks are learned by a small BPE trainer below (plus a few whole-word tokens made up), so merges overlap
the way a real vocabulary's do. A damaged tiktoken.model is refused naming the file and the line."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import pytest

from hetmoe.tokenizer import KIMI_PATTERN, KIMI_SPECIAL_TOKENS, IncrementalDecoder, Tokenizer

CORPUS = (
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX! I'll say it's what they've done, don't "
    "you think? We're here; you'd know. Numbers: 0 1 12 123 1234 12345 3.14159 2024-06-01 $1,000,000.\n"
    "Écoles, naïve café, façade, Straße, ÆØÅ æøå. Привет, как дела? Γειά σου κόσμε. مرحبا بالعالم. "
    "你好世界，今天天气很好。我们一起学习中文。日本語のテキストも少し。한국어 문장입니다. "
    "def main():\n    return [x ** 2 for x in range(10)]  # squares\n\n\tif a != b:\n\t\tprint('x')\n"
    "emoji 🙂🚀👍🏽 and e\u0301 combining marks; tabs\t\tand   spaces   \r\n\r\nend.\n"
) * 3
SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 6: "<|im_system|>",
            7: "<|im_middle|>", 256: "[UNK]", 257: "[PAD]"}  # offsets past the ranks, the way Kimi lays them out
TEMPLATE = ("{% for m in messages %}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>"
            "{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}")


def _train(text: str, n_merges: int) -> list[bytes]:
    """Byte-level BPE training inside the pieces of Kimi's split: the 256 bytes, then the most frequent adjacent
    pair (ties by bytes) merged ``n_merges`` times. Tokens by rank."""
    regex = pytest.importorskip("regex")
    words: dict[tuple, int] = {}
    for piece in regex.findall(KIMI_PATTERN, text):
        key = tuple(bytes([b]) for b in piece.encode())
        words[key] = words.get(key, 0) + 1
    tokens = [bytes([b]) for b in range(256)]
    for _ in range(n_merges):
        pairs: dict[tuple, int] = {}
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] = pairs.get(pair, 0) + count
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        tokens.append(best[0] + best[1])
        merged = {}
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + count
        words = merged
    return tokens


@pytest.fixture(scope="module")
def ranks() -> list[bytes]:
    tokens = _train(CORPUS, 400)
    # whole words no merge leads to: tiktoken takes a piece that is a token as is
    for extra in (" lazy dog", "Straße", " 天气很好", "quick"):
        if extra.encode() not in tokens:
            tokens.append(extra.encode())
    return tokens


def _write(path: Path, ranks: list[bytes], config: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(t).decode()} {r}" for r, t in enumerate(ranks)]
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    n = len(ranks)
    if config is None:
        config = {"bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
                  "chat_template": TEMPLATE,
                  "added_tokens_decoder": {str(n + k): {"content": v, "special": True} for k, v in SPECIALS.items()}}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory, ranks) -> Path:
    return _write(tmp_path_factory.mktemp("kimi"), ranks)


@pytest.fixture(scope="module")
def reference(ranks):
    """tiktoken's own encoding of the same ranks, split and special tokens, as tokenization_kimi.py builds it."""
    tiktoken = pytest.importorskip("tiktoken", reason="the reference encoding is tiktoken's (pip install tiktoken)")
    n = len(ranks)
    special = {f"<|reserved_token_{i}|>": i for i in range(n, n + KIMI_SPECIAL_TOKENS) if i - n not in SPECIALS}
    special.update({v: n + k for k, v in SPECIALS.items()})
    return tiktoken.Encoding(name="kimi-test", pat_str=KIMI_PATTERN, special_tokens=special,
                             mergeable_ranks={t: r for r, t in enumerate(ranks)})


def _texts() -> list[str]:
    fixed = [
        "", " ", "   ", "\n", "\n\n\n", " \t \n  \r\n", "a  b   c\n\n  d", "trailing   ", "   leading",
        "Hello, World! I'LL DO IT, you'll see; it's THEIR'S.", "don't Don'T DON'T",
        "12 123 1234 12345678901 3.14159 -42 1e10 ½ ² ٣٤ 四五六",
        "你好世界abc你好 中文English混合123", "日本語テキスト", "Ελληνικά ΚΕΦΑΛΑΙΑ ünïcödé ÉCOLEéte",
        "e\u0301\u0302 combining, Zalgo: Z\u0351\u0352a\u0353l", "🙂🚀👍🏽 emoji 👨‍👩‍👧‍👦 flags 🇫🇷",
        "\u200b\ufeff\u00a0nbsp",
        "[BOS]hello[EOS]", "<|im_user|>user<|im_middle|>hi there<|im_end|><|im_assistant|>", "x<|im_end|>y",
        "<|reserved_token_99999|> not a real one", "def f(x):\n\treturn x**2  # ok\n",
        "The quick brown fox jumps over the lazy dog", " lazy dog", "Straße 天气很好", "\x00\x01\x7f control",
    ]
    rng = random.Random(1234)
    alphabet = sorted(set(CORPUS)) + ["\u4e00", "\U0001F600", "[", "<|im_end|>", "'s", "'LL"]
    fuzz = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(300)]
    windows = [CORPUS[i:i + rng.randint(1, 200)] for i in (rng.randrange(len(CORPUS)) for _ in range(100))]
    return fixed + fuzz + windows + [CORPUS]


def test_ids_and_text_match_tiktoken(kimi_dir, reference):
    tok = Tokenizer.from_dir(kimi_dir)
    for text in _texts():
        want = reference.encode(text, allowed_special="all")
        assert tok.encode(text, add_special_tokens=False) == want, text
        assert tok.encode(text) == want, text  # no bos is added: Kimi's encode adds none
        assert tok.decode(want, skip_special_tokens=False) == reference.decode(want) == text, text


def test_special_tokens_take_kimis_ids(kimi_dir, ranks):
    tok = Tokenizer.from_dir(kimi_dir)
    n = len(ranks)
    assert tok.vocab_size == n + KIMI_SPECIAL_TOKENS
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (n, n + 1, n + 257)
    assert tok.eos_ids == {n + 1}
    assert tok.token_to_id("<|im_middle|>") == n + 7
    assert tok.token_to_id(f"<|reserved_token_{n + 5}|>") == n + 5  # unnamed ones keep tokenization_kimi.py's name
    assert tok.decode([n + 2, n + 3]) == ""  # special: skipped by default
    assert tok.token_bytes(n + 2) == b"<|im_end|>"


def test_every_token_decodes_to_its_bytes(kimi_dir, ranks):
    tok = Tokenizer.from_dir(kimi_dir)
    assert [tok.token_bytes(i) for i in range(len(ranks))] == ranks


def test_chat_template_and_streaming(kimi_dir, reference):
    tok = Tokenizer.from_dir(kimi_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好 <|im_end|> 🙂"}]
    text = tok.apply_chat_template(messages)
    assert text.startswith("<|im_system|>system<|im_middle|>Be brief.<|im_end|>")
    assert tok.encode_chat(messages) == reference.encode(text, allowed_special="all")
    split = tok.encode_chat(messages, split_special_tokens=True)  # the message's <|im_end|> is plain text
    assert split.count(tok.token_to_id("<|im_end|>")) == 2
    assert tok.decode(split, skip_special_tokens=False) == text
    ids = reference.encode("naïve 你好世界 🙂🚀 done", allowed_special="all")
    stream = IncrementalDecoder(tok)
    assert "".join(stream.push(i) for i in ids) + stream.flush() == "naïve 你好世界 🙂🚀 done"


def test_min_tokens_is_a_lower_bound(kimi_dir):
    tok = Tokenizer.from_dir(kimi_dir)
    for text in _texts():
        assert tok.min_tokens(text) <= len(tok.encode(text, add_special_tokens=False)), text


def test_the_loader_reads_it_and_notes_ids_without_embedding(kimi_dir, ranks):
    from hetmoe.load.loader import load_tokenizer

    notes: list[str] = []
    tok = load_tokenizer(kimi_dir, {"vocab_size": len(ranks) + 256}, notes.append)
    assert tok.encode("The quick") == Tokenizer.from_dir(kimi_dir).encode("The quick")
    assert len(notes) == 1 and "tiktoken.model has" in notes[0] and f"ids from {len(ranks) + 256} on" in notes[0]


def _lines(ranks: list[bytes]) -> list[str]:
    return [f"{base64.b64encode(t).decode()} {r}" for r, t in enumerate(ranks)]


BYTES = [bytes([b]) for b in range(256)] + [b"ab", b"abc"]
DAMAGED = {
    "not-base64": (lambda ls: ls[:3] + ["@@@@ 3"] + ls[4:], r"line 4: '@@@@' is not base64"),
    "one-field": (lambda ls: ls[:9] + [ls[9].split()[0]] + ls[10:], r"line 10: expected 'base64-token rank'"),
    "three-fields": (lambda ls: ls + ["YWJjZA== 258 x"], r"line 259: expected 'base64-token rank'"),
    "rank-not-integer": (lambda ls: ls[:-1] + [ls[-1].split()[0] + " 2x"], r"line 258: the rank '2x' is not a"),
    "negative-rank": (lambda ls: ls[:-1] + [ls[-1].split()[0] + " -1"], r"line 258: the rank '-1' is not a"),
    "token-twice": (lambda ls: ls + [ls[256].split()[0] + " 258"], r"line 259: token b'ab' again \(first on line 257"),
    "rank-twice": (lambda ls: ls + ["YWJjZA== 5"], r"line 259: rank 5 again \(first on line 6\)"),
    "rank-gap": (lambda ls: ls + ["YWJjZA== 300"], r"ranks must run 0..258 without gaps; rank 258 is missing"),
    "byte-missing": (lambda ls: [ls[0]] + [f"{ls[i].split()[0]} {i - 1}" for i in range(2, len(ls))],
                     r"the single bytes \[1\] are not tokens"),
    "padding-only": (lambda ls: ls + ["= 258"], r"line 259: '=' is not base64"),
    "empty": (lambda ls: ["", "  "], r"holds no tokens"),
}


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_a_damaged_tiktoken_file_is_refused_naming_file_and_line(tmp_path, case):
    edit, message = DAMAGED[case]
    path = _write(tmp_path, BYTES, config={})
    (path / "tiktoken.model").write_text("\n".join(edit(_lines(BYTES))) + "\n")
    with pytest.raises(ValueError, match=r"tiktoken\.model.*" + message):
        Tokenizer.from_dir(path)


def test_a_binary_file_is_refused(tmp_path):
    path = _write(tmp_path, BYTES, config={})
    (path / "tiktoken.model").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    with pytest.raises(ValueError, match=r"tiktoken\.model line 1: expected 'base64-token rank', got '.PNG'"):
        Tokenizer.from_dir(path)


def test_the_blank_lines_tiktoken_skips_are_skipped(tmp_path):
    path = _write(tmp_path, BYTES, config={})
    (path / "tiktoken.model").write_text("\n" + "\n\n".join(_lines(BYTES)) + "\n\n")
    tok = Tokenizer.from_dir(path)
    assert tok.encode("abcab") == [len(BYTES) - 1, len(BYTES) - 2]


@pytest.mark.parametrize("decoder, message", [
    ({"600": {"content": "<|late|>"}}, r"added token '<\|late\|>' has id 600; tiktoken.model leaves ids 258..515"),
    ({"5": {"content": "<|early|>"}}, r"added token '<\|early\|>' has id 5"),
    ({"258": {"content": "ab"}}, r"special token 'ab' cannot have id 258: its text is another token's too"),
    ({"258": {"content": "<|x|>"}, "259": {"content": "<|x|>"}}, r"special token '<\|x\|>' cannot have id 25[89]"),
    ({"two": {"content": "<|x|>"}}, r"added_tokens_decoder entry 'two'"),
    ([1, 2], r"added_tokens_decoder must be an object"),
])
def test_inconsistent_special_tokens_are_refused(tmp_path, decoder, message):
    path = _write(tmp_path, BYTES, config={"added_tokens_decoder": decoder})
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: " + message):
        Tokenizer.from_dir(path)


def test_no_tokenizer_file_at_all_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no tokenizer.json in .* \(nor Kimi's tiktoken.model\)"):
        Tokenizer.from_dir(tmp_path)
