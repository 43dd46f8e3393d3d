"""`hetmoe chat` as people use it: a real process on a pseudo-terminal (readline editing, history, Ctrl-C at the
prompt, the commands, a full context, the timing line's new and cached prompt tokens), and the loop itself in
this process with a scripted model where a signal has to land at an exact point (Ctrl-C during a reply).
Every wait is for a state (text on the terminal, the end of the process), with a deadline; nothing sleeps."""

import os
import pty
import re
import select
import signal
import sys
import time
from types import SimpleNamespace

import pytest

from hetmoe.cli import chat

DEADLINE_S = 120  # a loaded 2-core CI machine: the torch import and the model load come first


class Terminal:
    """``python -m hetmoe ARGS`` with a pseudo-terminal as its stdin, stdout and stderr (and controlling
    terminal, so Ctrl-C is the line discipline's SIGINT, as in a shell)."""

    def __init__(self, args, env):
        pid, fd = pty.fork()
        if pid == 0:  # the child: exec at once, with Ctrl-C's default (a shell's & or CI may have ignored it)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execve(sys.executable, [sys.executable, "-m", "hetmoe", *map(str, args)], env)
        self.pid, self.fd, self.out, self.seen = pid, fd, b"", 0

    def _read(self, deadline: float) -> bool:
        """More output (False at the end: the child closed the terminal)."""
        ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise AssertionError(f"waited {DEADLINE_S} s; the terminal shows:\n{self.out[self.seen:].decode()}")
        try:
            chunk = os.read(self.fd, 65536)
        except OSError:  # EIO: every writer closed the terminal
            chunk = b""
        self.out += chunk
        return bool(chunk)

    def expect(self, *markers: str) -> str:
        """The output up to and including each of ``markers`` in turn (the output read after the last call)."""
        deadline = time.monotonic() + DEADLINE_S
        start = self.seen
        for marker in markers:
            m = marker.encode()
            while m not in self.out[self.seen:]:
                if not self._read(deadline):
                    raise AssertionError(f"the chat ended before {marker!r}:\n{self.out[start:].decode()}")
            self.seen = self.out.index(m, self.seen) + len(m)
        return self.out[start:self.seen].decode()

    def send(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def wait_reading(self) -> None:
        """Until the child's main thread waits for a key (in readline's select). Python's readline turns a Ctrl-C
        into KeyboardInterrupt only when it interrupts that wait: one that lands while readline is still handling
        the previous key is kept until the next key (a window of microseconds for a person, but the test types
        at machine speed right after seeing the echo)."""
        deadline = time.monotonic() + DEADLINE_S
        while True:
            try:
                with open(f"/proc/{self.pid}/wchan") as f:
                    wchan = f.read()
                with open(f"/proc/{self.pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:  # no procfs: nothing to wait on
                return
            # where the kernel hides wchan ("0"), a sleeping main thread is the best sign there is
            if state == "S" and ("select" in wchan or "poll" in wchan or wchan in ("", "0")):
                return
            assert time.monotonic() < deadline, f"the chat never waited for a key ({state} {wchan})"
            time.sleep(0.001)

    def finish(self) -> tuple:
        """(exit status, the rest of the output) once the child has ended."""
        deadline = time.monotonic() + DEADLINE_S
        while self._read(deadline):
            pass
        _, status = os.waitpid(self.pid, 0)
        os.close(self.fd)
        return os.waitstatus_to_exitcode(status), self.out[self.seen:].decode()


PROMPT = "> "
TIMING = re.compile(r"hetmoe: (\d+) new \+ (\d+) cached prompt tokens in [0-9.]+ s \([0-9.]+ tok/s\), "
                    r"(\d+) generated in [0-9.]+ s")


def _timing(text: str) -> tuple:
    lines = TIMING.findall(text)
    assert len(lines) == 1, text
    return tuple(map(int, lines[0]))


def test_chat_on_a_terminal(qwen3_checkpoint, isolated_env, tmp_path):
    from hetmoe.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(qwen3_checkpoint)

    def n_tokens(*texts):
        return len(tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "user", "content": t} for t in texts], add_generation_prompt=True), add_special_tokens=False))

    state = tmp_path / "state"
    env = {**isolated_env, "XDG_STATE_HOME": str(state), "HOME": str(tmp_path), "INPUTRC": os.devnull,
           "TERM": "xterm"}
    long_message = " ".join(["word"] * 300)
    assert n_tokens(long_message) > 96 > n_tokens("abcd") + 4 + n_tokens("hi")  # what --max-context 96 holds
    term = Terminal(["chat", "--model", qwen3_checkpoint, "--device", "cpu", "--expert-cache", "off",
                     "--max-tokens", 4, "--max-context", 96], env)
    term.expect("/help lists the commands", PROMPT)

    # Line editing: "abd", left arrow, "c" is the message "abcd"; the raw keys would be other tokens.
    assert n_tokens("abd\x1b[Dc") != n_tokens("abcd")
    term.send("abd\x1b[Dc\r")
    new, cached, generated = _timing(term.expect("finish: ", PROMPT))
    assert (new, cached) == (n_tokens("abcd"), 0) and 1 <= generated <= 4

    term.send("hi\r")  # the first turn stays in the cache: only the reply and the new message are computed
    new, cached, _ = _timing(term.expect("finish: ", PROMPT))
    assert cached >= n_tokens("abcd") and new >= 1

    term.send("xyz")  # typed (readline shows it), then Ctrl-C clears the line: a new prompt, nothing sent
    term.expect("xyz")
    term.wait_reading()
    term.send("\x03")
    assert "tok/s" not in term.expect(PROMPT)

    term.send("/help\r")
    shown = term.expect("/reset", PROMPT)
    assert "/exit" in shown and "//" in shown and "tok/s" not in shown
    term.send("/nope\r")
    shown = term.expect("unknown command /nope", PROMPT)
    assert "/help lists the commands" in shown and "tok/s" not in shown

    term.send(long_message + "\r")  # refused before it reaches the model, with the way out
    shown = term.expect("context full", PROMPT)
    assert "/reset to start over" in shown and "tok/s" not in shown

    term.send("/reset\r")
    term.expect("(conversation cleared)", PROMPT)
    term.send("//reset\r")  # the escape: sent to the model as "/reset"
    new, cached, _ = _timing(term.expect("finish: ", PROMPT))
    assert new + cached == n_tokens("/reset")

    term.send("\x04")  # Ctrl-D on an empty line quits
    code, rest = term.finish()
    assert code == 0 and "Traceback" not in term.out.decode(errors="replace"), rest
    history = (state / "hetmoe" / "chat_history").read_text().splitlines()
    assert history == ["abcd", "hi", "/help", "/nope", long_message, "/reset", "//reset"]
    assert (state / "hetmoe" / "chat_history").stat().st_mode & 0o077 == 0


