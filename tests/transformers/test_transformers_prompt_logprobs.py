"""Prompt log-probabilities through the Transformers runner (hetmoe/transformers/runner.py ``prefill(all_logits=
True)``), driven by the engine's scheduler as LLM drives it: equal to the log_softmax of the runner's one-shot
``score``. A tiny random olmoe checkpoint (tests/transformers_tiny.py), experts on BEST_ROW_PATH, fp32, CPU."""

import pytest
import torch
from transformers_tiny import save_tiny

import hetmoe.transformers as ht
from hetmoe.engine import scheduler as scheduler_module
from hetmoe.engine.sampler import SamplingParams
from hetmoe.engine.scheduler import Request, Scheduler
from hetmoe.tokenizer import Tokenizer
from hetmoe.transformers.runner import TransformersRunner
from paths import BEST_ROW_PATH

IDS = [5, 17, 300, 42, 9, 260, 77, 3, 128, 64, 11]


def test_prompt_logprobs_through_the_transformers_runner(tmp_path, monkeypatch):
    path = save_tiny("olmoe", tmp_path, tokenizer=True)
    model = ht.from_pretrained(path, experts_format="bf16", device="cpu", dtype="fp32", isa=BEST_ROW_PATH.isa)
    runner = TransformersRunner(model, max_batch=2, max_context=64, prefill_chunk=4)
    ref = torch.log_softmax(runner.score(IDS, slot=1), -1)
    head = runner.prefill(IDS[:6], slot=0, all_logits=True)
    tail = runner.prefill(IDS[6:], slot=0, start=6, all_logits=True)
    torch.testing.assert_close(torch.log_softmax(torch.cat([head, tail]), -1), ref, rtol=1e-5, atol=1e-5)

    monkeypatch.setattr(scheduler_module, "PROMPT_LOGPROBS_CHUNK", 3)  # the prompt in four calls
    scheduler = Scheduler(runner, Tokenizer.from_dir(path))
    [out] = scheduler.run([Request(IDS, SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=2))])
    assert [e.token_id for e in out.prompt_logprobs] == IDS[1:]
    for i, entry in enumerate(out.prompt_logprobs):
        assert entry.logprob == pytest.approx(float(ref[i, IDS[i + 1]]), abs=1e-5)
        assert [t for t, _ in entry.top] == ref[i].topk(2).indices.tolist()
