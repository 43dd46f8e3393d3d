"""Running a loaded model and the commands: placement.py (EngineOptions, the memory plan), runner.py (Runner),
llm.py (LLM) and `hetmoe generate` / `hetmoe chat` (hetmoe/cli/) run as subprocesses. Checkpoints are
written by the test; the expert cache is off or a tmp dir (XDG_CACHE_HOME too)."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hetmoe.config.options import ISA_CHOICES, EngineOptions
from hetmoe.cpu import CPUExperts
from hetmoe.cpu.layout import expert_bytes
from hetmoe.engine.llm import LLM
from hetmoe.engine.runner import Runner
from hetmoe.engine.sampler import SamplingParams
from hetmoe.load.loader import load_model
from hetmoe.plan import placement
from hetmoe.plan.memory import ModelShapes
from hetmoe.plan.placement import choose_plan, plan_memory
from paths import AUTO_PATH, BEST_ROW_PATH, MIXED_PATH, PATHS, logit_bound

# The runner's equality cases run on every engine path of this machine, each forced (bitwise within the path, so
# any split of the tokens gives the same logits up to the dense part's fp32 order), plus the two that choose per
# expert and call (the emulated AMX with its default crossover, and isa="auto"): there a different split may move
# an expert to the other numerical class, and the bound is the measured cross-path one (tests/paths.py).
SPLIT_PATHS = [*PATHS.values(), MIXED_PATH, AUTO_PATH]

IDS = [5, 17, 300, 42, 9, 260, 77, 3, 128, 64, 11]


@pytest.fixture(scope="module")
def model_dir(qwen3_checkpoint):
    return qwen3_checkpoint


def _load(path, **opts):
    opts = {"device": "cpu", "dtype": "fp32", "experts_format": "bf16", "max_context": 32, **opts}
    return load_model(path, EngineOptions(**opts), expert_cache=None, progress=False, log=lambda m: None)


def max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# ---------------------------------------------------------------- placement and the memory plan

SHAPES = ModelShapes(hidden=1024, vocab_size=32000, n_routed=1000, expert_inter=1024, dense_params=50_000_000,
                     kv_elems_per_token=16384, act_width=8192, max_position_embeddings=8192)


@pytest.mark.parametrize("kwargs, match", [
    (dict(device="tpu"), "device must be"), (dict(experts_format="fp6"), "experts format"),
    (dict(experts_format="fp8", group_size=64), "fp8 experts need a group size of 128"),
    (dict(dtype="fp16"), "dtype must be"), (dict(threads=0), "threads must be >= 1"),
    (dict(max_context=0), "max-context must be >= 1"), (dict(max_batch=0), "max_batch"),
    (dict(prefill_chunk=0), "prefill_chunk"), (dict(group_size=48), "group size must be"),
    (dict(isa="sse4"), "isa must be auto, scalar, avx2, avx512, amx"), (dict(amx_min_tokens=0), "amx_min_tokens"),
    (dict(amx_min_tokens=True), "amx_min_tokens")])
def test_engine_options_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineOptions(**kwargs)


def test_plan_refuses_what_does_not_fit(monkeypatch, model_dir):
    monkeypatch.setattr(placement, "free_ram", lambda: 1 << 20)
    with pytest.raises(MemoryError, match=r"bf16 experts on cpu \(RAM: needs [0-9.]+ GiB, 1.0 MiB available\).*"
                                          r"routed experts.*--experts-format int4"):
        choose_plan(SHAPES, EngineOptions(device="cpu", experts_format="bf16"))
    with pytest.raises(MemoryError, match=r"with int4 experts.*1.0 MiB available.*smaller --max-context"):
        choose_plan(SHAPES, EngineOptions(device="cpu"))
    # auto steps a float checkpoint's experts down to int2 before giving up; refused before any weight is read
    with pytest.raises(MemoryError, match=r"even with every routed expert in int2: the plan needs at least [0-9.]+"):
        _load(model_dir, experts_format="auto")


def test_auto_format_picks_the_most_precise_that_fits(monkeypatch):
    opts = EngineOptions(device="cpu")
    need = {f: plan_memory(SHAPES, opts, torch.device("cpu"), f).ram_bytes for f in placement.FORMATS}
    assert need["bf16"] > need["int8"] > need["int4"] > 2**30
    for free, want in ((10 * need["bf16"], "bf16"), (need["int8"] / placement.HEADROOM + 1, "int8"),
                       (need["int4"] / placement.HEADROOM + 1, "int4")):
        monkeypatch.setattr(placement, "free_ram", lambda free=free: int(free))
        plan = choose_plan(SHAPES, opts)
        assert plan.experts_format == want
        assert plan.ram["routed experts"] == SHAPES.n_routed * expert_bytes(want, 1024, 1024, plan.group_size)


def test_the_context_defaults_to_the_models_limit_or_the_most_that_fits(monkeypatch):
    """No --max-context: the model's limit when it fits; else the largest multiple of 1024 that does, with a note; a
    --max-context given is kept (and refused when it does not fit)."""
    shapes = dataclasses.replace(SHAPES, max_position_embeddings=131072)
    opts = EngineOptions(device="cpu", experts_format="int4", max_batch=2)
    full = plan_memory(shapes, opts, torch.device("cpu"), "int4")
    assert full.max_context == 131072 and full.ram["KV cache"] == 2 * 131072 * 16384 * 4  # fp32, both rows
    monkeypatch.setattr(placement, "free_ram", lambda: int(full.ram_bytes / placement.HEADROOM) + 1)
    assert choose_plan(shapes, opts).max_context == 131072 and not choose_plan(shapes, opts).notes
    budget = full.ram_bytes - full.ram["KV cache"] + 2 * 50_000 * 16384 * 4  # room for 50,000 positions per row
    monkeypatch.setattr(placement, "free_ram", lambda: int(budget / placement.HEADROOM))
    plan = choose_plan(shapes, opts)
    assert plan.max_context == 50_000 // 1024 * 1024 and plan.ram_bytes <= budget
    assert "not the model's 131072" in plan.notes[0] and "--max-context" in plan.notes[0]
    with pytest.raises(MemoryError, match="smaller --max-context"):
        choose_plan(shapes, dataclasses.replace(opts, max_context=131072))


@pytest.mark.parametrize("E, H, I", [(3, 100, 37), (2, 129, 65), (1, 17, 200)])
def test_expert_bytes_match_the_engine(E, H, I):
    for fmt, groups in (("bf16", [0]), ("int8", [0, 32, 64, 128]), ("int4", [32, 64, 128])):
        for g in groups:
            assert CPUExperts(E, H, I, fmt, g).nbytes == E * expert_bytes(fmt, H, I, g), (fmt, g)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda(model_dir):
    with pytest.raises(RuntimeError, match="--device cuda.*no CUDA device"):
        choose_plan(SHAPES, EngineOptions(device="cuda"))
    with pytest.raises(RuntimeError, match="no CUDA device"):
        _load(model_dir, device="cuda")


# ---------------------------------------------------------------- Runner

# Measured max rel. logit error on one path: chunked prefill 2.2e-7, prefix reuse 2.0e-7, decode_batch vs single
# slots 2.1e-7; on the mixed paths up to the cross-path bound (tests/paths.py).
@pytest.mark.parametrize("path", SPLIT_PATHS, ids=str)
def test_chunked_prefill_equals_one_shot(model_dir, path):
    one, chunked = Runner(_load(model_dir, **path.options)), Runner(_load(model_dir, prefill_chunk=3, **path.options))
    assert chunked.prefill_chunk == 3  # 11 tokens: chunks of 3, 3, 3, 2
    want = torch.stack([one.prefill(IDS), one.decode(7)])
    got = torch.stack([chunked.prefill(IDS), chunked.decode(7)])
    print(f"{path} chunked prefill: max rel. error {max_rel(got, want):.1e}")
    assert max_rel(got, want) <= logit_bound(path, "bf16")


@pytest.mark.parametrize("path", SPLIT_PATHS, ids=str)
def test_prefill_after_a_cached_prefix(model_dir, path):
    loaded = _load(model_dir, **path.options)
    fresh, runner = Runner(loaded), Runner(loaded)
    want = torch.stack([fresh.prefill(IDS), fresh.decode(9)])
    runner.prefill(IDS[:6] + list(range(400, 410)))  # a longer, different tail stays in the cache
    got = torch.stack([runner.prefill(IDS[6:], start=6), runner.decode(9)])
    assert runner.lengths[0] == len(IDS) + 1
    print(f"{path} prefix reuse: max rel. error {max_rel(got, want):.1e}")
    assert max_rel(got, want) <= logit_bound(path, "bf16")


@pytest.mark.parametrize("path", SPLIT_PATHS, ids=str)
def test_decode_batch_equals_single_slots(model_dir, path):
    prompts, steps = [IDS, IDS[3:7]], [(11, 12), (13, 14)]
    both = Runner(_load(model_dir, max_batch=2, **path.options))
    for slot, prompt in enumerate(prompts):
        both.prefill(prompt, slot=slot)
    got = torch.stack([both.decode_batch(steps[0], [0, 1]), both.decode_batch(steps[1][::-1], [1, 0]).flip(0)])
    loaded = _load(model_dir, **path.options)
    for slot, prompt in enumerate(prompts):
        one = Runner(loaded)
        one.prefill(prompt)
        want = torch.stack([one.decode(steps[0][slot]), one.decode(steps[1][slot])])
        print(f"{path} slot {slot}: max rel. error {max_rel(got[:, slot], want):.1e}")
        assert max_rel(got[:, slot], want) <= logit_bound(path, "bf16")
    assert both.lengths == [len(IDS) + 2, 6]


@pytest.mark.parametrize("path", SPLIT_PATHS, ids=str)
def test_prefill_batch_equals_separate_prefills(model_dir, path):
    # Three prompts of different lengths (right-padded in one call; slot 2 continues a cached prefix), then a
    # decode step of all three, against each prompt prefilled alone.
    prompts, starts = [IDS, IDS[2:5], IDS[:8]], [0, 0, 4]
    batch = Runner(_load(model_dir, max_batch=3, **path.options))
    batch.prefill(IDS[:4], slot=2)
    got = batch.prefill_batch([p[s:] for p, s in zip(prompts, starts)], [0, 1, 2], starts)
    assert batch.lengths == [len(p) for p in prompts]
    got_next = batch.decode_batch([5, 6, 7], [0, 1, 2])
    loaded = _load(model_dir, **path.options)
    bound = logit_bound(path, "bf16")
    for slot, prompt in enumerate(prompts):
        one = Runner(loaded)
        want = one.prefill(prompt)
        want_next = one.decode(5 + slot)
        print(f"{path} slot {slot}: max rel. error {max_rel(got[slot], want):.1e}, "
              f"next {max_rel(got_next[slot], want_next):.1e}")
        assert max_rel(got[slot], want) <= bound and max_rel(got_next[slot], want_next) <= bound
    with pytest.raises(ValueError, match="one chunk and one start per distinct slot"):
        batch.prefill_batch([IDS, IDS], [0, 0], [0, 0])


def test_runner_errors(model_dir):
    runner = Runner(_load(model_dir, max_context=16))
    for call, match in [
        (lambda: runner.prefill([]), "the prompt is empty"),
        (lambda: runner.prefill(list(range(17))), "the prompt is 17 tokens; the context holds 16"),
        (lambda: runner.prefill([1], start=3), "start 3 is beyond the 0 tokens cached in slot 0"),
        (lambda: runner.prefill([1], slot=1), r"slot 1 is outside \[0, 1\)"),
        (lambda: runner.prefill([1, 512]), r"token ids must be in \[0, 512\); got 1..512"),
        (lambda: runner.prefill([-1, 2]), r"token ids must be in \[0, 512\)"),
        (lambda: runner.decode(512), r"token ids must be in \[0, 512\); got 512"),
        (lambda: runner.decode(-1), r"token ids must be in \[0, 512\); got -1"),
        (lambda: runner.decode(1, slot=-1), r"slot -1 is outside"),
        (lambda: runner.decode_batch([1, 2], [0]), "one token per slot, got 2 tokens for 1 slots"),
        (lambda: runner.decode_batch([1, 2], [0, 0]), "repeat a slot"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()
    assert runner.lengths == [0]  # nothing was written
    runner.prefill(list(range(16)))
    with pytest.raises(ValueError, match="slot 0 is full"):
        runner.decode(1)


# ---------------------------------------------------------------- LLM

# The LLM tests compare greedy tokens of two splittings of one conversation: one forced path keeps them bitwise
# (on a mixed path a near-tie could flip a token within the cross-path bound). The splits' numerics are the
# runner tests' above, on every path.
LLM_OPTIONS = dict(device="cpu", max_context=128, **BEST_ROW_PATH.options)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, EngineOptions(**LLM_OPTIONS), expert_cache=None, progress=False, log=lambda m: None)


def test_llm_greedy_is_deterministic_and_matches_the_runner(llm):
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    a, b = llm.generate("Hello, world!", params), llm.generate("Hello, world!", params)
    assert len(a.token_ids) == 10 and a.token_ids == b.token_ids and a.text == b.text and a.text
    runner = Runner(llm.loaded)
    logits, want = runner.prefill(llm.prompt_ids("Hello, world!", chat=True)), []
    for _ in range(10):
        want.append(int(logits.argmax()))
        logits = runner.decode(want[-1])
    assert a.token_ids == want


def test_llm_seeded_sampling(llm):
    def run(seed):
        return llm.generate("Hello", SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True))

    a, b, c = run(7), run(7), run(8)
    assert a.token_ids == b.token_ids and a.text == b.text and a.token_ids != c.token_ids


def test_chat_prefix_reuse_equals_a_fresh_llm(llm, model_dir):
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    starts, prefill = [], llm.runner.prefill
    llm.runner.prefill = lambda ids, slot=0, start=0: starts.append(start) or prefill(ids, slot, start)
    try:
        messages = [{"role": "user", "content": "Hi there"}]
        first = llm.generate(messages, params)
        messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Tell me more"}]
        second = llm.generate(messages, params)
    finally:
        del llm.runner.prefill
    assert starts[-1] >= len(llm.prompt_ids(messages[:1], chat=True))  # the first turn was not recomputed
    fresh = LLM(model_dir, EngineOptions(**LLM_OPTIONS), expert_cache=None, progress=False,
                log=lambda m: None).generate(messages, params)
    assert second.token_ids == fresh.token_ids and second.text == fresh.text


def test_prefix_reuse_counts_cached_tokens(llm):
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    llm.forget_cache()
    messages = [{"role": "user", "content": "Hi there"}]
    first = llm.generate(messages, params)
    assert first.timings.cached_tokens == 0 and first.timings.new_prompt_tokens == first.prompt_tokens
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "More"}]
    second = llm.generate(messages, params)
    t = second.timings
    assert 0 < t.cached_tokens < second.prompt_tokens and t.new_prompt_tokens == second.prompt_tokens - t.cached_tokens
    llm.forget_cache()
    assert llm.generate(messages, params).timings.cached_tokens == 0


def test_an_interrupted_step_is_not_reused(llm, model_dir):
    """A step stopped part way (Ctrl-C in `chat`, an error) may have overwritten KV positions of earlier turns: the
    prefix record names only completed steps, so the next turn does not reuse them and equals a fresh LLM."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first_turn = [{"role": "user", "content": "Hi there"}]
    llm.forget_cache()
    first = llm.generate(first_turn, params)
    prefill = llm.runner.prefill

    def interrupted(ids, *a, **kw):
        prefill(ids, *a, **kw)  # the step's cache writes happen, then the interrupt arrives
        raise KeyboardInterrupt

    llm.runner.prefill = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):  # another conversation, diverging at its first user message
            llm.generate([{"role": "user", "content": "Something else entirely, and longer"}], params)
    finally:
        del llm.runner.prefill
    again = first_turn + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "More"}]
    got = llm.generate(again, params)
    fresh = LLM(model_dir, EngineOptions(**LLM_OPTIONS), expert_cache=None, progress=False,
                log=lambda m: None).generate(again, params)
    assert got.timings.cached_tokens == 0  # nothing trusted after the interrupted prefill
    assert got.token_ids == fresh.token_ids


