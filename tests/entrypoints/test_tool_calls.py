"""Tool calling on `nanokv serve smollm2` with the official openai client: tool_choice
required and named (greedy and sampled: every call parses into a given tool with schema-
valid arguments), auto with the hermes parser (the model steered by a regex to write a
call), streamed deltas equal to the whole answer, a tool-result round trip, parallel_tool_calls
false, and each bad input a 400 naming its field."""

from __future__ import annotations

import json
import re

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from .conftest import API_KEY, serve  # noqa: E402

pytestmark = pytest.mark.slow

MAX_LEN = 1024


def tool(name: str, parameters: dict, description: str = "") -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


WEATHER = tool("get_weather", {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}, "The current weather in a city")
ADD = tool("add", {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                     "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
    "required": ["a", "b"], "additionalProperties": False}, "Add two integers")
FLIGHT = tool("book_flight", {
    "type": "object", "$defs": {"airport": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "properties": {"origin": {"$ref": "#/$defs/airport"}, "destination": {"$ref": "#/$defs/airport"},
                   "seats": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["origin", "destination"], "additionalProperties": False}, "Book a flight")
NOW = tool("now", {}, "The current time (no parameters)")
TOOLS = [WEATHER, ADD, FLIGHT, NOW]
BY_NAME = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Paris? Also add 2 and 3."}]


def valid(value, schema: dict, defs: dict) -> bool:
    """value against the schema features these tools use (jsonschema is not a dependency)."""
    if "$ref" in schema:
        return valid(value, defs[schema["$ref"].rsplit("/", 1)[1]], defs)
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    if kind == "object":
        if not isinstance(value, dict) or not all(k in value for k in schema.get("required", ())):
            return False
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False and any(k not in props for k in value):
            return False
        return all(valid(v, props[k], defs) for k, v in value.items() if k in props)
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value)) and \
            re.search(schema.get("pattern", ""), value) is not None
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool) and \
            schema.get("minimum", value) <= value <= schema.get("maximum", value)
    return True


def check_call(call, allowed: set[str]) -> dict:
    assert call.type == "function" and re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", call.id), call
    assert call.function.name in allowed, call
    arguments = json.loads(call.function.arguments)
    schema = BY_NAME[call.function.name]
    assert valid(arguments, schema, schema.get("$defs", {})), (call.function.name, arguments)
    return arguments


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    yield from serve("smollm2", "--api-key", API_KEY, "--max-model-len", str(MAX_LEN), "--kv-cache-memory-bytes",
               str(64 << 20), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               "--trust-request-chat-template", log_path=str(tmp_path_factory.mktemp("server") / "log"))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def chat(client, **kw):
    kw = {"model": "smollm2", "messages": USER, "temperature": 0, "max_tokens": 200, **kw}
    return client.chat.completions.create(**kw)


def test_required_and_named_calls_parse_into_the_tools_with_valid_arguments(client):
    names = set(BY_NAME)
    for kw in (dict(), dict(temperature=1.0, seed=7, n=3), dict(temperature=1.0, seed=11, n=3)):
        answer = chat(client, tools=TOOLS, tool_choice="required", **kw)
        for choice in answer.choices:
            assert choice.finish_reason == "tool_calls", choice
            assert choice.message.content is None and choice.message.tool_calls, choice
            for call in choice.message.tool_calls:
                check_call(call, names)
        for name in names:
            answer = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": name}}, **kw)
            for choice in answer.choices:
                # a named function's call finishes with "stop" (OpenAI's and vLLM's rule)
                assert choice.finish_reason == "stop" and choice.message.content is None, choice
                (call,) = choice.message.tool_calls
                check_call(call, {name})


def test_parallel_tool_calls_false_keeps_one_call(client):
    # the grammar allows one item: greedy and sampled answers hold exactly one call
    for kw in (dict(), dict(temperature=1.0, seed=3, n=4)):
        for choice in chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, **kw).choices:
            assert len(choice.message.tool_calls) == 1, choice
            check_call(choice.message.tool_calls[0], set(BY_NAME))


def test_a_call_cut_by_max_tokens_is_text_with_finish_reason_length(client):
    choice = chat(client, tools=TOOLS, tool_choice="required", max_tokens=3).choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content and choice.message.content.startswith("[")


HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}", "unit": "celsius"\}\}\n</tool_call>'