def test_history_is_bounded_and_appended(tmp_path):
    readline = pytest.importorskip("readline")
    path = tmp_path / "hetmoe" / "chat_history"
    path.parent.mkdir()
    path.write_text("".join(f"old {i}\n" for i in range(chat.HISTORY_LENGTH + 50)))
    readline.clear_history()
    try:
        history = chat._History(readline, path)
        readline.add_history("new 1")
        readline.add_history("new 2")
        history.save()
    finally:
        readline.clear_history()
    lines = path.read_text().splitlines()
    assert len(lines) == chat.HISTORY_LENGTH and lines[-2:] == ["new 1", "new 2"]
    assert lines[-3] == f"old {chat.HISTORY_LENGTH + 49}"


def test_history_path(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert chat.history_path() == tmp_path / "hetmoe" / "chat_history"
    monkeypatch.setenv("XDG_STATE_HOME", "relative/dir")  # the spec: ignored unless absolute
    monkeypatch.setenv("HOME", str(tmp_path))
    assert chat.history_path() == tmp_path / ".local" / "state" / "hetmoe" / "chat_history"


# ---------------------------------------------------------------- Ctrl-C during a reply, in this process


class ScriptedLLM:
    """What the chat loop uses of LLM: each reply is a list of pieces; "^C" in it is a SIGINT to this process
    at that point of the reply (the handler runs before the next piece)."""

    max_context = 1000

    def __init__(self, replies):
        self.replies, self.seen = list(replies), []
        self.default_params, self.early_sent = None, False

    def prompt_ids(self, messages, chat):
        if messages[-1]["content"] == "early" and not self.early_sent:  # Ctrl-C after Enter, before the reply
            self.early_sent = True
            os.kill(os.getpid(), signal.SIGINT)
        return list(range(sum(len(m["content"]) + 1 for m in messages)))

    def chat(self, messages, on_text):
        self.seen.append([dict(m) for m in messages])
        pieces = []
        for piece in self.replies.pop(0):
            if piece == "^C":
                os.kill(os.getpid(), signal.SIGINT)
            else:
                on_text(piece)
                pieces.append(piece)
        return SimpleNamespace(text="".join(pieces), prompt_tokens=1, completion_tokens=1, finish_reason="stop",
                               timings=SimpleNamespace(prefill_s=0.0, decode_s=0.0, decode_tok_s=0.0, cached_tokens=0,
                                                       new_prompt_tokens=1, prefill_tok_s=0.0))


def test_ctrl_c_stops_the_reply_and_keeps_it(capsys):
    lines = iter(["first", "second", "early", "third"])

    def read():
        line = next(lines, None)
        if line is None:
            raise EOFError
        return line

    llm = ScriptedLLM([["Hel", "^C", "lo", "never"], ["a", "^C", "^C", "never"], ["ok"]])
    before = signal.getsignal(signal.SIGINT)
    assert chat._chat_loop(llm, None, read, interactive=True) == 0
    assert signal.getsignal(signal.SIGINT) is before
    out = capsys.readouterr()
    # The first Ctrl-C stops the reply at its next piece: "lo" is streamed, then the reply ends, and the
    # message and the reply so far stay in the conversation.
    assert llm.seen[1] == [{"role": "user", "content": "first"}, {"role": "assistant", "content": "Hello"},
                           {"role": "user", "content": "second"}]
    assert "never" not in out.out and out.err.count("(stopped") == 3
    # A second Ctrl-C stops at once (KeyboardInterrupt wherever the engine is): the reply so far stays too (what
    # the cache may then hold is LLM's concern: tests/cli/test_cli.py test_an_interrupted_step_is_not_reused).
    # A Ctrl-C between Enter and the reply stops the reply before it starts: the message stays, with no reply.
    assert llm.seen[2][-4:] == [{"role": "assistant", "content": "a"}, {"role": "user", "content": "early"},
                                {"role": "assistant", "content": ""}, {"role": "user", "content": "third"}]
    assert "ok" in out.out and out.err.count("cached prompt tokens") == 1