# ---------------------------------------------------------------- the commands

@pytest.fixture(scope="module")
def env(isolated_env):
    return isolated_env  # never the user's cache


def hetmoe(env, *args, stdin="", exe=None, code=0):
    """The command in a fresh process (each pays the torch import, ~3 s: most cases run ``cli.main`` in-process)."""
    cmd = [exe] if exe else [sys.executable, "-m", "hetmoe"]
    out = subprocess.run(cmd + [str(a) for a in args], input=stdin, capture_output=True, text=True, env=env,
                         timeout=300)
    assert "Traceback" not in out.stderr, out.stderr
    if code is not None:
        assert out.returncode == code, out.stderr
    return out


def main(capsys, *args):
    """``hetmoe ARGS`` in this process -> (exit code, stdout, stderr)."""
    from hetmoe.cli import main as cli_main

    try:
        code = cli_main([str(a) for a in args])
    except SystemExit as e:  # argparse
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


GEN = ("generate", "--expert-cache", "off", "--max-tokens", 8)


def test_help_lists_the_commands(env):
    out = hetmoe(env, "--help")
    assert "generate" in out.stdout and "chat" in out.stdout


def test_generate_with_the_builtin_model(env, capsys):
    exe = shutil.which("hetmoe", path=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    if exe is None:
        pytest.fail("the hetmoe console script is not installed (pip install -e .)")
    plain = hetmoe(env, *GEN, exe=exe)  # the console script, once
    assert plain.stdout.strip() and "tok/s" not in plain.stdout
    assert "hetmoe: deepseek_v3 from" in plain.stderr and "default_model" in plain.stderr
    timing = [line for line in plain.stderr.splitlines() if "prompt tokens in" in line]
    assert len(timing) == 1 and "prompt tokens" in timing[0] and "generated" in timing[0]
    code, stdout, _ = main(capsys, *GEN, "--json")
    result = json.loads(stdout)
    assert code == 0 and result["text"] == plain.stdout[:-1]  # the same greedy completion (plain adds a newline)
    assert 1 <= result["completion_tokens"] <= 8 and result["finish_reason"] in ("stop", "length")
    assert result["decode_tok_s"] >= 0 and result["prompt_tokens"] > 0


def test_generate_seed_is_reproducible(env, capsys):
    args = (*GEN, "--json", "--temperature", 1.5, "--top-k", 50, "--prompt", "Once upon a time")
    a = json.loads(hetmoe(env, *args, "--seed", 11).stdout)
    b, c = (json.loads(main(capsys, *args, "--seed", seed)[1]) for seed in (11, 12))
    assert a["text"] == b["text"] and a["completion_tokens"] == b["completion_tokens"]
    assert c["text"] != a["text"]


def test_generate_with_extreme_sampling_values_is_greedy(capsys):
    """--top-p 1e-300 (0 in fp32) and --temperature 1e-300 (an fp32 overflow) are greedy, not a crash."""
    greedy = json.loads(main(capsys, *GEN, "--json")[1])
    extremes = [("--temperature", 1, "--top-p", "1e-300"), ("--temperature", "1e-300"),
                ("--temperature", "1e-300", "--top-p", "1e-300")]
    for args in extremes:
        code, stdout, stderr = main(capsys, *GEN, "--json", "--seed", 3, *args)
        assert code == 0, stderr
        assert json.loads(stdout)["text"] == greedy["text"], args


def test_generate_with_a_checkpoint_dir_and_a_cache(env, model_dir, tmp_path, llm, capsys):
    args = ("generate", "--model", model_dir, "--expert-cache", tmp_path, "--max-tokens", 6, "--json",
            "--experts-format", "bf16", "--device", "cpu", "--prompt", "Hello, world!")
    result = json.loads(hetmoe(env, *args).stdout)
    assert len(list(tmp_path.rglob("layer*.bin"))) == 2
    code, stdout, stderr = main(capsys, *args)
    assert code == 0 and "expert cache 2/2 layers reused" in stderr
    assert json.loads(stdout)["text"] == result["text"]
    want = llm.generate("Hello, world!", SamplingParams(max_tokens=6))
    assert result["text"] == want.text and result["completion_tokens"] == want.completion_tokens


def test_chat_two_turns_from_stdin(env):
    out = hetmoe(env, "chat", "--expert-cache", "off", "--max-tokens", 6, stdin="Hi there\nTell me more\n")
    assert len([line for line in out.stderr.splitlines() if " generated in " in line]) == 2, out.stderr
    assert out.stdout.strip()


def _one_error_line(code, stdout, stderr, message):
    assert code not in (0, None) and stdout == ""
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0] == stderr.splitlines()[-1], stderr
    assert errors[0].startswith("hetmoe generate: error:") and message in errors[0], errors


