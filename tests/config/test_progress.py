"""Progress (hetmoe/config/units.py ``show_progress``): a tqdm bar only on a terminal; in a log (a stream that is
not a TTY) plain lines, no carriage returns, at most one per period; nothing when progress is off."""

import io

from hetmoe.config.units import show_progress


class TTY(io.StringIO):
    def isatty(self):
        return True


def _run(stream, enabled=True, every_s=30.0, n=5):
    said = []
    with show_progress(n, "loading", "layer", enabled, stream=stream, say=said.append, every_s=every_s) as bar:
        for _ in range(n):
            bar.update(1)
    return said


def test_a_log_gets_no_bar():
    stream = io.StringIO()
    assert _run(stream) == [] and stream.getvalue() == ""  # short work: not a word
    lines = _run(stream, every_s=0)  # a period of 0: a line per update but the last (the caller's summary says it)
    assert lines == [f"hetmoe: loading {i}/5 layers ({0} s)" for i in range(1, 5)]
    assert stream.getvalue() == "" and not any("\r" in line for line in lines)


def test_a_log_by_default_prints_plain_lines_to_the_stream():
    stream = io.StringIO()
    with show_progress(3, "eval", "token", True, stream=stream, every_s=0) as bar:
        bar.update(1)
    assert stream.getvalue() == "hetmoe: eval 1/3 tokens (0 s)\n"


def test_a_terminal_gets_a_bar_and_off_means_nothing():
    tty = TTY()
    assert _run(tty, every_s=0) == []
    assert "\r" in tty.getvalue() and "loading" in tty.getvalue()  # tqdm's bar
    quiet_tty, log = TTY(), io.StringIO()
    assert _run(quiet_tty, enabled=False, every_s=0) == [] and _run(log, enabled=False, every_s=0) == []
    assert quiet_tty.getvalue() == "" and log.getvalue() == ""
