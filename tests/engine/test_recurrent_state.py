"""The runner and the scheduler with a model that keeps recurrent states per slot (linear attention: a tiny random
qwen3_next, hetmoe/models/qwen3_next.py): a slot continues from its end or starts over, never from a shorter prefix;
a call that fails inside the model loses its slots' states until they are written again from position 0; a batch of
right-padded prompt chunks; the scheduler without prefix reuse, zeroing a slot's states when its sequence ends.

Paths: fp32 dense part on the CPU, bf16 experts on the CPU engine's best row-block path; the same inputs through
different calls compute the same fp32 products in another order: bound 1e-5 (measured <= 8e-7, the model contract
tests' fp32 values).
"""

from __future__ import annotations

import pytest

from hetmoe.config.options import EngineOptions
from hetmoe.engine.runner import Runner
from hetmoe.engine.sampler import SamplingParams
from hetmoe.engine.scheduler import Request, Scheduler
from hetmoe.load.random_weights import build_random_model, shape_tokenizer
from parity import max_rel
from paths import BEST_ROW_PATH

L, F = "linear_attention", "full_attention"
CONFIG = dict(model_type="qwen3_next", vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256,
              moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2, shared_expert_intermediate_size=32,
              linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
              layer_types=[L, L, F, L])
TOL = 1e-5
PROMPT = [5, 17, 200, 42, 9, 260, 77, 3, 128, 64, 11, 90, 7]


@pytest.fixture(scope="module")
def loaded():
    opts = EngineOptions(device="cpu", dtype="fp32", experts_format="bf16", max_context=64, max_batch=3,
                         prefill_chunk=5, **BEST_ROW_PATH.options)
    return build_random_model(CONFIG, None, opts, std=0.08, log=lambda m: None)


def test_runner_says_what_it_runs(loaded, capsys):
    runner = Runner(loaded)
    err = capsys.readouterr().err
    assert runner.recurrent and runner.lean is None
    assert "linear attention runs the PyTorch chunked/recurrent form (CPU)" in err
    assert "the lean CPU decode step does not cover linear-attention layers" in err


def test_a_slot_continues_from_its_end_or_starts_over(loaded):
    runner = Runner(loaded)
    whole = runner.prefill(PROMPT, slot=0)  # 3 chunks of prefill_chunk 5: the states carried across them
    runner.prefill(PROMPT[:4], slot=1)
    assert max_rel(runner.prefill(PROMPT[4:], slot=1, start=4), whole) < TOL
    with pytest.raises(ValueError, match="slot 1's recurrent states hold its 13 tokens and cannot be rewound"):
        runner.prefill(PROMPT[6:], slot=1, start=6)
    with pytest.raises(ValueError, match="cannot be cut back to 6: keep all of them or none"):
        runner.release(1, keep=6)
    runner.release(1, keep=13)  # all of them: nothing changes
    steps = runner.decode_batch([7, 7], [0, 1])
    assert max_rel(steps[1], steps[0]) < TOL
    runner.release(1)
    assert runner.cache.states.recurrent[:, 1].abs().max() == 0 and runner.lengths[1] == 0
    assert max_rel(runner.prefill(PROMPT, slot=1), whole) < TOL  # over what slot 1 held: from position 0


def test_a_failed_call_loses_its_slots_states(loaded, monkeypatch):
    """An exception in the middle of the model (after layer 0 advanced its states) marks the call's slots lost: they
    refuse to continue (ValueError naming the slot) until written again from position 0, which then equals a fresh
    run. Checks made before the model runs (a token beyond the vocabulary) lose nothing."""
    runner = Runner(loaded)
    for slot in (0, 1, 2):
        runner.prefill(PROMPT, slot=slot)
    with pytest.raises(ValueError, match="token ids must be in"):
        runner.decode_batch([7, 999], [0, 2])
    assert not runner.lost
    layer = loaded.model.model.layers[2]

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(layer, "forward", broken)
    with pytest.raises(RuntimeError, match="boom"):
        runner.decode_batch([7, 7], [0, 1])
    monkeypatch.undo()
    assert runner.lost == {0, 1}
    for call in (lambda: runner.decode(7, slot=0), lambda: runner.prefill([7], slot=1, start=13)):
        with pytest.raises(ValueError, match="were lost when an earlier call on it failed"):
            call()
    ok = runner.decode(7, slot=2)  # slot 2 was not in the failed call
    runner.prefill(PROMPT, slot=0)
    assert runner.lost == {1} and max_rel(runner.decode(7, slot=0), ok) < TOL


def test_prefill_batch_of_padded_chunks(loaded):
    """Chunks of different lengths in one call (right-padded; each row's length handed to the layers), then one
    decode step for both: each row as its prompt prefilled alone."""
    runner = Runner(loaded)
    a, b = PROMPT[:5], PROMPT[5:7]
    runner.prefill_batch([a, b], [2, 0], [0, 0])
    runner.prefill_batch([PROMPT[7:9], PROMPT[9:13]], [2, 0], [5, 2])
    got = runner.decode_batch([7, 7], [2, 0])
    alone = Runner(loaded)
    for row, prompt in enumerate((a + PROMPT[7:9], b + PROMPT[9:13])):
        alone.prefill(prompt, slot=1)
        assert max_rel(got[row], alone.decode(7, slot=1)) < TOL


