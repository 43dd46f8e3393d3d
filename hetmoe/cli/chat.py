"""``hetmoe chat``: an interactive conversation whose replies stream back (the REPL: line editing and history
on a terminal, slash commands, Ctrl-C that stops a reply but keeps it); one message per line without a terminal."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
from pathlib import Path

from hetmoe import envs
from hetmoe.cli.options import add_sampling_options, open_llm
from hetmoe.config.flags import add_engine_options


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "chat", help="interactive chat that streams the reply (/help lists its commands)",
        description="A conversation with the model: type a message, the reply streams back. On a terminal: line "
        "editing and history (kept in $XDG_STATE_HOME/hetmoe/chat_history), Ctrl-C clears the line or stops a "
        "reply, Ctrl-D or /exit quits; /help lists the commands. Without a terminal, one message per line of stdin.")
    p.add_argument("--system", default=None, help="system message")
    add_engine_options(p)
    add_sampling_options(p, max_tokens=512)
    p.set_defaults(handler=run)
    return p


CHAT_HELP = """\
commands:
  /help    this list
  /reset   start a new conversation (the --system message stays)
  /exit    quit (also /quit, or Ctrl-D on an empty line)
A line whose first word is / and letters only (/help, /nope) is a command; to send such a line to the model,
start it with // (one / is taken off). Other lines are sent as they are, a path (/usr/lib/x) included.
Ctrl-C clears the line; during a reply it stops the reply at the next token, and the message and the reply so
far stay in the conversation (a second Ctrl-C stops at once). Up and Down browse the history.
When the conversation and the next message no longer fit the context (--max-context), the message is not
sent: /reset to start over."""

HISTORY_LENGTH = 1000  # lines kept in the history file
_COMMAND = re.compile(r"/([A-Za-z]+)(\s.*)?")


def history_path() -> Path:
    """$XDG_STATE_HOME/hetmoe/chat_history, ~/.local/state/hetmoe/chat_history when that is unset or relative
    (the XDG base directory spec)."""
    state = envs.XDG_STATE_HOME or ""
    base = Path(state) if os.path.isabs(state) else Path.home() / ".local" / "state"
    return base / "hetmoe" / "chat_history"


class _History:
    """readline's history of chat lines, read at the start and appended to the file at the end (so sessions
    running side by side both keep theirs), at most HISTORY_LENGTH lines. The file may hold private text: 0600."""

    def __init__(self, readline, path: Path):
        self.readline, self.path = readline, path
        readline.set_history_length(HISTORY_LENGTH)
        try:
            readline.read_history_file(str(path))
        except FileNotFoundError:
            pass
        except OSError as err:
            print(f"hetmoe chat: warning: cannot read the history {path}: {err}", file=sys.stderr)
        self.start = readline.get_current_history_length()

    def save(self) -> None:
        rl, path = self.readline, self.path
        new = rl.get_current_history_length() - self.start
        if new <= 0:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            if hasattr(rl, "append_history_file"):
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))  # readline appends only to a file
                rl.append_history_file(new, str(path))  # and truncates it to the history length
            else:  # libedit without append
                rl.write_history_file(str(path))
        except OSError as err:
            print(f"hetmoe chat: warning: cannot write the history {path}: {err}", file=sys.stderr)


class _StopReply(Exception):
    pass


class _ReplyInterrupt:
    """Ctrl-C during a reply: the first asks the reply to stop at its next piece of text, where the engine is
    between steps (its KV cache and LLM's prefix-reuse record agree); a second one raises KeyboardInterrupt at
    once, wherever the engine is."""

    def __init__(self):
        self.requested = False

    def _on_sigint(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._previous)


def _chat_timing(result) -> str:
    t = result.timings
    return (f"hetmoe: {t.new_prompt_tokens} new + {t.cached_tokens} cached prompt tokens in {t.prefill_s:.2f} s "
            f"({t.prefill_tok_s:.1f} tok/s), {result.completion_tokens} generated in {t.decode_s:.2f} s "
            f"({t.decode_tok_s:.1f} tok/s), finish: {result.finish_reason}")


def _reader(interactive: bool, history: bool):
    """A function that returns the next line (EOFError at the end): readline's ``input`` on a terminal."""
    if history:
        return lambda: input("> ")
    if interactive:  # stdin is a terminal, stdout is not: the prompt goes to stderr, no line editing
        return lambda: (print("> ", end="", file=sys.stderr, flush=True), input())[1]

    def read() -> str:
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line

    return read


def run(args: argparse.Namespace) -> int:
    llm = open_llm(args)
    if not llm.tokenizer.has_chat_template:
        raise ValueError("this model's tokenizer has no chat template; use `hetmoe generate --raw` instead")
    interactive = sys.stdin.isatty()
    history = None
    if interactive and sys.stdout.isatty():  # Python's input() uses readline only when both are terminals
        import readline

        history = _History(readline, history_path())
    try:
        return _chat_loop(llm, args.system, _reader(interactive, history is not None), interactive)
    finally:
        if history is not None:
            history.save()


def _chat_loop(llm, system, read, interactive: bool) -> int:
    system = [{"role": "system", "content": system}] if system else []
    messages = list(system)
    stop = _ReplyInterrupt()
    print("hetmoe chat: type a message; /help lists the commands, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            text = read().strip()
        except EOFError:
            if interactive:
                print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            if not interactive:
                raise
            print(file=sys.stderr)  # the line is dropped; a new prompt, the conversation kept
            continue
        if not text:
            continue
        command = _COMMAND.fullmatch(text)
        if command:
            name = command[1].lower()
            if command[2]:
                print(f"hetmoe chat: /{name} takes no arguments (/help lists the commands)", file=sys.stderr)
            elif name in ("exit", "quit"):
                return 0
            elif name == "help":
                print(CHAT_HELP, file=sys.stderr)
            elif name == "reset":
                messages = list(system)
                print("(conversation cleared)", file=sys.stderr)
            else:
                print(f"hetmoe chat: unknown command /{name}; /help lists the commands (start the line with // "
                      f"to send it to the model)", file=sys.stderr)
            continue
        # From Enter to the next prompt a Ctrl-C stops the reply (at its first piece when it comes before).
        with stop if interactive else contextlib.nullcontext():
            _reply(llm, messages, text[1:] if text.startswith("//") else text, stop, interactive)


def _reply(llm, messages: list, text: str, stop: _ReplyInterrupt,
           interactive: bool) -> None:
    """Stream the reply to ``text`` and append both to ``messages``, or neither when it cannot be answered."""
    messages.append({"role": "user", "content": text})
    n_prompt = len(llm.prompt_ids(messages, chat=True))
    if n_prompt >= llm.max_context:
        print(f"hetmoe chat: context full: the conversation and this message are {n_prompt} tokens, the "
              f"context holds {llm.max_context} (--max-context); /reset to start over", file=sys.stderr)
        messages.pop()
        return
    pieces = []

    def on_text(piece: str) -> None:
        pieces.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
        if stop.requested:
            raise _StopReply

    try:
        if stop.requested:  # Ctrl-C before the reply began
            raise _StopReply
        result = llm.chat(messages, on_text=on_text)
    except (_StopReply, KeyboardInterrupt):
        if not interactive:
            raise
        # Stopped inside a step (a second Ctrl-C) or between two: LLM trusts only the steps that completed, so the
        # next turn reuses what is cached and recomputes the rest.
        sys.stdout.write("\n")
        sys.stdout.flush()
        print("(stopped; the reply so far stays in the conversation)", file=sys.stderr)
        messages.append({"role": "assistant", "content": "".join(pieces)})
        return
    except ValueError as err:
        print(f"\nhetmoe chat: error: {err}", file=sys.stderr)
        messages.pop()
        return
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(_chat_timing(result), file=sys.stderr)
    messages.append({"role": "assistant", "content": result.text})
    if result.prompt_tokens + result.completion_tokens >= llm.max_context:
        print("hetmoe chat: context full: /reset to start over", file=sys.stderr)
