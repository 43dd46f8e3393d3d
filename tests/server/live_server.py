"""``hetmoe serve`` as a real process on a free loopback port, for the tests of this folder: start it, find the
address it printed, read its metrics, post raw bodies, read a streamed chat completion; and the server's HTTP stack
in this process, with an engine stand-in (``InProcess``, ``Echo``, ``Scripted``)."""

import json
import os
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

JSON = {"Content-Type": "application/json"}


class Server:
    """``hetmoe serve --port 0`` on the CPU with ``args`` (``model_dir`` None: the built-in model); stderr drained
    into ``lines``; ``url`` is the printed ``http://HOST:PORT/v1``."""

    def __init__(self, model_dir, env, *args, preexec_fn=None):
        cmd = [sys.executable, "-m", "hetmoe", "serve", "--port", "0", "--expert-cache", "off", "--device", "cpu",
               *(["--model", str(model_dir)] if model_dir is not None else []), *args]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=preexec_fn)
        self.lines, ready = [], threading.Event()
        self.url = None

        def read():  # drain stderr (a full pipe would block the server) and find the address it printed
            for line in self.proc.stderr:
                self.lines.append(line)
                m = re.search(r"serving \S+ on (http://\S+/v1)", line)
                if m:
                    self.url = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(180) or self.url is None:
            self.proc.kill()
            pytest.fail("the server did not start:\n" + "".join(self.lines))
        self.base = self.url[:-len("/v1")]
        self.port = int(self.base.rsplit(":", 1)[1])

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def metrics(self) -> dict:
        text = httpx.get(f"{self.base}/metrics", timeout=10).text
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def serve(tmp_path_factory, model_dir, *args):
    """A module fixture's body: a ``Server`` (its own XDG cache folder) yielded, then stopped."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path_factory.mktemp("xdg"))}
    srv = Server(model_dir, env, *args)
    yield srv
    srv.stop()


def openai_client(server, api_key="unused", timeout=120):
    import openai

    return openai.OpenAI(base_url=server.url, api_key=api_key, max_retries=0, timeout=timeout)


def post(server, path, body, key=None, raw=None, headers=None):
    """POST ``body`` as JSON (or ``raw`` bytes) with Content-Type: application/json and the bearer ``key``."""
    headers = {**JSON, **({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    content = raw if raw is not None else json.dumps(body)
    return httpx.post(f"{server.base}{path}", content=content, headers=headers, timeout=60)


def assert_error(response, status, param=None, code=None):
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def read_chat_stream(chunks) -> tuple:
    """(reasoning, content, {index: [name, arguments]}, finish reasons) of a streamed chat completion (openai SDK
    chunks)."""
    reasoning, content, calls, finish = "", "", {}, []
    for c in chunks:
        d = c.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
        for t in d.tool_calls or ():
            if t.id is not None:
                calls[t.index] = [t.function.name, ""]
            calls[t.index][1] += t.function.arguments or ""
        finish += [c.choices[0].finish_reason] if c.choices[0].finish_reason else []
    return reasoning, content, calls, finish

def wait_for(predicate, timeout=30.0):
    """Polls a condition of the server's state (the state lives in another process: polling is the interface)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


class Echo:
    """An engine stand-in for the HTTP side: answers every request at once with "ok" and keeps the prompt ids."""

    def __init__(self):
        from hetmoe.server.metrics import Metrics

        self.metrics, self.prompts = Metrics(), []

    def submit(self, req):
        self.prompts.append(list(req.prompt_ids))
        req.emit("text", "ok")
        req.emit("done", "stop", len(req.prompt_ids), 1)
        return req


class Scripted:
    """An engine stand-in: answers each request with the next of ``texts``, in pieces of ``piece`` characters (all at
    once when None; the server's chat path reads reasoning and tool calls out of it as it would out of a model's),
    and keeps each request's parameters in ``params``."""

    def __init__(self, piece=None):
        from hetmoe.server.metrics import Metrics

        self.metrics, self.piece, self.texts, self.params = Metrics(), piece, [], []

    def submit(self, req):
        self.params.append(req.params)
        text = self.texts.pop(0)
        step = self.piece or max(len(text), 1)
        for i in range(0, len(text), step):
            req.emit("text", text[i:i + step])
        req.emit("done", "stop", len(req.prompt_ids), len(text))
        return req


class InProcess:
    """The server's HTTP stack as ``hetmoe serve`` builds it (``create_app``, ``main.listen``, a ConnectionGuard
    and the accept-error handler) on a free loopback port, its event loop on a thread of its own, with ``Echo``
    (or ``engine``) for the engine: the HTTP rules tested without loading a model; ``app_options`` go to
    ``create_app``. ``call(fn)`` runs ``fn()`` on that loop."""

    def __init__(self, tokenizer, limits=None, api_key=None, allowed_hosts=None, split_special_tokens=True,
                 engine=None, **app_options):
        import asyncio

        from hetmoe.server.access import HostPolicy
        from hetmoe.server.app import create_app
        from hetmoe.server.connections import AcceptErrors, ConnectionGuard
        from hetmoe.server.limits import Limits
        from hetmoe.server.main import bind, listen
        from hetmoe.server.protocol import ServedModel, prompt_encoder

        self.engine = engine or Echo()
        self.served = ServedModel(id="m", prompt_ids=prompt_encoder(tokenizer, split_special_tokens),
                                  max_context=256, vocab_size=tokenizer.vocab_size,
                                  has_chat_template=tokenizer.has_chat_template, tokenizer=tokenizer)
        self.limits = limits or Limits.for_model(256, 2)
        self.sockets = bind("127.0.0.1", 0)
        self.port = self.sockets[0].getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.guard = ConnectionGuard(self.limits.max_connections, self.limits.header_timeout,
                                     self.limits.keepalive_timeout, 1, self.engine.metrics)
        self.app = create_app(self.served, self.engine, api_key, limits=self.limits, guard=self.guard,
                              hosts=HostPolicy.for_server("127.0.0.1", self.sockets, allowed_hosts), **app_options)
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(AcceptErrors())
        ready = threading.Event()

        async def start():
            self.runner, self.listening = await listen(self.app, self.sockets, self.limits, self.guard)

        def run():
            self.loop.run_until_complete(start())
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(30)

    def call(self, fn, timeout=30):
        """``fn()`` evaluated on the server's loop (its state is the loop's alone)."""
        import asyncio

        async def run():
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def close(self):
        import asyncio

        from hetmoe.server.main import stop_listening

        async def stop():
            stop_listening(self.listening)
            await self.runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()
        for s in self.sockets:
            s.close()
