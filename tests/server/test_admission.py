"""Bounded work per request before admission: a prompt whose length alone proves it cannot fit is refused
without tokenizing it, a longer-than-the-context one after tokenizing only a prefix, tokenization runs off the event
loop (through the GIL-releasing batch call), the ids are those of a plain encode, and ``hetmoe serve`` on a busy
port fails before it reads a weight. No timing asserts: calls, pieces and threads are counted. The stall itself,
measured with real clients, is ``test_server.py::test_big_prompt_does_not_stall_the_server`` (slow tier)."""

import asyncio
import random
import socket
import subprocess
import sys
import threading
import unicodedata

import pytest

from hetmoe import tokenizer as tokenizer_module
from hetmoe.server import protocol
from hetmoe.server.protocol import APIError, ServedModel, prompt_encoder
from hetmoe.tokenizer import PromptTooLong, Tokenizer

CONTEXT = 256


class CountingBackend:
    """A tokenizers.Tokenizer that records every encode call: (method, characters, thread id)."""

    def __init__(self, backend):
        self._backend, self.calls = backend, []

    def encode(self, text, *args, **kwargs):
        self.calls.append(("encode", len(text), threading.get_ident()))
        return self._backend.encode(text, *args, **kwargs)

    def encode_batch(self, texts, *args, **kwargs):
        self.calls.append(("encode_batch", sum(map(len, texts)), threading.get_ident()))
        return self._backend.encode_batch(texts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._backend, name)


@pytest.fixture
def tok(qwen3_checkpoint):
    """The tiny checkpoint's tokenizer (byte-level BPE, 13-character longest token), its backend counting calls."""
    t = Tokenizer.from_dir(qwen3_checkpoint)
    t._tok = CountingBackend(t._tok)
    return t


def served(t: Tokenizer) -> ServedModel:
    return ServedModel(id="m", prompt_ids=prompt_encoder(t), max_context=CONTEXT, vocab_size=t.vocab_size,
                       has_chat_template=t.has_chat_template)


def refused(body: dict, s: ServedModel, kind: str) -> dict:
    with pytest.raises(APIError) as e:
        protocol.parse_request(body, s, kind)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded", e.value.body()
    return e.value.body()["error"]


def _texts(seed: int, n: int):
    rnd = random.Random(seed)
    words = ["the", " fox", " ", "\n", "  \n", "<|im_start|>", "<|im_", "déjà", "e\u0301", "\u1100\u1161\u11a8",
             "12345", "def", "(x):", "\t", "ünïcode", "a" * 40, " " * 33, "<|endoftext|>", "日本語", "🦊"]
    for _ in range(n):
        yield "".join(rnd.choice(words) for _ in range(rnd.randint(1, 3000)))


# ---------------------------------------------------------------- the bound from the vocabulary


def test_bound_is_the_longest_token(tok):
    vocab = tok._tok.get_vocab(with_added_tokens=True)
    assert tok.chars_per_token == max(len(t) for t in vocab) == len("<|endoftext|>")
    assert tok.min_tokens("") == 0 and tok.min_tokens("x") == 1 and tok.min_tokens("x" * 14) == 2


def test_bound_never_exceeds_the_count(tok):
    """min_tokens(text) <= len(encode(text)) for texts of every kind of piece (added tokens, cut added tokens,
    whitespace runs, combining marks, Hangul jamo, emoji), with and without special tokens."""
    for text in _texts(0, 40):
        assert tok.min_tokens(text) <= len(tok.encode(text, add_special_tokens=False)) <= len(tok.encode(text))


def test_bound_with_a_composing_normalizer(qwen3_checkpoint):
    """NFC can merge up to a full canonical decomposition into one character: the bound divides by that much."""
    from tokenizers import normalizers

    t = Tokenizer.from_dir(qwen3_checkpoint)
    t._tok.normalizer = normalizers.NFC()
    assert t.chars_per_token == 4 * len("<|endoftext|>")
    jamo = "\u1100\u1161\u11a8" * 2000  # three code points compose into one syllable
    for text in [jamo, *_texts(1, 10)]:
        assert t.min_tokens(text) <= len(t.encode(text))


