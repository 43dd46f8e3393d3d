"""``--config FILE`` (hetmoe/config/file.py, the hook in hetmoe/cli/options.py) and ``hetmoe tune``
(hetmoe/tools/tune.py, hetmoe/cli/tune.py): a config file's errors name FILE:LINE and the key, flags win over the
file and the file over the defaults, inline rules keep their lines; tune on the built-in model (CPU alone, quick,
a tiny candidate set) writes a file that --config loads back into the options it chose; tune's choice from measured
rates (injected: no timing decides a test) keeps the default unless a candidate beats it by more than the noise. The
CPU engine runs on the machine's best ISA; nothing here asserts a speed."""

from pathlib import Path

import pytest

from hetmoe.cli import build_parser
from hetmoe.cli import main as cli_main
from hetmoe.config import file as config_file
from hetmoe.config import rules
from hetmoe.config.file import ConfigError
from hetmoe.config.flags import engine_options
from hetmoe.config.options import EngineOptions
from hetmoe.engine.llm import default_model_path
from hetmoe.load.loader import moe_blocks
from hetmoe.tools.tune import NOISE_FLOOR, Row, Source, Tuner, decide, interleave, stage_noise, thread_candidates


def run_cli(capsys, *args):
    """``hetmoe ARGS`` in this process -> (exit code, stdout, stderr)."""
    try:
        code = cli_main([str(a) for a in args])
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def options_of(*args) -> EngineOptions:
    """The EngineOptions ``hetmoe generate ARGS`` would run with."""
    return engine_options(build_parser().parse_args(["generate", *map(str, args)]))


def write(tmp_path, text: str, name: str = "engine.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------------- --config


def test_the_file_sets_options_and_flags_win(tmp_path):
    path = write(tmp_path, "threads: 2\ndefer_experts: 1\ngpu_prefill: off\ndense_format: int8\ncuda_graph: false\n"
                           "experts_format: int4\ngroup_size: 32\n")
    got = options_of("--config", path)
    assert got == EngineOptions(threads=2, defer_experts=1, gpu_prefill="off", dense_format="int8", cuda_graph=False,
                                experts_format="int4", group_size=32)
    # a flag given on the command line wins, even where it repeats the default (0 deferred, the graph on: no flag)
    got = options_of("--config", path, "--threads", 1, "--defer-experts", 0, "--dense-format", "auto")
    assert (got.threads, got.defer_experts, got.dense_format) == (1, 0, "auto")
    assert (got.gpu_prefill, got.cuda_graph, got.experts_format) == ("off", False, "int4")
    assert options_of() == EngineOptions()  # no file: the defaults


def test_inline_rules_are_read_from_the_config_file(tmp_path):
    path = write(tmp_path, "threads: 1\nrules:\n  - match: 'model\\.layers\\.1\\.mlp\\.experts'\n"
                           "    experts_format: int4\n")
    got = options_of("--config", path)
    assert got.rules == str(path)
    loaded = rules.load(got.rules)
    assert len(loaded) == 1 and loaded.rules[0].line == 3 and loaded.rules[0].placement.experts_format == "int4"
    # a rules file next to the config file, by a relative path
    write(tmp_path, "- match: lm_head\n  dtype: fp32\n", "r.yaml")
    assert options_of("--config", write(tmp_path, "rules: r.yaml\n", "c2.yaml")).rules == str(tmp_path / "r.yaml")


@pytest.mark.parametrize("text, where, words", [
    ("threads: 2\nthreadz: 4\n", 2, ["unknown key 'threadz'", "threads"]),
    ("threads: 2\nno_cuda_graph: true\n", 2, ["no_cuda_graph", "cuda_graph"]),
    ("\nthreads: many\n", 2, ["threads", "expected a positive integer, got many"]),
    ("defer_experts: -1\n", 1, ["defer_experts", ">= 0"]),
    ("device: cuda\ndense_format: int3\n", 2, ["dense_format", "int3"]),
    ("gpu_prefill: sometimes\n", 1, ["gpu_prefill", "sometimes"]),
    ("cuda_graph: maybe\n", 1, ["cuda_graph", "true or false"]),
    ("threads:\n  - 1\n  - 2\n", 2, ["threads", "single value"]),
    ("threads: 1\nthreads: 2\n", 2, ["threads", "given twice"]),
    ("experts_format: int4\ngroup_size: 24\n", 2, ["group_size", "expected one of 0, 16, 32, 64, 128, got 24"]),
    ("- threads: 2\n", 1, ["expected a mapping"]),
    ("just text\n", 1, ["expected a mapping"]),
    ("threads: [1\n", 2, ["not valid YAML"]),
    ("rules:\n  - match: lm_head\n    dtype: fp16\n", 3, ["rule 1", "dtype", "fp16"]),
    ("rules: 3\n", 1, ["rules", "cannot read"]),
])
def test_config_errors_name_the_file_line_and_key(tmp_path, capsys, text, where, words):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        config_file.read(path)
    assert str(err.value).startswith(f"{path}:{where}:"), str(err.value)
    for word in words:
        assert word in str(err.value)
    # on the command line: the usage error path, exit status 2, before anything loads
    code, _, stderr = run_cli(capsys, "generate", "--config", path, "--max-tokens", 1)
    assert code == 2 and f"hetmoe generate: error: --config: {path}:{where}:" in stderr


def test_an_empty_or_missing_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"engine\.yaml: the config file is empty"):
        config_file.read(write(tmp_path, "# nothing\n"))
    with pytest.raises(ConfigError, match="cannot read the config file"):
        config_file.read(tmp_path / "absent.yaml")


