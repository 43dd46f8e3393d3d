"""The server's other endpoints and options: /tokenize, /detokenize, /tokenizer_info, --served-model-name,
--chat-template, --cors-origins, the access log, SSE keep-alive during a prefill, cached_tokens, the sampling fields
(penalties, logit_bias, stop_token_ids) and the fields still refused by name. Most against one ``hetmoe serve`` of
the built-in model with all the options; the keep-alive and the access log in process (live_server.InProcess)
with an engine stand-in that the test releases."""

import json
import os
import re
import subprocess
import sys
import threading

import httpx
import openai
import pytest
from live_server import JSON, InProcess, Server, assert_error, openai_client

from hetmoe.server import protocol

KEY = "test-key"
NAMES = ("main-name", "alias-name")
ORIGIN = "http://ui.example:3000"
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("endpoints")
    (tmp / "template.jinja").write_text(TEMPLATE)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp / "xdg")}
    srv = Server(None, env, "--api-key", KEY, "--max-batch", "4", "--served-model-name", *NAMES,
                 "--chat-template", str(tmp / "template.jinja"), "--cors-origins", f"{ORIGIN},https://other.example")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, KEY)


@pytest.fixture(scope="module")
def tok():
    from hetmoe.engine.llm import default_model_path
    from hetmoe.tokenizer import Tokenizer

    return Tokenizer.from_dir(default_model_path())


def post(server, path, body, headers=None):
    return httpx.post(f"{server.base}{path}", content=json.dumps(body), headers={**JSON, **AUTH, **(headers or {})},
                      timeout=60)


# ---------------------------------------------------------------- names and the chat template

def test_served_model_names(server, client):
    assert [m.id for m in client.models.list().data] == [NAMES[0]]
    assert client.models.retrieve(NAMES[1]).id == NAMES[0]
    for name in NAMES:
        r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert r.model == NAMES[0]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="hetmoe-default", prompt="Hi", max_tokens=1)


def test_chat_template_file_replaces_the_models(server, client, tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    want = tok.encode("[system] Be brief.\n[user] Hello\n[assistant] ", add_special_tokens=False)
    r = post(server, "/tokenize", {"messages": messages})
    assert r.status_code == 200 and r.json()["tokens"] == want
    c = client.chat.completions.create(model=NAMES[0], messages=messages, max_tokens=1)
    assert c.usage.prompt_tokens == len(want)
    assert post(server, "/tokenizer_info", {}).status_code == 405
    info = httpx.get(f"{server.base}/tokenizer_info", headers=AUTH).json()
    assert info["chat_template"] == TEMPLATE and info["eos_token"] == tok.eos_token and info["model_max_length"] > 0


@pytest.mark.parametrize("name, content, message", [
    ("missing.jinja", None, "cannot read"),
    ("bad.jinja", "{% for m in messages %}{{ m['content'] }", "not a valid Jinja template"),
    ("empty.jinja", "  \n", "is empty"),
])
def test_bad_chat_template_fails_at_startup(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    p = subprocess.run([sys.executable, "-m", "hetmoe", "serve", "--port", "0", "--device", "cpu", "--chat-template",
                        str(path)], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "--chat-template" in p.stderr and message in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and "serving" not in p.stderr


# ---------------------------------------------------------------- /tokenize, /detokenize

def test_tokenize_and_detokenize(server, tok):
    text = "Hello world <|im_end|> héllo"
    r = post(server, "/tokenize", {"prompt": text, "return_token_strs": True, "model": NAMES[1]})
    body = r.json()
    assert r.status_code == 200 and body["tokens"] == tok.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 1024 and body["token_strs"] == [tok.decode([t], False) for t in body["tokens"]]
    plain = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode(text, add_special_tokens=False) and plain["token_strs"] is None
    assert post(server, "/detokenize", {"tokens": body["tokens"]}).json() == {"prompt": text}
    long = post(server, "/tokenize", {"prompt": "word " * 3000}).json()  # longer than the context: counted
    assert long["count"] > long["max_model_len"]


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "truncate": 5}, 400, "truncate"),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "a"}]}, 400, "messages[0].role"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": False}, 400,
     "add_generation_prompt"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, 10**7]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, 400, "skip_special_tokens"),
])
def test_tokenize_bad_input(server, path, body, status, param):
    assert_error(post(server, path, body), status, param=param)


