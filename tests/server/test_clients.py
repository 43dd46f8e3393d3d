"""The clients agents and apps use, against ``hetmoe serve`` of the built-in model: LangChain's ``ChatOpenAI``
(``bind_tools(...).invoke`` and ``.stream``, a tool result sent back, ``with_structured_output`` with each method)
and LiteLLM's ``completion`` (tools auto, required and named, streamed, a two-turn exchange, a Pydantic
``response_format``). Each test is skipped, with the reason, where its package is not installed.

The built-in model is a small Python model that knows nothing of tools or JSON: what it writes is only valid
because the grammar makes it so, so the schemas bound their strings (a free string would run to max_tokens), and
``json_mode`` (which sends no schema) is checked for a JSON object on the model and for a validated one on a
scripted engine stand-in."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from live_server import InProcess, Scripted, serve
from pydantic import BaseModel, Field
from schema_check import validate

MODEL = "hetmoe-default"


class GetWeather(BaseModel):
    """The forecast for a city."""

    city: str = Field(max_length=24)
    days: int = Field(ge=1, le=7)


class GetTime(BaseModel):
    """The time in a timezone."""

    timezone: str = Field(pattern="^(UTC|CET)$")


class City(BaseModel):
    """A city."""

    name: str = Field(max_length=20)
    population: int = Field(ge=0, le=10**9)
    capital: bool


SCHEMAS = {"GetWeather": GetWeather, "GetTime": GetTime}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve(tmp_path_factory, None, "--max-batch", "4")


def checked(call_name: str, args: dict) -> BaseModel:
    """The arguments validated by the tool's own Pydantic model."""
    return SCHEMAS[call_name].model_validate(args)


# ---------------------------------------------------------------------------------------------- LangChain

@pytest.fixture(scope="module")
def llm(server):
    lc = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    return lc.ChatOpenAI(model=MODEL, base_url=server.url, api_key="unused", temperature=0, max_tokens=200,
                         max_retries=0, timeout=300)


@pytest.mark.parametrize("choice", ["any", "GetTime"])
def test_langchain_bind_tools_invoke(llm, choice):
    message = llm.bind_tools([GetWeather, GetTime], tool_choice=choice, parallel_tool_calls=False).invoke(
        "What time is it in Paris?")
    assert message.response_metadata["finish_reason"] == "tool_calls" and len(message.tool_calls) == 1, message
    [call] = message.tool_calls
    assert call["type"] == "tool_call" and call["id"].startswith("call_") and not message.invalid_tool_calls
    assert call["name"] == "GetTime" or choice == "any"
    checked(call["name"], call["args"])


def test_langchain_auto_tools_and_a_tool_result(llm):
    """tool_choice left to the model (auto): an answer, with calls or without; then the history with a call and
    its result, as an agent sends it."""
    from langchain_core.messages import HumanMessage, ToolMessage

    tools = llm.bind_tools([GetWeather, GetTime])
    first = tools.invoke("Weather in Paris for 2 days?")
    assert isinstance(first.content, str) and first.response_metadata["finish_reason"] in ("stop", "length",
                                                                                          "tool_calls")
    forced = llm.bind_tools([GetWeather], tool_choice="GetWeather", parallel_tool_calls=False).invoke(
        "Weather in Paris for 2 days?")
    [call] = forced.tool_calls
    history = [HumanMessage("Weather in Paris for 2 days?"), forced,
               ToolMessage(content="sunny, 24 C", tool_call_id=call["id"])]
    second = tools.invoke(history)
    assert isinstance(second.content, str)
    again = llm.bind_tools([GetWeather], tool_choice="GetWeather", parallel_tool_calls=False).invoke(history)
    checked("GetWeather", again.tool_calls[0]["args"])


def test_langchain_streamed_tool_call_equals_invoke(llm):
    tools = llm.bind_tools([GetWeather, GetTime], tool_choice="GetWeather", parallel_tool_calls=False)
    whole = tools.invoke("Weather in Oslo?")
    chunks = list(tools.stream("Weather in Oslo?"))
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(c["name"], c["args"]) for c in whole.tool_calls]
    assert len(merged.tool_calls) == 1 and not merged.content
    checked("GetWeather", merged.tool_calls[0]["args"])


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output(llm, method):
    city = llm.with_structured_output(City, method=method).invoke("Describe Paris.")
    assert isinstance(city, City)
    raw = llm.with_structured_output(City, method=method, include_raw=True).invoke("Describe Paris.")
    assert raw["parsing_error"] is None and raw["parsed"] == city  # temperature 0: the same answer
    text = raw["raw"].tool_calls[0]["args"] if method == "function_calling" else json.loads(raw["raw"].content)
    validate(text, City.model_json_schema())


