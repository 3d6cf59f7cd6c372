"""POST /v1/responses against the real clients: ``openai`` (create, stream, a tool loop over stored
responses) and the OpenAI Agents SDK (``OpenAIResponsesModel`` running a two-tool agent), on one live
server with the tiny random model; the reasoning parser on an in-process Engine."""
from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Annotated, Literal

import httpx
import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel, Field

from radixlang import Engine
from radixlang.runtime.entrypoints.engine_front import EngineFront
from radixlang.runtime.entrypoints.http_server import create_app

pytestmark = pytest.mark.e2e

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False}
ZONE = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather in a city", "parameters": CITY},
         {"type": "function", "name": "get_time", "description": "the time in a zone", "parameters": ZONE}]
SKY = {"type": "object", "properties": {"sky": {"enum": ["sunny", "rainy"]}, "n": {"type": "integer", "minimum": 0,
                                                                                   "maximum": 9}},
       "required": ["sky", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def url(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def client(url):
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _events(client, **body) -> list:
    with client.responses.stream(model="default", **body) as stream:
        return list(stream)


def test_create_text_usage_and_cached_tokens(client):
    body = {"model": "default", "instructions": "Answer briefly.", "input": "Name a colour.", "max_output_tokens": 6,
            "temperature": 0}
    first = client.responses.create(**body)
    assert first.object == "response" and first.id.startswith("resp_") and first.model
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    [message] = first.output
    assert message.type == "message" and message.role == "assistant" and first.output_text
    assert first.usage.output_tokens == 6 and first.usage.input_tokens > 6
    assert first.usage.total_tokens == first.usage.input_tokens + 6
    again = client.responses.create(**body)
    assert again.output_text == first.output_text
    # the same prompt again: served from the radix cache, reported as cached input tokens
    assert 0 < again.usage.input_tokens_details.cached_tokens < again.usage.input_tokens


def test_output_text_logprobs_when_included(client):
    reply = client.responses.create(model="default", input="Hi.", max_output_tokens=5, top_logprobs=2,
                                    include=["message.output_text.logprobs"])
    [part] = reply.output[0].content
    assert len(part.logprobs) == 5 == reply.usage.output_tokens and part.text
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in part.logprobs)


def test_stream_events_match_the_whole_response(client):
    body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Say something."}]}],
            "max_output_tokens": 8, "temperature": 0}
    whole = client.responses.create(model="default", **body)
    events = _events(client, **body)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text and deltas
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == 8


def test_json_schema_text_format_streamed_and_not(client):
    fmt = {"format": {"type": "json_schema", "name": "sky", "schema": SKY, "strict": True}}
    whole = client.responses.create(model="default", input="Weather?", text=fmt, max_output_tokens=60,
                                    temperature=1)
    assert whole.status == "completed"
    jsonschema.validate(json.loads(whole.output_text), SKY)
    with client.responses.stream(model="default", input="Weather?", text=fmt, max_output_tokens=60) as stream:
        final = stream.get_final_response()
    jsonschema.validate(json.loads(final.output_text), SKY)
    assert final.text.format.type == "json_schema"


def test_forced_calls_and_a_tool_loop_over_stored_responses(client):
    named = {"type": "function", "name": "get_time"}
    first = client.responses.create(model="default", input="What time is it in Paris?", tools=TOOLS,
                                    tool_choice=named, max_output_tokens=60)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_time" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), ZONE)
    assert first.status == "completed" and first.tool_choice.name == "get_time"
    # the loop: the call's output continues the stored response; the reply may call again (forced) or answer
    second = client.responses.create(model="default", previous_response_id=first.id, tools=TOOLS,
                                     tool_choice="required", max_output_tokens=60,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "12:00"}])
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens  # the history was sent to the model
    assert second.output and all(o.type == "function_call" and o.name in ("get_weather", "get_time")
                                 for o in second.output)
    # the same conversation as explicit items (what a client that keeps its own history sends)
    items = [{"role": "user", "content": "What time is it in Paris?"},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}]
    explicit = client.responses.create(model="default", input=items, tools=TOOLS, tool_choice="required",
                                       max_output_tokens=60, store=False)
    assert explicit.usage.input_tokens == second.usage.input_tokens
    assert client.responses.retrieve(first.id).output[0].call_id == call.call_id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(explicit.id)  # store=False