def test_tokenizer_routes_need_the_key(server):
    for path in ("/tokenize", "/detokenize"):
        r = httpx.post(f"{server.base}{path}", json={"prompt": "a", "tokens": [1]}, timeout=30)
        assert_error(r, 401, code="invalid_api_key")
    assert_error(httpx.get(f"{server.base}/tokenizer_info", timeout=30), 401)
    r = httpx.post(f"{server.base}/tokenize", json={"prompt": "a"}, headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == 200  # Anthropic's header works on every route
    assert httpx.get(f"{server.base}/health", timeout=30).status_code == 200


# ---------------------------------------------------------------- CORS

def test_cors_for_listed_origins_only(server):
    body = json.dumps({"model": NAMES[0], "prompt": "Hi", "max_tokens": 1})
    r = httpx.post(f"{server.url}/completions", content=body, headers={**JSON, **AUTH, "Origin": ORIGIN})
    assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert r.headers["Vary"] == "Origin"
    r = httpx.post(f"{server.url}/completions", content=body, headers={**JSON, "Origin": ORIGIN})
    assert r.status_code == 401 and r.headers["Access-Control-Allow-Origin"] == ORIGIN  # errors readable too
    r = httpx.post(f"{server.url}/completions", content=body, headers={**JSON, **AUTH, "Origin": "http://evil.example"})
    assert r.status_code == 200 and "Access-Control-Allow-Origin" not in r.headers

    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(f"{server.url}/chat/completions", headers=preflight)  # no key: browsers send none here
    assert r.status_code == 204 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in r.headers["Access-Control-Allow-Methods"]
    assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    r = httpx.options(f"{server.url}/chat/completions", headers={**preflight, "Origin": "http://evil.example"})
    assert r.status_code == 405 and "Access-Control-Allow-Origin" not in r.headers
    r = httpx.options(f"{server.url}/chat/completions", headers={**preflight, "Host": f"evil.example:{server.port}"})
    assert r.status_code == 403  # the Host check holds for preflights too (DNS rebinding)
    r = httpx.options(f"{server.url}/chat/completions", headers={"Origin": ORIGIN})  # not a preflight
    assert r.status_code == 401
    assert_error(post(server, "/v1/nothing", {}, headers={"Origin": ORIGIN}), 404)  # routes as without CORS


def test_no_cors_by_default(tok):
    srv = InProcess(tok)
    try:
        r = httpx.options(f"{srv.base}/v1/chat/completions", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
        assert r.status_code == 405 and not any(h.lower().startswith("access-control") for h in r.headers)
        r = httpx.post(f"{srv.base}/v1/completions", json={"model": "m", "prompt": "Hi"}, headers={"Origin": ORIGIN})
        assert r.status_code == 200 and "Access-Control-Allow-Origin" not in r.headers
    finally:
        srv.close()


def test_bad_cors_origins_flag():
    for value in ("ui.example", "http://ui.example/path", "ftp://x"):
        p = subprocess.run([sys.executable, "-m", "hetmoe", "serve", "--cors-origins", value], capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 2 and "--cors-origins" in p.stderr and "not an origin" in p.stderr


# ---------------------------------------------------------------- access log, keep-alive, cached tokens

def test_access_log_lines(server, client):
    client.chat.completions.create(model=NAMES[0], messages=[{"role": "user", "content": "Log me"}], max_tokens=3,
                                   **GREEDY)  # (sampled, an eos could end it before the third token)
    httpx.get(f"{server.base}/health")
    lines = server.stderr.splitlines()
    assert any(re.fullmatch(r'hetmoe serve: 127\.0\.0\.1 "POST /v1/chat/completions" 200 prompt=\d+ completion=3 '
                            r'\d+\.\d{3}s', line) for line in lines), lines[-5:]
    assert any(re.fullmatch(r'hetmoe serve: 127\.0\.0\.1 "GET /health" 200 - \d+\.\d{3}s', line) for line in lines)


@pytest.mark.parametrize("on", [True, False])
def test_access_log_option(tok, capsys, on):
    srv = InProcess(tok, log_requests=on)
    try:
        httpx.post(f"{srv.base}/v1/completions", json={"model": "m", "prompt": "Hi"})
        httpx.post(f"{srv.base}/v1/completions", json={"model": "nope", "prompt": "Hi"})
    finally:
        srv.close()
    err = capsys.readouterr().err
    assert bool(re.search(r'"POST /v1/completions" 200 prompt=\d+ completion=1 ', err)) is on
    assert ('"POST /v1/completions" 404 -' in err) is on


class Gated:
    """An engine stand-in whose requests answer only once ``release()`` is called (a long prefill)."""

    def __init__(self):
        from hetmoe.server.metrics import Metrics

        self.metrics, self.reqs, self.gate = Metrics(), [], threading.Event()
        self.submitted = threading.Event()

    def submit(self, req):
        self.reqs.append(req)
        self.submitted.set()

        def answer():
            self.gate.wait(60)
            req.emit("text", "ok")
            req.emit("done", "stop", len(req.prompt_ids), 1)

        threading.Thread(target=answer, daemon=True).start()
        return req


@pytest.mark.parametrize("path, body, comment", [
    ("/v1/completions", {"model": "m", "prompt": "Hi", "stream": True}, b": keep-alive"),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "Hi"}]},
     b"event: ping"),
])
def test_stream_headers_at_once_and_keepalive_while_prefilling(tok, monkeypatch, path, body, comment):
    from hetmoe.server import app

    monkeypatch.setattr(app, "KEEPALIVE_S", 0.05)
    engine = Gated()
    srv = InProcess(tok, engine=engine)
    try:
        with httpx.stream("POST", f"{srv.base}{path}", json=body, timeout=30) as r:
            assert r.status_code == 200 and r.headers["Content-Type"] == "text/event-stream"  # before any token
            lines = r.iter_lines()
            seen = []
            while seen.count(comment.decode()) < 2:  # keep-alives come while nothing else does
                seen.append(next(lines))
            assert not any(line.startswith("data: {\"id\"") or "text_delta" in line for line in seen)
            engine.gate.set()
            rest = list(lines)
        text = "\n".join(seen + rest)
        assert ("data: [DONE]" in text) if path == "/v1/completions" else ("event: message_stop" in text)
        assert '"text": "ok"' in text  # the token, once released
    finally:
        engine.gate.set()
        srv.close()