def test_truncated_shard_is_a_one_line_error(env, model_dir, tmp_path):
    path = shutil.copytree(model_dir, tmp_path / "truncated")
    shard = sorted(path.glob("*.safetensors"))[-1]
    os.truncate(shard, shard.stat().st_size // 2)
    out = hetmoe(env, *GEN, "--model", path, code=None)  # a real process: exit status, no traceback
    _one_error_line(out.returncode, out.stdout, out.stderr, f"{shard.name} is truncated")


@pytest.mark.parametrize("args, message", [
    (("--model", "/nonexistent/model"), "error: model directory /nonexistent/model does not exist"),
    (("--device", "cuda"), "error: --device cuda was asked for, but torch sees no CUDA device"),
], ids=["no-model-dir", "cuda-without-cuda"])
def test_runtime_errors_are_one_line(capsys, args, message):
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, stdout, stderr = main(capsys, *GEN, *args)
    assert code == 1 and "usage:" not in stderr
    _one_error_line(code, stdout, stderr, message)


# Usage errors: argparse's exit status 2, the usage, then one line `hetmoe CMD: error: --option: what` with the
# value as typed: no Python quotes, reprs or tuples (before: "argument --top-p" from argparse next to "top_p must
# be ..." with exit 1, "invalid _positive_int value: 'abc'", "got ('',)").
@pytest.mark.parametrize("args, line", [
    (("generate", "--temperature", -1),
     "hetmoe generate: error: --temperature: expected a finite number >= 0, got -1"),
    (("generate", "--temperature", "inf"),
     "hetmoe generate: error: --temperature: expected a finite number >= 0, got inf"),
    (("generate", "--top-p", 0), "hetmoe generate: error: --top-p: expected a number in (0, 1], got 0"),
    (("generate", "--top-k", -2), "hetmoe generate: error: --top-k: expected an integer >= 0, got -2"),
    (("generate", "--threads", "abc"), "hetmoe generate: error: --threads: expected a positive integer, got abc"),
    (("generate", "--seed", "x"), "hetmoe generate: error: --seed: expected an integer, got x"),
    (("generate", "--stop", ""), "hetmoe generate: error: --stop: expected a non-empty string"),
    (("generate", "--device", "tpu"),
     "hetmoe generate: error: --device: invalid choice: tpu (choose from auto, cuda, cpu)"),
    (("generate", "--gpu-experts", -1), "hetmoe generate: error: --gpu-experts: expected an integer >= 0, got -1"),
    (("generate", "--bogus"), "hetmoe generate: error: unrecognized arguments: --bogus"),
    (("chat", "--numa", "x"), "hetmoe chat: error: --numa: expected auto, off or a number of subpools >= 1, got x"),
    (("doctor", "--isa", "sse4"), "hetmoe doctor: error: --isa: invalid choice: sse4 (choose from auto, scalar"),
    (("bench", "overhead", "--with-copies"), "hetmoe bench overhead: error: --with-copies: needs --stream"),
    (("bench", "kernel", "--tokens", "a"),
     "hetmoe bench kernel: error: --tokens: expected a comma-separated list of integers, got a"),
    (("nope",), "hetmoe: error: COMMAND: invalid choice: nope (choose from generate, chat, serve"),
], ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else None)
def test_usage_errors_have_one_style(capsys, args, line):
    code, stdout, stderr = main(capsys, *args)
    lines = stderr.splitlines()
    assert code == 2 and stdout == "" and lines[0].startswith("usage: hetmoe"), stderr
    assert lines[-1].startswith(line) and [x for x in lines if "error:" in x] == lines[-1:], stderr
    assert not any(c in lines[-1] for c in "'\"") and "argument " not in lines[-1], lines[-1]


ENGINE_FLAGS = {"device": "--device", "experts_format": "--experts-format", "group_size": "--group-size",
                "threads": "--threads", "numa": "--numa", "max_context": "--max-context", "dtype": "--dtype",
                "defer_experts": "--defer-experts", "gpu_experts": "--gpu-experts",
                "calibration_file": "--calibration-file", "cuda_graph": "--no-cuda-graph", "isa": "--isa",
                "gpu_prefill": "--gpu-prefill", "gpu_prefill_cpu_share": "--gpu-prefill-cpu-share", "rules": "--rules",
                "attention": "--attention",
                "dense_format": "--dense-format", "gpu_memory": "--gpu-memory", "cpu_memory": "--cpu-memory",
                "fused_decode": "--fused-decode", "gpu_experts_format": "--gpu-experts-format"}


@pytest.mark.parametrize("command", [["generate"], ["chat"], ["serve"], ["eval", "--text", "t"], ["bench", "e2e"],
                                     ["bench", "serve"]], ids=" ".join)
def test_engine_flags_are_the_engine_options_fields(command, capsys, monkeypatch):
    # Each engine flag is written once, as EngineOptions field metadata: every command that runs a model gets the
    # same flags, with the field's default and help, and reads back the EngineOptions they describe.
    from hetmoe.cli import build_parser
    from hetmoe.config.flags import engine_fields, engine_options
    from hetmoe.cpu import ISAS

    assert {f.name: f.metadata["flag"] for f in engine_fields()} == ENGINE_FLAGS
    assert ISA_CHOICES == ("auto",) + ISAS
    argv = ["--device", "cpu", "--experts-format", "int8", "--group-size", "32", "--threads", "1", "--numa", "off",
            "--max-context", "64", "--dtype", "fp32", "--defer-experts", "1", "--gpu-experts", "2",
            "--calibration-file", "c.txt", "--no-cuda-graph", "--isa", "scalar", "--attention", "sdpa"]
    assert engine_options(build_parser().parse_args(command + argv)) == EngineOptions(
        device="cpu", experts_format="int8", group_size=32, threads=1, numa="off", max_context=64, dtype="fp32",
        defer_experts=1, gpu_experts=2, calibration_file="c.txt", cuda_graph=False, isa="scalar", attention="sdpa")
    assert engine_options(build_parser().parse_args(command)) == EngineOptions()
    monkeypatch.setenv("COLUMNS", "1000")  # each help on one line (argparse wraps at hyphens too)
    code, stdout, _ = main(capsys, *command, "--help")
    shown = " ".join(stdout.split())
    assert code == 0 and all(" ".join(f.metadata["help"].split()) in shown for f in engine_fields())


def test_parsing_imports_no_torch(env):
    # `hetmoe --help` stays instant: the parsers of every command, engine flags included, come without torch/_C.
    script = ("import sys; from hetmoe.cli import build_parser; p = build_parser(); "
              "[q.format_help() for q in p.commands.values()]; "
              "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('hetmoe._C')))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_omp_wait_policy_is_set_before_torch_loads(env):
    # OpenMP reads OMP_WAIT_POLICY when torch loads; parsing already loads it (the type of --numa), so main sets
    # it before parsing. A hook reports what the first `import torch` sees.
    script = ("import os, sys\n"
              "class Hook:\n"
              "    def find_spec(self, name, path=None, target=None):\n"
              "        if name == 'torch' and 'torch' not in sys.modules:\n"
              "            print('torch loads with', os.environ.get('OMP_WAIT_POLICY'), file=sys.stderr)\n"
              "sys.meta_path.insert(0, Hook())\n"
              "from hetmoe.cli import main\n"
              "raise SystemExit(main(sys.argv[1:]))\n")
    env = {k: v for k, v in env.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", script, "doctor", "--threads", "1"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert [line for line in out.stderr.splitlines() if "torch loads" in line] == ["torch loads with PASSIVE"]


def test_one_word_for_the_generated_tokens():
    # --max-tokens is max_tokens in Python and the API; the old flag names stay as aliases of the same setting.
    from hetmoe.cli import build_parser

    parser = build_parser()
    for command in ("generate", "chat"):
        assert parser.parse_args([command, "--max-tokens", "7"]).max_tokens == 7
        assert parser.parse_args([command, "--max-new-tokens", "9"]).max_tokens == 9
    assert parser.parse_args(["eval", "--text", "t", "--text-tokens", "5"]).text_tokens == 5
    assert parser.parse_args(["eval", "--text", "t", "--max-tokens", "6"]).text_tokens == 6


def test_bare_commands_print_their_help(capsys):
    code, stdout, stderr = main(capsys)  # bare `hetmoe`: the help on stdout, exit 0 (git, pip)
    assert code == 0 and stderr == "" and stdout.startswith("usage: hetmoe") and "generate" in stdout
    code, stdout, stderr = main(capsys, "bench")  # a missing benchmark: bench's help, a usage error
    assert code == 2 and stdout == "" and "kernel" in stderr and "overhead" in stderr
    assert stderr.splitlines()[-1] == "hetmoe bench: error: choose a benchmark: kernel, e2e, serve, overhead"
    code, stdout, _ = main(capsys, "chat", "--help")  # chat's own default, not generate's
    assert code == 0 and "(--max-new-tokens: the same; default: 512)" in " ".join(stdout.split())


def _into_a_closed_pipe(env, *args):
    """``hetmoe ARGS | head -0``, deterministically: stdout is a pipe whose read end is closed before it starts."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        out = subprocess.run([sys.executable, "-m", "hetmoe", *map(str, args)], stdout=write_end,
                             stderr=subprocess.PIPE, text=True, env=env, timeout=300)
    finally:
        os.close(write_end)
    return out.returncode, out.stderr


@pytest.mark.parametrize("args", [GEN, (*GEN, "--json")], ids=["generate-stream", "generate-json"])
def test_a_closed_pipe_ends_quietly(env, args):
    # As `cat` into a closed pipe: nothing on stderr about it, the status a shell shows for SIGPIPE (128 + 13).
    # Before: "Broken pipe" / "Exception ignored ... BrokenPipeError" and exit 1.
    code, stderr = _into_a_closed_pipe(env, *args)
    assert code == 141, stderr
    assert "Traceback" not in stderr and "Broken" not in stderr and "error" not in stderr.lower(), stderr
