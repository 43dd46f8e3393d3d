"""engine/grammar.py: xgrammar constraints over the built-in model's vocabulary (CPU). A constrained random walk
(random logits, a token drawn among those the mask leaves) must produce text that is valid JSON matching the schema,
for several schemas and seeds; the CPU bit-unpacking is compared with a naive per-token reference; the caps refuse
oversized schemas and slow compiles; the cache compiles each schema once."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from schema_check import validate

from hetmoe.config.options import EngineOptions
from hetmoe.engine import grammar, scheduler
from hetmoe.engine.llm import LLM, default_model_path
from hetmoe.engine.sampler import SamplingParams, TokenConstraint
from hetmoe.tokenizer import Tokenizer
from paths import BEST_ROW_PATH

V = 8192  # the built-in model's vocabulary (config.json)

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
    "kind": {"enum": ["cat", "dog"]}}, "required": ["name", "age", "kind"], "additionalProperties": False}
COORD = {"type": "integer", "minimum": -1000, "maximum": 1000}  # unbounded numbers let a random walk go on and on
NESTED = {"$defs": {"point": {"type": "object", "properties": {"x": COORD, "y": COORD},
                              "required": ["x", "y"], "additionalProperties": False}},
          "type": "object", "properties": {"a": {"$ref": "#/$defs/point"},
                                           "b": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/point"}]},
                                           "ok": {"type": "boolean"}},
          "required": ["a", "b", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(default_model_path())


@pytest.fixture(scope="module")
def grammars(tok):
    return grammar.Grammars(tok, V)


def walk(constraint, tok, seed: int, max_tokens: int = 400) -> str:
    """Random logits each step, masked, a token drawn among the allowed ones (stop tokens end the walk)."""
    gen = torch.Generator().manual_seed(seed)
    ids = []
    for _ in range(max_tokens):
        logits = torch.randn(V, generator=gen) * 3
        # favour closing: a random walk over JSON otherwise nests and writes strings for a long time
        logits[[tok.token_to_id(t) for t in ("}", "]", '"', "Ġ}") if tok.token_to_id(t) is not None]] += 4
        constraint.mask(logits)
        allowed = torch.isfinite(logits)
        assert allowed.any()
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        if token in tok.eos_ids:
            break
        constraint.accept(token)
        ids.append(token)
        if constraint.is_terminated():
            break
    else:
        pytest.fail(f"no end within {max_tokens} tokens: {tok.decode(ids)!r}")
    return tok.decode(ids)


@pytest.mark.parametrize("schema", [PERSON, NESTED, {"type": "object"}], ids=["person", "nested", "object"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_walk_follows_the_schema(grammars, tok, schema, seed):
    factory = grammars.json_schema(schema)
    c = factory()
    assert isinstance(c, TokenConstraint)
    text = walk(c, tok, seed)
    validate(json.loads(text), schema)


def test_structural_tag_after_a_reasoning_block(grammars, tok):
    """``after``: free text up to the end tag, then the schema."""
    c = grammars.json_schema(PERSON, after="</think>")()
    for t in tok.encode("let me think</think>\n", add_special_tokens=False):
        c.accept(t)
    text = walk(c, tok, 5)
    validate(json.loads(text), PERSON)


def _allowed(c) -> set:
    logits = torch.zeros(V)
    c.mask(logits)
    return set(torch.nonzero(logits > float("-inf"))[:, 0].tolist())


def test_special_tokens_are_text_only_when_shown(tok):
    """A special token is no text to a grammar (the decoder skips it) unless the grammars are built showing it:
    then the grammar lets the model write that text as the one token (a tool-call marker), and no other special
    token."""
    im_start = tok.token_to_id("<|im_start|>")
    fmt = {"type": "const_string", "value": "<|im_start|>ok"}
    hidden = grammar.Grammars(tok, V).structural_tag(fmt)()
    first = _allowed(hidden)
    assert im_start not in first and first  # only the plain tokens that spell it ("<", "<|" ...)
    shown = grammar.Grammars(tok, V, shown_special_ids={im_start}).structural_tag(fmt)()
    assert _allowed(shown) == first | {im_start}
    shown.accept(im_start)
    for t in tok.encode("ok", add_special_tokens=False):
        shown.accept(t)
    assert _allowed(shown) == tok.eos_ids & set(range(V))  # complete: the stop tokens alone
    inside = grammar.Grammars(tok, V, shown_special_ids={im_start}).json_schema({"type": "string"})()
    inside.accept(tok.encode('"', add_special_tokens=False)[0])
    assert im_start in _allowed(inside) and not _allowed(inside) & {t for t in tok.eos_ids if t != im_start}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bitmask_unpacking_matches_a_naive_reference(device):
    """apply_bitmasks: every row of a batch masked by its own bitmask, bits past V unread."""
    gen = torch.Generator().manual_seed(0)
    for vocab in (1, 31, 32, 33, 1000, V):
        for rows in (1, 3):
            words = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
            logits = torch.randn(rows, vocab, generator=gen)
            ref = logits.clone()
            for r in range(rows):
                for j in range(vocab):
                    if not (int(words[r, j // 32]) >> (j % 32)) & 1:
                        ref[r, j] = float("-inf")
            out = logits.to(device)
            grammar.apply_bitmasks(out, words)
            assert torch.equal(out.cpu(), ref), (vocab, rows)


def test_the_host_side_check_of_a_mask_matches_a_naive_reference():
    """_allows_some: whether any of the first V bits is set (bits past V, in the last word, do not count)."""
    gen = torch.Generator().manual_seed(1)
    for vocab in (1, 31, 32, 33, 95, 1000):
        n = (vocab + 31) // 32
        for bit in list(range(n * 32)) + [None]:
            words = torch.zeros(n, dtype=torch.int32)
            if bit is not None:
                words[bit // 32] = torch.tensor(1 << (bit % 32), dtype=torch.int64).to(torch.int32)
            assert grammar._allows_some(words, vocab) == (bit is not None and bit < vocab), (vocab, bit)
        words = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=gen)
        naive = any((int(words[j // 32]) >> (j % 32)) & 1 for j in range(vocab))
        assert grammar._allows_some(words, vocab) == naive


def test_prepare_fills_the_mask_once_and_mask_applies_it(grammars, tok, monkeypatch):
    """prepare() (the scheduler's call while the GPU computes) fills the bitmask; mask() then applies that mask
    without filling again, says it checked on the host (True), and the next position needs a new fill."""
    c = grammars.json_schema(PERSON)()
    fills = []
    matcher = c._matcher

    class Counting:
        def __getattr__(self, name):
            return getattr(matcher, name)

        def fill_next_token_bitmask(self, *args):
            fills.append(1)
            return matcher.fill_next_token_bitmask(*args)

    c._matcher = Counting()
    c.prepare()
    c.prepare()
    logits = torch.zeros(V)
    assert c.mask(logits) is True and len(fills) == 1
    brace = tok.encode("{", add_special_tokens=False)[0]
    assert torch.isfinite(logits[brace]) and not torch.isfinite(logits).all()
    c.accept(brace)
    c.mask(torch.zeros(V))
    assert len(fills) == 2


def test_a_token_the_grammar_refuses_is_an_error(grammars, tok):
    c = grammars.json_schema(PERSON)()
    with pytest.raises(ValueError, match="does not follow the grammar"):
        c.accept(tok.encode("hello", add_special_tokens=False)[0])
    with pytest.raises(ValueError, match="expects logits"):
        c.mask(torch.zeros(V + 1))


def test_each_schema_is_compiled_once(grammars):
    schema = {"type": "object", "properties": {"unique_to_this_test": {"type": "integer"}}}
    misses, hits = grammars.misses, grammars.hits
    first = grammars.json_schema(schema)
    again = grammars.json_schema(json.loads(json.dumps(schema, sort_keys=True)))  # the same schema, keys reordered
    assert grammars.misses == misses + 1 and grammars.hits == hits + 1
    assert again.compiled is first.compiled


def _nest(depth):
    s = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}}
    return s


@pytest.mark.parametrize("schema, message", [
    (_nest(10_000), "nested more than"),
    ({"enum": [f"v{i}" for i in range(50_000)]}, "enum/const values"),
    ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3000)}}, "object properties"),
    ({"type": "string", "description": "x" * 300_000}, "characters of JSON"),
    ({"type": "strin"}, "strin"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
])
def test_schemas_over_the_caps_or_invalid_are_refused(grammars, schema, message):
    with pytest.raises(grammar.GrammarError, match=message):
        grammars.json_schema(schema)


def test_a_slow_compile_is_cut_at_the_cap_and_the_next_waits_busy(tok):
    g = grammar.Grammars(tok, V, grammar.Caps(compile_s=0.02))
    slow = {"enum": [f"value number {i}" for i in range(4000)]}  # a few hundred ms to compile here
    with pytest.raises(grammar.GrammarError, match="did not compile within"):
        g.json_schema(slow)
    # the slow compile still holds the compiler: the next request cannot start within its own 20 ms
    with pytest.raises(grammar.GrammarBusy):
        g.json_schema({"type": "integer"})


def test_matchers_run_in_parallel_threads(grammars, tok):
    """One compiled grammar, a fresh matcher per sequence: sequences in other threads do not interfere."""
    factory = grammars.json_schema(PERSON)
    texts: dict = {}

    def run(seed):
        texts[seed] = walk(factory(), tok, seed)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(texts) == {0, 1, 2, 3}
    for seed, text in texts.items():
        validate(json.loads(text), PERSON)
        assert text == walk(factory(), tok, seed)  # the same walk alone


def test_grammar_rows_of_a_step_are_masked_together_and_equal_each_alone(grammars, monkeypatch):
    """In a decode step the constraints' bitmasks are filled inside the runner's call (``meanwhile``: while a GPU
    computes) and applied to all constrained rows in one ``apply_bitmasks``; a bias on one of them still applies,
    and every sequence's tokens equal its run alone."""

    llm = LLM(None, EngineOptions(device="cpu", max_context=256, max_batch=4, **BEST_ROW_PATH.options),
              expert_cache=None, progress=False, log=lambda m: None)
    person, nested = grammars.json_schema(PERSON), grammars.json_schema(NESTED)
    params = [SamplingParams(max_tokens=24, constraint=person), SamplingParams(max_tokens=24),
              SamplingParams(max_tokens=24, constraint=nested, logit_bias={tok_id: 5.0 for tok_id in (17, 18)}),
              SamplingParams(max_tokens=24, constraint=person)]
    prompts = ["A person:", "Hello", "Points:", "Someone else:"]
    alone = []
    for prompt, p in zip(prompts, params):
        llm.forget_cache()
        alone.append(llm.generate(prompt, p).token_ids)
    applied, inside = [], []
    apply, decode_batch = scheduler.apply_bitmasks, llm.runner.decode_batch

    def counting_apply(rows, words):
        applied.append(rows.shape[0])
        apply(rows, words)

    def spy(tokens, slots, meanwhile=None):
        def watched():
            inside.append(True)
            meanwhile()
        return decode_batch(tokens, slots, watched if meanwhile is not None else None)

    monkeypatch.setattr(scheduler, "apply_bitmasks", counting_apply)
    llm.runner.decode_batch = spy
    llm.forget_cache()
    together = [r.token_ids for r in llm.generate(prompts, params)]
    assert together == alone
    assert applied and max(applied) == 3 and len(inside) >= len(applied)
