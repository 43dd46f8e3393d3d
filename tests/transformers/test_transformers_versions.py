"""The Transformers API differences across the versions hetmoe/transformers/ supports (>=5.7,<6: backend.SUPPORTED):
the runner passes a model's cache under the keyword its forward takes (``cache`` from 5.24, ``past_key_values``
before) and reads it back from whichever field the output has; a cache keeping a recurrent state is recomputed,
never cropped (5.7's linear-attention layer ignores a crop without a word); a version outside the range is refused
at import with the range named. The models here wrap a real tiny Transformers model (whatever version is installed)
in the other API, or are fakes whose numbers say which tokens their state holds. The engine's experts run on the
best row-block path (BEST_ROW_PATH), the dense part in Transformers' fp32 PyTorch on the CPU.

Run with another installed Transformers too: ``PYTHONPATH=/tmp/tf517 python -m pytest tests/transformers``."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers_tiny import save_tiny

import hetmoe.transformers as ht
from hetmoe.transformers.backend import SUPPORTED, check_version
from hetmoe.transformers.runner import TransformersRunner, cache_keyword, croppable, returned_cache
from paths import BEST_ROW_PATH

IDS = [5, 17, 300, 42, 9, 260, 77, 3, 128, 64, 11]


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    path = save_tiny("olmoe", tmp_path_factory.mktemp("olmoe"))
    return ht.from_pretrained(path, experts_format="bf16", device="cpu", dtype="fp32", isa=BEST_ROW_PATH.isa)


class OtherApi(nn.Module):
    """``inner`` (a Transformers causal LM) behind the cache API of the other Transformers versions: its forward
    takes the cache as ``name`` only and returns a plain object whose only cache field is ``name``: an output of
    5.7-5.23 (``past_key_values``, no ``.cache``) or of 5.24 on (``cache``)."""

    def __init__(self, inner, name: str):
        super().__init__()
        self.inner, self.config, self.name = inner, inner.config, name
        self.forward = {"past_key_values": self.old_forward, "cache": self.new_forward}[name]

    def old_forward(self, input_ids, past_key_values=None, use_cache=False, logits_to_keep=0):
        return self.call(input_ids, past_key_values, use_cache, logits_to_keep)

    def new_forward(self, input_ids, cache=None, use_cache=False, logits_to_keep=0):
        return self.call(input_ids, cache, use_cache, logits_to_keep)

    def call(self, input_ids, held, use_cache, logits_to_keep):
        out = self.inner(input_ids=input_ids, **{cache_keyword(self.inner): held}, use_cache=use_cache,
                         logits_to_keep=logits_to_keep)
        got = SimpleNamespace(logits=out.logits, **{self.name: returned_cache(out)})
        assert not hasattr(got, "cache" if self.name == "past_key_values" else "past_key_values")
        return got


def run_steps(runner) -> list:
    """A chunked prefill, a decode on two slots, a reused prefix and a scored sequence -> every logits row."""
    out = [runner.prefill(IDS, slot=0)]
    out.append(runner.decode_batch([7], [0]))
    runner.prefill(IDS[:6] + [1, 2, 3], slot=1)
    out.append(runner.prefill(IDS[6:] + [7], slot=1, start=6))  # slot 1 now holds what slot 0 holds
    out.append(runner.decode_batch([8, 8], [0, 1]))
    out.append(runner.score(IDS, slot=1))
    return out


@pytest.mark.parametrize("name", ["past_key_values", "cache"])
def test_the_runner_follows_the_cache_api_of_the_model(olmoe, name):
    """The same logits through either API as through the installed Transformers' own (the wrapper calls it): the
    cache goes in under the keyword the forward takes and comes back from the field the output has."""
    model = OtherApi(olmoe, name)
    runner = TransformersRunner(model, max_batch=2, max_context=64, prefill_chunk=4)
    assert runner.cache_keyword == name
    ref = run_steps(TransformersRunner(olmoe, max_batch=2, max_context=64, prefill_chunk=4))
    got = run_steps(runner)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    a, b = got[3]  # the reused prefix decodes as the fresh one (other chunks: fp32 summation order only)
    assert float((a - b).norm() / b.norm()) < 1e-5
    assert runner.lengths == [len(IDS) + 2, len(IDS)]


def test_the_installed_version_is_in_the_supported_range():
    import transformers

    check_version(transformers.__version__)
    assert cache_keyword(transformers.OlmoeForCausalLM) in ("cache", "past_key_values")


@pytest.mark.parametrize("version", ["5.0.0", "5.6.2", "4.57.6", "6.0.0"])
def test_a_version_outside_the_range_is_refused_with_the_range(version):
    with pytest.raises(ImportError, match=f"transformers {SUPPORTED}; transformers {version} is installed"):
        check_version(version)


@pytest.mark.parametrize("version", ["5.7.0", "5.17.0", "5.25.0", "5.26.0.dev0", "5.9.0rc1"])
def test_a_version_inside_the_range_is_accepted(version):
    check_version(version)


def test_a_forward_without_a_cache_keyword_is_refused():
    model = SimpleNamespace(forward=lambda input_ids, use_cache=False: None)
    with pytest.raises(TypeError, match="neither of cache, past_key_values"):
        cache_keyword(model)
    with pytest.raises(RuntimeError, match="holds no cache"):
        returned_cache(SimpleNamespace(logits=None, past_key_values=None))


# ---------------------------------------------------------------- a recurrent state is recomputed, never cropped


class SilentCropState:
    """A hybrid cache as 5.7 has it: an attention layer that crops and a linear-attention layer whose crop does
    nothing, its state (here the sum of the token ids seen) left as it was."""

    def __init__(self):
        self.layers = [SimpleNamespace(length=0), SimpleNamespace(recurrent_states={0: 0})]

    def get_seq_length(self) -> int:
        return self.layers[0].length

    def crop(self, n: int) -> None:
        self.layers[0].length += n  # n < 0: tokens to remove; the recurrent state is not touched


class RecurrentLM(nn.Module):
    """A fake causal LM (5.7-5.23 API) whose logits after each token are one-hot at (sum of the ids seen) % V."""

    V = 97

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=self.V, max_position_embeddings=256)
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, past_key_values=None, use_cache=False, logits_to_keep=0):
        state = past_key_values or SilentCropState()
        rows = []
        for t in input_ids[0].tolist():
            state.layers[1].recurrent_states[0] += t
            state.layers[0].length += 1
            rows.append(nn.functional.one_hot(torch.tensor(state.layers[1].recurrent_states[0] % self.V), self.V))
        logits = torch.stack(rows).float()[None]
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits,
                               past_key_values=state)


def test_a_recurrent_state_is_recomputed_not_cropped():
    runner = TransformersRunner(RecurrentLM(), max_batch=1, max_context=64)
    assert int(runner.prefill([1, 2, 3, 4]).argmax()) == 10
    assert int(runner.prefill([9], start=2).argmax()) == 1 + 2 + 9  # not 1 + 2 + 3 + 4 + 9: the stale state
    assert runner.lengths == [3] and int(runner.decode(5).argmax()) == 17
    assert not croppable(runner.caches[0]) and not croppable(None)


def test_an_attention_cache_is_cropped(olmoe):
    runner = TransformersRunner(olmoe, max_batch=1, max_context=64)
    runner.prefill(IDS)
    cache = runner.caches[0]
    assert croppable(cache)
    runner.prefill([7], start=4)
    assert runner.caches[0] is cache and cache.get_seq_length() == 5  # cropped in place, not recomputed