def test_cached_tokens(client):
    messages = [{"role": "user", "content": "A long question about experts " * 20}]
    first = client.chat.completions.create(model=NAMES[0], messages=messages, max_tokens=2, **GREEDY)
    again = client.chat.completions.create(model=NAMES[0], messages=messages, max_tokens=2, **GREEDY)
    assert again.usage.prompt_tokens == first.usage.prompt_tokens > 100
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1  # the last is computed


# ---------------------------------------------------------------- sampling fields

def _complete(client, **kw):
    return client.completions.create(model=NAMES[0], prompt="def forward(self, x):", max_tokens=24, **GREEDY, **kw)


def test_penalties_and_bias_reach_the_sampler(client, tok):
    plain = _complete(client).choices[0].text
    for field in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"extra_body": {
            "ignore_eos": True, "repetition_penalty": 1.5}}):
        kw = {"extra_body": {"ignore_eos": True}, **field}
        text = client.completions.create(model=NAMES[0], prompt="def forward(self, x):", max_tokens=24,
                                         temperature=0, **kw).choices[0].text
        assert text != plain, field  # greedy output with repeats: a penalty changes it
    token = tok.encode(" the", add_special_tokens=False)[0]
    biased = _complete(client, logit_bias={str(token): 100}, logprobs=0).choices[0]
    assert biased.logprobs.tokens == [tok.decode([token])] * 24
    ids = tok.encode(plain, add_special_tokens=False)
    stop = ids[5]
    cut = client.completions.create(model=NAMES[0], prompt="def forward(self, x):", max_tokens=24, temperature=0,
                                    extra_body={"ignore_eos": True, "stop_token_ids": [stop]}).choices[0]
    assert cut.finish_reason == "stop" and stop not in tok.encode(cut.text, add_special_tokens=False)
    assert plain.startswith(cut.text)


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 3), ("frequency_penalty", -2.5), ("min_p", 1.5), ("repetition_penalty", 0),
    ("repetition_penalty", "high"), ("logit_bias", {"abc": 1}), ("logit_bias", {"99999999": 1}),
    ("logit_bias", {"5": 200}), ("logit_bias", [1]), ("stop_token_ids", [-1]), ("stop_token_ids", "x"),
])
def test_bad_sampling_fields(server, field, value):
    body = {"model": NAMES[0], "prompt": "Hi", "max_tokens": 1, field: value}
    assert_error(post(server, "/v1/completions", body), 400, param=field)


def _unsupported_cases():
    cases = []
    for table, endpoint in ((protocol._NO_OPS, "both"), (protocol._CHAT_NO_OPS, "chat"),
                            (protocol._COMPLETION_NO_OPS, "completion")):
        for name, (no_ops, _) in table.items():
            refused = {"min_tokens": 3, "length_penalty": 0.5, "priority": 1, "bad_words": ["x"],
                       "modalities": ["text", "audio"], "suffix": "end", "best_of": 3}.get(name, True)
            if refused is True and no_ops and isinstance(no_ops[0], bool):
                refused = not no_ops[0]
            for path in (["/v1/chat/completions", "/v1/completions"] if endpoint == "both" else
                         ["/v1/chat/completions" if endpoint == "chat" else "/v1/completions"]):
                cases.append((path, name, refused, no_ops[0] if no_ops else None))
    return cases


@pytest.mark.parametrize("path, name, refused, no_op", _unsupported_cases())
def test_unimplemented_fields_are_refused_by_name(server, path, name, refused, no_op):
    base = {"model": NAMES[0], "max_tokens": 1}
    base.update({"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Hi"})
    err = assert_error(post(server, path, {**base, name: refused}), 400, param=name, code="unsupported_parameter")
    assert name in err["message"]
    assert post(server, path, {**base, name: no_op}).status_code == 200  # the no-op value (or null) is taken