def test_render_reads_back(tmp_path):
    values = {"threads": 3, "gpu_prefill": "off", "cuda_graph": False, "dense_format": "int8", "max_context": 512}
    path = write(tmp_path, config_file.render(values, ("made by a test", "second line")))
    text = path.read_text()
    assert text.startswith("# made by a test\n# second line\n")
    assert config_file.read(path) == values
    with pytest.raises(ValueError, match="not an engine option"):
        config_file.render({"max_batch": 2})


# ---------------------------------------------------------------------------------------------- hetmoe tune


def test_thread_candidates():
    for cores in (1, 2, 3, 8, 56):
        for gpu in (False, True):
            for quick in (False, True):
                got = thread_candidates(cores, gpu, quick)
                assert got and got == sorted(set(got), reverse=True) and min(got) >= 1 and max(got) <= cores
    assert thread_candidates(16, True, False) == [16, 15, 14, 8]


def row(value, rate, noise=0.05, n=4, **kw) -> Row:
    """A measured candidate: ``n`` runs around ``rate``, the farthest ``noise`` from it (``rate`` is their median)."""
    r = Row("threads", "threads", value, **kw)
    r.add([rate * (1 + noise * f) for f in (-1, -0.2, 0.2, 1, 0, 0)[:n]])
    return r


def test_a_win_inside_the_noise_keeps_the_default():
    rows = [row(8, 100.0), row(16, 102.0), row(4, 90.0)]  # the default first in the table, 16 is 2% faster
    d = decide("threads", rows, 0.01, default=8)
    assert stage_noise(rows) == pytest.approx(0.05) and d.noise == pytest.approx(0.05)
    assert d.chosen.value == 8 and d.kept and [r.value for r in d.within_noise] == [16]
    assert d.line() == "threads chosen: 8 (the default, kept): 16 (+2.0%) within noise (±5.0%)"


def test_a_clear_win_is_chosen():
    d = decide("threads", [row(8, 100.0), row(16, 120.0), row(4, 90.0)], 0.01, default=8)
    assert d.chosen.value == 16 and not d.kept and d.baseline.value == 8
    assert d.line() == "threads chosen: 16, +20.0% over the default 8, beyond the noise (±5.0%)"


def test_the_noise_has_a_floor():
    quiet = [row(8, 100.0, noise=0.0), row(16, 102.0, noise=0.0)]  # identical runs: no spread measured
    assert stage_noise(quiet) == NOISE_FLOOR and decide("t", quiet, 0.01, default=8).chosen.value == 8
    d = decide("t", [row(8, 100.0, noise=0.0), row(16, 104.0, noise=0.0)], 0.01, default=8)
    assert d.chosen.value == 16 and "beyond the noise (±3.0%)" in d.line()


def test_one_slow_run_does_not_set_the_noise_alone():
    rows = [row(8, 100.0, noise=0.01, n=6), row(16, 110.0, noise=0.01, n=6), row(4, 95.0, noise=0.01, n=6)]
    rows[2].add([50.0])  # one run of 19 stalled
    assert rows[2].spread > 0.4 and stage_noise(rows) < 0.05
    assert decide("t", rows, 0.01, default=8).chosen.value == 16


