"""Special tokens in a sequence's text (hetmoe/engine/sequence.py, SamplingParams.skip_special_tokens and
shown_special_ids): left out by default, all kept with skip_special_tokens=False, only the listed ones kept
otherwise (a tool-call parser's markers while an end-of-turn token stays out); a stop token never reaches the text;
the stop string that cut the text is recorded. A tiny word-level tokenizer built here, with special tokens of its own
in the middle of its vocabulary; no model."""

import pytest
from tokenizers import AddedToken, models
from tokenizers import Tokenizer as Backend

from hetmoe.engine.sampler import SamplingParams
from hetmoe.engine.sequence import SequenceState
from hetmoe.tokenizer import Tokenizer

WORDS = ["<eos>", "call", "<|begin|>", "f", "<|end|>", "{}", "<|turn|>", "done", "STOP", "<tool>"]
EOS, BEGIN, END, TURN, TOOL = 0, 2, 4, 6, 9


@pytest.fixture(scope="module")
def tok():
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<eos>"))
    backend.add_special_tokens([AddedToken(WORDS[i], special=True) for i in (EOS, BEGIN, END, TURN)])
    backend.add_tokens([AddedToken("<tool>", special=False)])  # an added token that is text, not special
    return Tokenizer(backend, {"eos_token": "<eos>"})


def text_of(tok, ids, **params):
    pieces = []
    st = SequenceState(tok, 1, SamplingParams(max_tokens=64, **params), 128, pieces.append)
    for t in ids:
        if st.add(t):
            break
    st.abort()
    assert "".join(pieces) == st.text  # the streamed pieces are the text
    return st


OUTPUT = [1, BEGIN, 3, 5, END, TURN, 7, TOOL, EOS, 7]  # generation ends at the eos


def test_special_tokens_are_left_out_by_default(tok):
    st = text_of(tok, OUTPUT)
    assert "<|" not in st.text and "call" in st.text and "<tool>" in st.text  # a plain added token is text
    assert st.finish_reason == "stop" and st.token_ids == OUTPUT[:8]  # the ids keep every token but the eos


def test_all_special_tokens_kept_when_asked(tok):
    st = text_of(tok, OUTPUT, skip_special_tokens=False)
    assert all(WORDS[i] in st.text for i in (BEGIN, END, TURN)) and "<eos>" not in st.text  # the stop token: never


def test_only_the_shown_special_tokens_are_kept(tok):
    st = text_of(tok, OUTPUT, shown_special_ids=[BEGIN, END])
    assert "<|begin|>" in st.text and "<|end|>" in st.text and "<|turn|>" not in st.text
    assert st.text.index("<|begin|>") < st.text.index("f") < st.text.index("<|end|>") < st.text.index("done")
    assert st.text == text_of(tok, [t for t in OUTPUT if t != TURN], skip_special_tokens=False).text


def test_shown_ids_change_nothing_when_nothing_is_skipped(tok):
    assert text_of(tok, OUTPUT, skip_special_tokens=False, shown_special_ids={BEGIN}).text == \
        text_of(tok, OUTPUT, skip_special_tokens=False).text


def test_an_ignored_eos_is_a_hidden_special_token(tok):
    st = text_of(tok, OUTPUT, ignore_eos=True, shown_special_ids=[BEGIN])
    assert "<eos>" not in st.text and st.text.endswith("done") and st.token_ids == OUTPUT


def test_a_marker_can_end_in_a_stop_string(tok):
    st = text_of(tok, OUTPUT, shown_special_ids=[BEGIN, END], stop=["<|end|>", "STOP"])
    assert st.finish_reason == "stop" and st.stop_string == "<|end|>" and st.text.endswith("f {} ")
    st = text_of(tok, OUTPUT, stop=["<|end|>"])  # not shown: the marker is not text, no stop string in it
    assert st.stop_string is None and st.finish_reason == "stop" and "done" in st.text


def test_the_first_stop_string_and_of_those_the_longest_is_recorded(tok):
    st = text_of(tok, [1, 3, 8, 7], stop=["done", "f S", "f STOP"])  # both complete with the same token
    assert st.stop_string == "f STOP" and st.text == "call "
    assert text_of(tok, [1, 3, 8], stop=["zzz"]).stop_string is None


@pytest.mark.parametrize("kw, match", [
    ({"skip_special_tokens": 0}, "skip_special_tokens"), ({"skip_special_tokens": None}, "skip_special_tokens"),
    ({"shown_special_ids": 3}, "shown_special_ids"), ({"shown_special_ids": "12"}, "shown_special_ids"),
    ({"shown_special_ids": [-1]}, "shown_special_ids"), ({"shown_special_ids": [True]}, "shown_special_ids"),
    ({"shown_special_ids": [1.0]}, "shown_special_ids"), ({"shown_special_ids": [[1]]}, "shown_special_ids"),
    ({"shown_special_ids": {1: 2}}, "shown_special_ids"),
])
def test_bad_values_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_shown_ids_are_a_frozenset():
    assert SamplingParams(shown_special_ids=[3, 3, 5]).shown_special_ids == frozenset({3, 5})
    assert SamplingParams().shown_special_ids == frozenset() and SamplingParams().skip_special_tokens is True