def test_langchain_json_mode_on_the_model(llm):
    """json_mode sends no schema (the prompt must describe it): the model returns a JSON object, which the
    built-in model does not shape into a City, so the parse error is reported, not raised."""
    llm = llm.model_copy(update={"frequency_penalty": 0.5})  # the built-in model closes its object sooner
    out = llm.with_structured_output(City, method="json_mode", include_raw=True).invoke(
        "Give me a JSON object with the name, population and capital of Paris.")
    assert out["raw"].response_metadata["finish_reason"] == "stop"
    assert isinstance(json.loads(out["raw"].content), dict)
    assert (out["parsed"] is None) != (out["parsing_error"] is None)


@pytest.fixture(scope="module")
def scripted():
    from hetmoe.engine.llm import default_model_path
    from hetmoe.tokenizer import Tokenizer

    srv = InProcess(Tokenizer.from_dir(default_model_path()), engine=Scripted())
    srv.script = srv.engine
    yield srv
    srv.close()


def test_langchain_json_mode_round_trip(scripted):
    lc = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    llm = lc.ChatOpenAI(model="m", base_url=f"{scripted.base}/v1", api_key="unused", max_retries=0)
    scripted.script.texts.append('{"name": "Paris", "population": 2100000, "capital": true}')
    city = llm.with_structured_output(City, method="json_mode").invoke("Describe Paris as JSON.")
    assert city == City(name="Paris", population=2100000, capital=True)
    assert scripted.script.params[-1].constraint is not None  # response_format json_object: a grammar


# ---------------------------------------------------------------------------------------------- LiteLLM

@pytest.fixture(scope="module")
def litellm(server):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of its price list at import
    return pytest.importorskip("litellm", reason="litellm is not installed")


TOOLS = [{"type": "function", "function": {"name": "GetWeather", "description": "The forecast for a city",
                                           "parameters": GetWeather.model_json_schema()}},
         {"type": "function", "function": {"name": "GetTime", "description": "The time",
                                           "parameters": GetTime.model_json_schema()}}]


def complete(litellm, server, **kwargs):
    kwargs = {"model": f"openai/{MODEL}", "api_base": server.url, "api_key": "unused", "temperature": 0,
              "max_tokens": 200, "messages": [{"role": "user", "content": "What time is it in Paris?"}], **kwargs}
    return litellm.completion(**kwargs)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "GetWeather"}}],
                         ids=["required", "named"])
def test_litellm_tool_calls(litellm, server, choice):
    r = complete(litellm, server, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    choice_ = r.choices[0]
    assert choice_.finish_reason == "tool_calls" and len(choice_.message.tool_calls) == 1
    call = choice_.message.tool_calls[0]
    assert call.id.startswith("call_") and (call.function.name == "GetWeather" or choice == "required")
    checked(call.function.name, json.loads(call.function.arguments))
    streamed = complete(litellm, server, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, stream=True)
    message = litellm.stream_chunk_builder(list(streamed)).choices[0].message
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == \
        [(call.function.name, call.function.arguments)]


def test_litellm_auto_and_two_turns(litellm, server):
    r = complete(litellm, server, tools=TOOLS)  # auto: the model may answer in text
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    first = complete(litellm, server, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "GetTime"}})
    call = first.choices[0].message.tool_calls[0]
    messages = [{"role": "user", "content": "What time is it in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.id, "type": "function",
                     "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    second = complete(litellm, server, tools=TOOLS, messages=messages, max_tokens=16)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_litellm_response_format(litellm, server):
    r = complete(litellm, server, response_format=City, messages=[{"role": "user", "content": "Describe Paris."}])
    City.model_validate_json(r.choices[0].message.content)


def test_litellm_bad_tool_choice_is_a_bad_request(litellm, server):
    with pytest.raises(litellm.BadRequestError) as e:
        complete(litellm, server, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "Nope"}})
    assert "tool_choice.function.name" in str(e.value)


def test_the_server_is_still_healthy(server):
    assert httpx.get(f"{server.base}/health", timeout=10).json() == {"status": "ok"}