def test_streamed_call_arguments(client):
    with client.responses.stream(model="default", input="weather in Oslo", tools=TOOLS, tool_choice="required",
                                 max_output_tokens=80) as stream:
        events = list(stream)
        final = stream.get_final_response()
    calls = [o for o in final.output if o.type == "function_call"]
    assert calls and all(c.status == "completed" for c in calls)
    for i, c in enumerate(calls):
        pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"
                  and e.item_id == c.id]
        assert "".join(pieces) == c.arguments
        jsonschema.validate(json.loads(c.arguments), {"get_weather": CITY, "get_time": ZONE}[c.name])
    assert [e.type for e in events][-1] == "response.completed"


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "max_output_tokens": 10**7}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"input": "hi", "frobnicate": 1}, "frobnicate"),
    ({}, "input"),
])
def test_bad_input_is_a_400_naming_the_field(url, body, param):
    r = httpx.post(url + "/v1/responses", json={"model": "default", **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_a_refusal_met_mid_stream_fails_the_response(url, client):
    # a schema the grammar library refuses: whole, a 400 naming text; streamed, an error event then response.failed
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "strin"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="default", input="x", text=fmt)
    assert e.value.param == "text"
    with httpx.stream("POST", url + "/v1/responses", json={"input": "x", "text": fmt, "stream": True},
                      timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error", "response.failed"]
    assert events[2]["param"] == "text" and events[3]["response"]["status"] == "failed"
    assert events[3]["response"]["error"]["message"] == events[2]["message"]


def test_unknown_previous_response_and_model_are_404(url, client):
    r = httpx.post(url + "/v1/responses", json={"input": "hi", "previous_response_id": "resp_nope"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="hi")
    made = client.responses.create(model="default", input="hi", max_output_tokens=2)
    assert client.responses.delete(made.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)


# ---- the OpenAI Agents SDK ------------------------------------------------------------------------
class Sky(BaseModel):
    sky: Literal["sunny", "rainy"]


def _agent(url: str, calls: list[tuple[str, str]]):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, function_tool

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=8)]) -> str:
        """The weather in a city."""
        calls.append(("get_weather", city))
        return "sunny"

    @function_tool
    def get_time(zone: Literal["utc", "cet"]) -> str:
        """The time in a zone."""
        calls.append(("get_time", zone))
        return "12:00"

    model = OpenAIResponsesModel("default", openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused",
                                                               max_retries=0))
    # the random model answers nothing sensible: each turn's tool_choice says what it does (see _Steer)
    return Agent(name="forecaster", instructions="Use the tools, then report the sky.", tools=[get_weather, get_time],
                 output_type=Sky, model=model, reset_tool_choice=False,
                 model_settings=ModelSettings(tool_choice="get_weather", max_tokens=80))


def _steer():
    from agents import RunHooks

    class Steer(RunHooks):
        """After get_weather force get_time, after that no tools: the final answer (Sky's JSON schema)."""

        async def on_tool_end(self, context, agent, tool, result) -> None:
            agent.model_settings = dataclasses.replace(
                agent.model_settings, tool_choice="get_time" if tool.name == "get_weather" else "none")

    return Steer()


@pytest.mark.parametrize("streamed", [False, True])
def test_agents_sdk_runs_a_two_tool_loop(url, streamed):
    from agents import RunConfig, Runner

    calls: list[tuple[str, str]] = []
    agent = _agent(url, calls)
    config = RunConfig(tracing_disabled=True)

    async def run():
        if not streamed:
            return await Runner.run(agent, "Weather and time in Paris?", hooks=_steer(), run_config=config,
                                    max_turns=5)
        result = Runner.run_streamed(agent, "Weather and time in Paris?", hooks=_steer(), run_config=config,
                                     max_turns=5)
        kinds = [e.type async for e in result.stream_events()]
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
        return result

    result = asyncio.run(run())
    assert [name for name, _ in calls] == ["get_weather", "get_time"]
    assert calls[1][1] in ("utc", "cet")
    assert isinstance(result.final_output, Sky)
    assert len(result.raw_responses) == 3
    sent = result.to_input_list()
    outputs = [i for i in sent if i.get("type") == "function_call_output"]
    assert [o["output"] for o in outputs] == ["sunny", "12:00"]


# ---- the reasoning parser -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def thinking(tiny_model_dir):
    engine = Engine(model_path=tiny_model_dir, load_format="dummy", max_total_tokens=4096,
                    reasoning_parser="deepseek-r1")
    with TestClient(create_app(EngineFront(engine))) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
    engine.shutdown()


def test_reasoning_is_its_own_output_item(thinking):
    # the random model never closes its <think>: the whole reply is reasoning (deepseek-r1 starts inside it)
    body = {"input": "Think.", "max_output_tokens": 10, "temperature": 0, "reasoning": {"effort": "low"}}
    whole = thinking.responses.create(model="default", **body)
    [item] = whole.output
    assert item.type == "reasoning" and item.content[0].type == "reasoning_text" and item.content[0].text
    assert whole.output_text == "" and whole.reasoning.effort == "low"
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens <= whole.usage.output_tokens + 1
    events = _events(thinking, **body)
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == item.content[0].text
    assert events[-1].response.output[0].type == "reasoning"