def test_longest_canonical_decomposition():
    longest = max(len(unicodedata.normalize("NFD", chr(c))) for c in range(sys.maxunicode + 1)
                  if not 0xD800 <= c < 0xE000)
    assert tokenizer_module._MAX_DECOMPOSITION >= longest


@pytest.mark.parametrize("change", ["whitespace", "strip", "lstrip_token", "fused_unk"])
def test_no_bound_where_characters_can_vanish(qwen3_checkpoint, change):
    """A pre-tokenizer that drops whitespace, a normalizer that strips, an added token that swallows the spaces
    around it, unknown characters fused into one token: no length bound holds, so none is used (and a prompt is
    then only ever refused by counting)."""
    from tokenizers import AddedToken, models, normalizers, pre_tokenizers

    t = Tokenizer.from_dir(qwen3_checkpoint)
    if change == "whitespace":
        t._tok.pre_tokenizer = pre_tokenizers.Whitespace()
    elif change == "strip":
        t._tok.normalizer = normalizers.Strip()
    elif change == "lstrip_token":
        t._tok.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    else:
        t._tok.model = models.BPE({"a": 0, "<unk>": 1}, [], unk_token="<unk>", fuse_unk=True)
        t._tok.pre_tokenizer = None
        assert len(t._tok.encode(" " * 1000).ids) == 1  # why: a thousand characters, one token
    assert t.chars_per_token is None and t.min_tokens(" " * 10**6) == 0