def test_two_runs_whose_winners_swap_within_the_noise_choose_alike():
    """Both 16 and 12 beat the default clearly, by amounts within the noise of each other: the first of them in the
    stage's order is chosen, whichever measured faster this time."""
    for a, b in ((130.0, 133.0), (133.0, 130.0)):
        d = decide("t", [row(8, 100.0, noise=0.02), row(16, a, noise=0.02), row(12, b, noise=0.02)], 0.01, 8)
        assert d.chosen.value == 16
    assert "12 (+33.0%) is within noise of it" in decide("t", [row(8, 100.0, noise=0.02), row(16, 130.0, noise=0.02),
                                                               row(12, 133.0, noise=0.02)], 0.01, 8).line()


def test_decide_takes_only_what_is_within_the_bound():
    rows = [row(0, 100.0, ppl_change=0.0, exact=True), row(1, 112.0, ppl_change=0.004),
            row(2, 150.0, ppl_change=0.02), Row("s", "o", 3, note="not built")]
    assert decide("d", rows, 0.01, default=0).chosen.value == 1
    assert decide("d", rows, 0.05, default=0).chosen.value == 2
    assert decide("d", rows[1:], 0.001, default=0).chosen is None  # every timed row over the bound
    assert "nothing chosen" in decide("d", rows[1:], 0.001, default=0).line()
    # no default among them: the first accepted is the baseline
    d = decide("t", [row(1, 100.0), row(2, 101.0)], 0.01, default=14)
    assert d.chosen.value == 1 and "(the first candidate, kept)" in d.line()
    d = decide("t", [row(1, 100.0)], 0.01, default=1)
    assert d.chosen.value == 1 and "the only candidate accepted" in d.line()


def test_candidates_are_timed_interleaved():
    assert interleave([1, 2, 3], 2) == [(1, 1), (2, 1), (3, 2), (2, 1), (1, 1)]  # 3, 3 merged: one build
    assert interleave([1, 2], 3) == [(1, 1), (2, 2), (1, 2), (2, 1)]
    assert interleave(["bf16"], 2) == [("bf16", 2)]


def test_the_deferral_stage_stops_at_the_first_d_over_the_bound():
    """On the CPU (deferral applies to every forward call): with a bound no deferral can meet, d = 1 is measured
    and refused, the larger d are not tried, d = 0 is chosen and the model is left undeferred."""
    source = Source(default_model_path(), expert_cache=None)
    tuner = Tuner(source, EngineOptions(device="cpu", threads=1), quick=True, max_ppl_change=-1.0,
                  candidates={"defer_experts": [0, 1, 2, 3]})
    loaded = source.build(tuner.work)
    tuner.tune_deferral(loaded)
    by_d = {r.value: r for r in tuner.rows}
    assert by_d[0].ppl_change == 0 and by_d[0].chosen and tuner.tuned["defer_experts"] == 0
    assert by_d[1].tok_s is not None and by_d[1].ppl_change > -1 and not by_d[1].chosen
    assert by_d[2].tok_s is None and by_d[3].tok_s is None and "not tried" in by_d[3].note
    assert all(layer.defer == 0 for _, layer in moe_blocks(loaded.model))


@pytest.fixture
def tune_run(tmp_path, capsys, monkeypatch):
    """``hetmoe tune --quick`` on the built-in model, CPU alone, a tiny candidate set (threads 1 and 2, bf16 dense)
    -> (its result, stdout, the file written)."""
    results = []
    run = Tuner.run
    monkeypatch.setattr(Tuner, "run", lambda self: results.append(run(self)) or results[-1])
    out = tmp_path / "tuned.yaml"
    code, stdout, stderr = run_cli(capsys, "tune", "--quick", "--device", "cpu", "--expert-cache", "off",
                                   "--try", "threads=1,2", "--try", "dense_format=bf16", "--out", out)
    assert code == 0, stderr
    return results[0], stdout, out


