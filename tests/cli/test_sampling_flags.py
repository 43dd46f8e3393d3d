"""The sampling flags of ``hetmoe generate`` and ``hetmoe chat`` (hetmoe/cli/options.py, types in
hetmoe/config/flags.py): --min-p, --repetition-penalty, --presence-penalty, --frequency-penalty reach
SamplingParams, change the built-in model's greedy reply, and bad values are usage errors naming the flag."""

import json

import pytest

from hetmoe.cli import main as cli_main

GEN = ("generate", "--expert-cache", "off", "--device", "cpu", "--max-tokens", "8", "--raw", "--json",
       "--prompt", "1, 2, 1, 2, 1, 2, 1, 2,")


def run(capsys, *args):
    try:
        code = cli_main([str(a) for a in args])
    except SystemExit as e:  # argparse
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_the_flags_reach_sampling_params(command):
    from hetmoe.cli import build_parser
    from hetmoe.cli.options import sampling_params

    parser = build_parser()
    args = parser.parse_args([command, "--min-p", "0.25", "--repetition-penalty", "1.3", "--presence-penalty",
                              "-0.5", "--frequency-penalty", "2"])
    params = sampling_params(args)
    assert (params.min_p, params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (
        0.25, 1.3, -0.5, 2.0)
    plain = sampling_params(parser.parse_args([command]))
    assert (plain.min_p, plain.repetition_penalty, plain.presence_penalty, plain.frequency_penalty) == (
        0.0, 1.0, 0.0, 0.0)


def test_a_penalty_changes_the_greedy_reply(capsys):
    code, out, err = run(capsys, *GEN)
    assert code == 0, err
    plain = json.loads(out)["text"]
    for flag, value in (("--repetition-penalty", 5), ("--presence-penalty", 2), ("--frequency-penalty", 2)):
        code, out, err = run(capsys, *GEN, flag, value)
        assert code == 0 and json.loads(out)["text"] != plain, (flag, err)
    code, out, err = run(capsys, *GEN, "--temperature", 1, "--seed", 3, "--min-p", 1)
    assert code == 0 and json.loads(out)["text"] == plain, err  # min_p 1 keeps the most likely token only


@pytest.mark.parametrize("args, message", [
    (("--min-p", "1.5"), "--min-p: expected a number in [0, 1], got 1.5"),
    (("--repetition-penalty", "0"), "--repetition-penalty: expected a finite number > 0, got 0"),
    (("--repetition-penalty", "inf"), "--repetition-penalty: expected a finite number > 0, got inf"),
    (("--presence-penalty", "3"), "--presence-penalty: expected a number in [-2, 2], got 3"),
    (("--frequency-penalty", "nan"), "--frequency-penalty: expected a number in [-2, 2], got nan"),
])
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_bad_values_are_usage_errors(capsys, command, args, message):
    code, out, err = run(capsys, command, *args)
    assert code == 2 and out == "" and err.splitlines()[-1] == f"hetmoe {command}: error: {message}", err