def test_scheduler_reuses_no_prefix_and_zeroes_ended_slots(loaded):
    """Prefix reuse off (said once), a prompt sharing a prefix with an earlier one computed whole with the same
    tokens as on a fresh runner; finished and cancelled sequences leave their slots' states zeroed."""
    said = []
    tok = shape_tokenizer(CONFIG["vocab_size"])
    sched = Scheduler(Runner(loaded), tok, log=said.append)
    assert not sched.prefix_reuse and said == ["prefix reuse is off: the model's linear-attention layers keep "
                                               "recurrent states, which cannot be cut back to a shared prefix"]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    first = sched.run([Request(PROMPT, params)])[0]
    req = Request(PROMPT[:8] + [1, 2], params)
    second = sched.run([req])[0]
    fresh = Scheduler(Runner(loaded), tok, log=lambda m: None).run([Request(PROMPT[:8] + [1, 2], params)])[0]
    assert req.cached_tokens == 0 and second.token_ids == fresh.token_ids and first.completion_tokens == 5
    states = sched.runner.cache.states
    assert states.recurrent.abs().max() == 0 and states.conv.abs().max() == 0
    long = sched.add(Request(PROMPT, SamplingParams(max_tokens=50, ignore_eos=True)))
    sched.step()
    sched.step()
    assert states.recurrent.abs().max() > 0
    long.cancel()
    sched.step()
    assert not sched.has_work() and states.recurrent.abs().max() == 0


def test_kept_states_puts_the_rows_back():
    """engine/cuda_graph.py ``kept_states``: the CUDA graph's warm-up advances the step's rows once more than the
    replay will; the rows it names (repeats too: the padding rows all name the scratch slot) are put back as they
    were, the other rows keep what happened to them meanwhile. A cache without recurrent states is left alone."""
    import torch

    from hetmoe.engine.cuda_graph import kept_states
    from hetmoe.layers.kv_cache import RecurrentStates

    torch.manual_seed(0)
    states = RecurrentStates(3, 5, conv_channels=6, conv_width=3, heads=2, k_dim=4, v_dim=4)
    states.conv.normal_()
    states.recurrent.normal_()
    before = states.conv.clone(), states.recurrent.clone()
    cache = type("Cache", (), {"states": states})()
    rows = torch.tensor([3, 0, 4, 4])
    with kept_states(cache, rows):
        states.conv.add_(1.0)
        states.recurrent.mul_(2.0)
    for now, was, moved in ((states.conv, before[0], before[0] + 1.0), (states.recurrent, before[1], 2.0 * before[1])):
        assert torch.equal(now[:, [0, 3, 4]], was[:, [0, 3, 4]])
        assert torch.equal(now[:, [1, 2]], moved[:, [1, 2]])
    with kept_states(type("Cache", (), {"states": None})(), rows):  # no states: nothing saved or restored
        pass


@pytest.mark.gpu
def test_cuda_graph_decode_equals_the_eager_steps():
    """On a GPU, the decode step of a model with recurrent states goes through the CUDA graph: its capture's warm-up
    must not advance the states a second time. Two runners on the same random weights (fp32 dense part on the GPU,
    bf16 experts on the CPU engine), one with the graph and one eager: batches of 1, 2 and 3 rows (3 runs as the
    captured size 4, its padding row on the scratch slot), each size captured at its first step, 5 steps each.
    Path: the same GPU kernels in both, the graph replaying them: bound 1e-5 (a state advanced twice moves the logits
    by O(1))."""
    import torch

    opts = EngineOptions(device="cuda", dtype="fp32", experts_format="bf16", max_context=64, max_batch=3,
                         prefill_chunk=5, **BEST_ROW_PATH.options)
    graph, eager = (Runner(build_random_model(CONFIG, None, opts, std=0.08, log=lambda m: None), cuda_graph=g)
                    for g in (True, False))  # two loads of the same seeded weights: a runner each
    assert graph.decoder.cuda_graph and not eager.decoder.cuda_graph
    errs = []
    for rows in ([0], [0, 1], [0, 1, 2]):
        for runner in (graph, eager):
            for slot in rows:
                runner.prefill(PROMPT[:7 + slot], slot=slot)
        tokens = [PROMPT[slot] for slot in rows]
        for _ in range(5):
            a, b = graph.decode_batch(tokens, rows), eager.decode_batch(tokens, rows)
            errs.append(max_rel(a, b))
            tokens = b.argmax(-1).tolist()
    print("graph~eager:", " ".join(f"{e:.1e}" for e in errs))
    assert max(errs) < TOL, errs
    assert torch.cuda.is_available()