def test_tune_writes_a_config_that_gives_the_choice_back(tune_run):
    result, stdout, out = tune_run
    assert set(result.tuned) == {"threads", "dense_format"}  # CPU alone: no GPU experts, deferral, prefill
    assert result.options == EngineOptions(device="cpu", **result.tuned)
    # the written file, through --config, gives exactly the chosen options
    assert options_of("--config", out) == result.options
    text = out.read_text()
    assert text.startswith("# hetmoe tune:") and "# machine:" in text and "# model:" in text
    assert f"threads: {result.tuned['threads']}\n" in text
    # every candidate is in the table, timed in every pass; one chosen per stage: the baseline, or a candidate
    # faster than it by more than the stage's noise; the table and the file say which and why
    assert [d.stage for d in result.decisions] == ["threads", "dense format"]
    for d, option in zip(result.decisions, ("threads", "dense_format")):
        rows = [r for r in result.rows if r.stage == d.stage]
        assert [r for r in rows if r.chosen] == [d.chosen] and d.chosen.value == result.tuned[option]
        assert all(len(r.rates) == result.budget.repeats for r in rows)
        assert d.noise >= NOISE_FLOOR and (d.kept or d.chosen.tok_s > d.baseline.tok_s * (1 + d.noise))
        assert d.line() in stdout.splitlines() and f"# {d.line()}" in text.replace("\n#   ", " ")
    assert sorted(r.value for r in result.rows if r.stage == "threads") == [1, 2]
    assert len([line for line in stdout.splitlines() if line.startswith(("threads  ", "dense format  "))]) == \
        len(result.rows)
    bf16 = next(r for r in result.rows if r.value == "bf16")
    assert bf16.ppl_change == 0  # the reference itself


def test_tune_keeps_the_default_where_the_candidates_are_within_noise(tmp_path, capsys, monkeypatch):
    """The whole command on injected rates (the builds are real, the timings not): of threads 1 and 2 the one that
    is not the baseline (the engine's default, else the first listed) runs 2% faster within ±5%: the baseline is
    kept, and the table, the printed summary and the file say the other is within noise; int8 20% faster than bf16
    is chosen. The candidates are timed in interleaved passes (ABBA), each build timed once per pass."""
    from hetmoe.cpu import default_threads

    baseline = default_threads() if default_threads() in (1, 2) else 1
    other = 3 - baseline
    rates = {baseline: 100.0, other: 102.0, "bf16": 100.0, "int8": 120.0}
    timed = []

    def fake(self, row, loaded, runs):
        timed.append((row.value, runs))
        return [rates[row.value] * (1 + 0.05 * f) for f in (-1, 1, -0.2, 0.2)[:runs]]

    monkeypatch.setattr(Tuner, "time_runs", fake)
    out = tmp_path / "tuned.yaml"
    code, stdout, stderr = run_cli(capsys, "tune", "--quick", "--device", "cpu", "--expert-cache", "off",
                                   "--try", "threads=1,2", "--try", "dense_format=bf16,int8", "--out", out)
    assert code == 0, stderr
    assert timed == [(1, 2), (2, 4), (1, 2), ("bf16", 2), ("int8", 4), ("bf16", 2)]
    what = "the default" if baseline == default_threads() else "the first candidate"
    kept = f"threads chosen: {baseline} ({what}, kept): {other} (+2.0%) within noise (±5.0%)"
    win = "dense format chosen: int8, +20.0% over the default bf16, beyond the noise (±5.0%)"
    lines = stdout.splitlines()
    assert kept in lines and win in lines
    assert any(line.startswith("threads  ") and line.endswith("chosen  faster ones within noise (±5.0%)")
               for line in lines)
    text = out.read_text().replace("\n#   ", " ")
    assert f"# {kept}\n" in text and f"# {win}\n" in text
    assert options_of("--config", out) == EngineOptions(device="cpu", threads=baseline, dense_format="int8")


def test_tune_keeps_the_flags_given(tmp_path, capsys):
    out = tmp_path / "t.yaml"
    code, stdout, stderr = run_cli(capsys, "tune", "--quick", "--device", "cpu", "--expert-cache", "off",
                                   "--threads", 1, "--dense-format", "bf16", "--out", out)
    assert code == 0, stderr
    assert options_of("--config", out) == EngineOptions(device="cpu", threads=1, dense_format="bf16")
    assert "kept as given: threads, dense_format" in out.read_text()


@pytest.mark.parametrize("args, message", [
    (("--try", "threadz=1,2"), "OPTION one of threads"),
    (("--try", "threads=one"), "threads: one is not a value of --threads"),
    (("--try", "dense_format=int3"), "dense_format: expected"),
    (("--max-ppl-change", "-1"), "expected a percentage"),
])
def test_tune_usage_errors(capsys, args, message):
    code, _, stderr = run_cli(capsys, "tune", *args)
    assert code == 2 and message in stderr