def test_auto_with_the_hermes_parser_reads_the_call_streamed_or_not(client):
    # the regex steers the model into text with a call after some content; auto reads it out
    steer = {"structured_outputs": {"regex": r"Let me check\. " + HERMES_CALL}}
    whole = chat(client, tools=TOOLS, extra_body=steer).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    assert whole.message.content == "Let me check. "
    (call,) = whole.message.tool_calls
    check_call(call, {"get_weather"})
    # streamed: the content streams, the call arrives as OpenAI sends it; the sums are equal
    content, calls, reasons = "", {}, []
    for chunk in chat(client, tools=TOOLS, extra_body=steer, stream=True):
        delta = chunk.choices[0].delta
        assert "<tool" not in (delta.content or ""), delta  # the tag is never leaked as content
        content += delta.content or ""
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = d.id or entry["id"]
            entry["name"] += (d.function.name or "") if d.function else ""
            entry["arguments"] += (d.function.arguments or "") if d.function else ""
        reasons.append(chunk.choices[0].finish_reason)
    assert content == whole.message.content and reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(call.function.name, call.function.arguments)]
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", calls[0]["id"])
    # text without a call is content; tool_choice none reads nothing
    plain = chat(client, tools=TOOLS, extra_body={"structured_outputs": {"regex": "Hello there"}}).choices[0]
    assert (plain.message.content, plain.message.tool_calls, plain.finish_reason) == ("Hello there", [], "stop")
    none = chat(client, tools=TOOLS, tool_choice="none", extra_body=steer).choices[0]
    assert none.message.tool_calls == [] and none.message.content.startswith("Let me check. <tool_call>")
    assert none.finish_reason == "stop"


def test_streamed_required_and_named_equal_the_whole_answers(client):
    for choice_kw in ("required", {"type": "function", "function": {"name": "book_flight"}}):
        whole = chat(client, tools=TOOLS, tool_choice=choice_kw).choices[0]
        calls, reasons, content = {}, [], ""
        for chunk in chat(client, tools=TOOLS, tool_choice=choice_kw, stream=True):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            reasons.append(chunk.choices[0].finish_reason)
        assert content == "" and reasons[-1] == whole.finish_reason
        assert [(c["name"], c["arguments"]) for c in calls.values()] == \
            [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


TOOLS_TEMPLATE = (  # a template with a tool section, as Qwen's: tools=, tool_calls and tool results
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ c.function.name }}({{ c.function.arguments.city }})</tool_call>{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_tool_result_round_trip_renders_and_answers(client, server):
    import httpx

    first = chat(client, tools=[WEATHER], tool_choice="required").choices[0].message
    (call,) = first.tool_calls
    city = json.loads(call.function.arguments)["city"]
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    answer = chat(client, messages=history, tools=[WEATHER], max_tokens=16)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # what the model saw: SmolLM2's template has no tool section, so the tools come in the
    # default system prompt and the call is written into the assistant's content in hermes form
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "smollm2", "messages": history, "tools": [WEATHER]}
    prompt = httpx.post(f"{server.url}/tokenize", json=body, headers=headers).json()
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": prompt["tokens"]}, headers=headers).json()["prompt"]
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text and text.count("<|im_start|>system") == 1
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ' in text
    assert '<|im_start|>tool\n{"temperature": 21}<|im_end|>' in text
    # a template that reads tools gets them as tools=, and the arguments as a dict
    body["chat_template"] = TOOLS_TEMPLATE
    prompt = httpx.post(f"{server.url}/tokenize", json=body, headers=headers).json()
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": prompt["tokens"]}, headers=headers).json()["prompt"]
    assert text.startswith("<tools>get_weather;</tools>\n") and "You may call" not in text
    assert f"<tool_call>get_weather({city})</tool_call>" in text
    assert chat(client, messages=history, tools=[WEATHER], max_tokens=4,
                extra_body={"chat_template": TOOLS_TEMPLATE}).choices[0].finish_reason is not None


@pytest.mark.parametrize("kw, param, words", [
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "not in tools"),
    (dict(tools=None, tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tool_choice="sometimes"), "tool_choice", "not one of none, auto, required"),
    (dict(tools=[{"type": "function", "function": {"description": "x"}}]), "tools", "function.name"),
    (dict(tools=[{"type": "retrieval"}]), "tools", "function tools"),
    (dict(tools=[WEATHER, WEATHER]), "tools", "twice"),
    (dict(tools=[tool("f", {"type": "strin"})], tool_choice="required"), "tools", "Invalid type"),
    (dict(tools=[tool("f", {"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}})],
          tool_choice={"type": "function", "function": {"name": "f"}}), "tools", "tools[0].function.parameters"),
    (dict(tool_choice="required", response_format={"type": "json_object"}), "tool_choice", "drop response_format"),
    (dict(tool_choice="required", extra_body={"guided_regex": "a"}), "tool_choice", "drop response_format"),
    (dict(messages=USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "get_weather", "arguments": "{bad"}}]}]),
     "messages", "not valid JSON"),
])
def test_bad_tool_requests_are_400_naming_the_field(client, kw, param, words):
    kw = {"tools": TOOLS, **kw}
    if kw["tools"] is None:
        del kw["tools"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_tokens=4, **kw)
    error = e.value.body
    assert words in error["message"] and error["param"] == param, error