# ---------------------------------------------------------------- refusal without tokenizing


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_oversize_prompt_is_refused_without_tokenizing(tok, kind):
    text = "The quick brown fox. " * 700_000  # 14.7 MB
    body = {"model": "m", "max_tokens": 1}
    if kind == "chat":
        body["messages"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    else:
        body["prompt"] = text
    err = refused(body, served(tok), kind)
    assert tok._tok.calls == []  # the tokenizer never saw it
    assert err["param"] == ("messages" if kind == "chat" else "prompt")
    assert "maximum context length is 256 tokens" in err["message"] and "at least" in err["message"]


def test_prompt_at_the_bound_is_accepted_with_plain_encode_ids(tok):
    """Longest tokens back to back: 255 of them (the bound says >= 255) fit and are tokenized, to the ids a plain
    encode gives; one character more and the bound (>= 256) refuses without tokenizing — the bound is tight."""
    s = served(tok)
    fits = "<|endoftext|>" * (CONTEXT - 1)
    assert tok.min_tokens(fits) == CONTEXT - 1
    parsed = protocol.parse_request({"model": "m", "prompt": fits, "max_tokens": 1}, s, "completion")
    assert parsed.prompt_ids == tok.encode(fits) and len(parsed.prompt_ids) == CONTEXT - 1
    assert [c[0] for c in tok._tok.calls] == ["encode_batch", "encode"]  # ours, then the plain one just above
    tok._tok.calls.clear()
    refused({"model": "m", "prompt": fits + "a", "max_tokens": 1}, s, "completion")
    assert tok._tok.calls == []


def test_engine_gets_plain_encode_ids(tok):
    s = served(tok)
    for text in _texts(2, 20):
        try:
            ids = s.prompt_ids(text, False, 10**6)
        except PromptTooLong:
            pytest.fail("a prompt under the cap was refused")
        assert ids == tok.encode(text)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello <|im_end|> there!"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True)
    parsed = protocol.parse_request({"model": "m", "messages": messages, "max_tokens": 1}, s, "chat")
    assert parsed.prompt_ids == tok.encode(rendered, add_special_tokens=False)


# ---------------------------------------------------------------- the capped tokenizer


def test_capped_tokenizer_stops_early(tok, monkeypatch):
    """A text the length bound lets through but that has far more tokens than the cap: tokenized in doubling
    prefixes only until one proves more than the cap; the whole text is never encoded."""
    monkeypatch.setattr(tokenizer_module, "CAPPED_FIRST_PIECE", 4096)
    text = "".join(_texts(3, 40))
    total = len(tok.encode(text))
    cap = total // 8
    assert tok.min_tokens(text) <= cap  # the bound is loose on ordinary text: this cap passes it
    tok._tok.calls.clear()
    with pytest.raises(PromptTooLong) as e:
        tok.encode_capped(text, cap)
    assert cap < e.value.at_least <= total and not e.value.exact
    pieces = [n for _, n, _ in tok._tok.calls]
    assert pieces == [4096 * 2**i for i in range(len(pieces))]  # doubling prefixes, every one a proper prefix
    assert pieces[-1] < len(text) and sum(pieces) < len(text) // 2


def test_capped_equals_plain_at_every_cap(tok, monkeypatch):
    """Across caps at and around the true count, through several prefixes: the ids of a plain encode when they
    fit, else PromptTooLong with a lower bound that holds."""
    monkeypatch.setattr(tokenizer_module, "CAPPED_FIRST_PIECE", 512)
    for text in _texts(4, 12):
        want = tok.encode(text)
        for cap in (len(want), len(want) - 1, len(want) // 2, len(want) // 8):
            try:
                assert tok.encode_capped(text, cap) == want and len(want) <= cap
            except PromptTooLong as e:
                assert cap < len(want) and cap < e.at_least <= len(want)


def test_exact_count_in_the_message_when_tokenized_whole(tok):
    err = refused({"model": "m", "prompt": "word " * 300, "max_tokens": 1}, served(tok), "completion")
    assert f"your prompt is {len(tok.encode('word ' * 300))} tokens" in err["message"]


def test_token_id_prompt_over_the_context(tok):
    err = refused({"model": "m", "prompt": [1] * 10**6, "max_tokens": 1}, served(tok), "completion")
    assert "your prompt is 1000000 tokens" in err["message"]


# ---------------------------------------------------------------- off the event loop


class FakeScheduler:
    """Answers every request at once; keeps the prompt ids the engine would get."""

    def __init__(self):
        from hetmoe.server.metrics import Metrics

        self.metrics, self.prompts = Metrics(), []

    def submit(self, req):
        self.prompts.append(req.prompt_ids)
        req.emit("done", "length", len(req.prompt_ids), 0)
        return req


def test_tokenization_runs_off_the_event_loop(tok):
    from aiohttp.test_utils import TestClient, TestServer

    from hetmoe.server.app import create_app

    scheduler = FakeScheduler()
    app = create_app(served(tok), scheduler)
    prompt = "def forward(self, x): " * 10

    async def run():
        loop_thread = threading.get_ident()
        async with TestClient(TestServer(app)) as client:
            r = await client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1})
            assert r.status == 200, await r.text()
        return loop_thread

    loop_thread = asyncio.run(run())
    assert [c[0] for c in tok._tok.calls] == ["encode_batch"]  # the call that releases the GIL
    assert tok._tok.calls[0][2] != loop_thread
    assert scheduler.prompts == [tok.encode(prompt)]


# ---------------------------------------------------------------- bind before load


def test_busy_port_fails_before_loading(qwen3_checkpoint, tmp_path, isolated_env):
    """The weights of this checkpoint cannot be read: had serve loaded it, the error would name a safetensors file."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(qwen3_checkpoint, broken)
    shards = list(broken.glob("*.safetensors"))
    assert shards
    for shard in shards:
        shard.write_bytes(b"not a safetensors file")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "hetmoe", "serve", "--port", str(port), "--model", str(broken),
                            "--device", "cpu", "--expert-cache", "off"], capture_output=True, text=True,
                           env=isolated_env, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines() == [f"hetmoe serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"]


def test_bind_holds_the_port():
    """What serve binds before loading is ours: a second server (SO_REUSEADDR, as asyncio's) cannot take it."""
    from hetmoe.server.main import bind

    sockets = bind("127.0.0.1", 0)
    try:
        port = sockets[0].getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
            bind("127.0.0.1", port)
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # queued in the backlog, not refused
    finally:
        for s in sockets:
            s.close()
