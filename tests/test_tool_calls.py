"""nanokv/tool_calls.py without a model: tools / tool_choice validation, the grammar's JSON
schema, the hermes and smollm2 parsers, streamed content held back at a tag, the rendering
of tools and history calls, and the server's parse_chat rules (auto needs both flags)."""

from __future__ import annotations

import json

import pytest

from nanokv.grammar import MAX_ARRAY_ITEMS, MAX_SAFE_INTEGER, MAX_STRING_CHARS, closed
from nanokv.tool_calls import (
    MAX_REQUIRED_CALLS, Tool, ToolStream, check_schemas, get_parser, parse_tool_choice, parse_tools, read_answer,
    tool_schema, tools_system_prompt, with_tools)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}


@pytest.mark.parametrize("tools, words", [
    ("x", "tools must be a list"),
    ([{"type": "code_interpreter"}], "tools[0] has type 'code_interpreter'"),
    ([{"type": "function"}], "tools[0].function is missing"),
    ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name must be a non-empty string"),
    ([WEATHER, WEATHER], "given twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "parameters must be a JSON schema"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "description must be a string"),
])
def test_bad_tools_name_the_entry(tools, words):
    with pytest.raises(ValueError) as e:
        parse_tools(tools)
    assert words in str(e.value)


def test_tool_choice_follows_vllms_rules():
    tools = parse_tools([WEATHER, ADD])
    assert parse_tool_choice(None, tools) == "auto" and parse_tool_choice(None, None) is None
    assert parse_tool_choice("none", tools) == "none" and parse_tool_choice("none", None) is None
    assert parse_tool_choice("required", tools) == "required"
    assert parse_tool_choice("required", []) == "none"  # OpenAI's: required with no tools calls nothing
    assert parse_tool_choice({"type": "function", "function": {"name": "add"}}, tools) == tools[1]
    for choice, tools_, words in (("required", None, "needs tools"), ("always", tools, "not one of"),
                                  ({"type": "function", "function": {"name": "mul"}}, tools,
                                   "'mul', which is not in tools (they are get_weather, add)"),
                                  ({"type": "function", "function": {}}, tools, "non-empty string"),
                                  ({"function": {"name": "add"}, "type": "x"}, tools, "must be none, auto")):
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            parse_tool_choice(choice, tools_)
    # a function without parameters takes an empty object
    assert parse_tools([{"type": "function", "function": {"name": "now"}}])[0].parameters == \
        {"type": "object", "properties": {}}


def test_the_grammar_schema_for_required_and_named():
    tools = parse_tools([WEATHER, ADD])
    schema = tool_schema(tools, "required")
    assert schema["minItems"] == 1 and schema["maxItems"] == MAX_REQUIRED_CALLS
    first = schema["items"]["anyOf"][0]
    assert first["properties"]["name"] == {"const": "get_weather"} and first["required"] == ["name", "parameters"]
    # objects listing properties are closed (OpenAI's strict mode); the request's schema is untouched
    assert first["properties"]["parameters"]["additionalProperties"] is False
    assert "additionalProperties" not in tools[0].parameters
    assert tool_schema(tools, "required", parallel=False)["maxItems"] == 1
    assert tool_schema(tools, tools[1]) == closed(ADD["function"]["parameters"])
    assert tool_schema(tools, tools[1])["additionalProperties"] is False
    assert tool_schema(tools, "auto") is None and tool_schema(tools, "none") is None
    # $defs move to the top, where "#/$defs/..." points; two different definitions of a name are refused
    ref = {"type": "object", "properties": {"x": {"$ref": "#/$defs/code"}}, "$defs": {"code": {"type": "string"}}}
    with_defs = parse_tools([{"type": "function", "function": {"name": "f", "parameters": ref}}, ADD])
    schema = tool_schema(with_defs, "required")
    assert schema["$defs"] == {"code": {"type": "string", "maxLength": MAX_STRING_CHARS}}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    other = {**ref, "$defs": {"code": {"type": "integer"}}}
    clash = with_defs + [Tool("g", None, other)]
    with pytest.raises(ValueError, match=r"tools\[2\].function.parameters defines \$defs.code differently"):
        tool_schema(clash, "required")


def test_grammar_schemas_are_bounded_where_the_schema_is_not():
    schema = {"type": "object", "properties": {
        "s": {"type": "string"}, "short": {"type": "string", "maxLength": 5}, "day": {"type": "string",
                                                                                   "format": "date"},
        "e": {"type": "string", "enum": ["a"]}, "long": {"type": "string", "minLength": 1000},
        "n": {"type": "integer"}, "pos": {"type": "integer", "minimum": 0},
        "xs": {"type": "array", "items": {"type": "string"}}, "few": {"type": "array", "maxItems": 2},
        "free": {"type": "object"}, "open": {"type": "object", "properties": {}, "additionalProperties": True},
        "literal": {"const": {"type": "string", "properties": {}}},
        "named": {"type": "object", "properties": {"properties": {"type": "integer", "minimum": 0}}},
        "secret": {"type": "string", "format": "password"}}}
    got = closed(schema)["properties"]
    assert got["s"]["maxLength"] == MAX_STRING_CHARS and got["long"]["maxLength"] == 1000
    assert got["short"]["maxLength"] == 5 and "maxLength" not in got["day"] and "maxLength" not in got["e"]
    assert (got["n"]["minimum"], got["n"]["maximum"]) == (-MAX_SAFE_INTEGER, MAX_SAFE_INTEGER)
    assert got["pos"]["minimum"] == 0 and got["pos"]["maximum"] == MAX_SAFE_INTEGER
    assert got["xs"]["maxItems"] == MAX_ARRAY_ITEMS and got["xs"]["items"]["maxLength"] == MAX_STRING_CHARS
    assert got["few"]["maxItems"] == 2
    assert "additionalProperties" not in got["free"] and got["open"]["additionalProperties"] is True
    assert got["literal"] == schema["properties"]["literal"]  # data, not a schema
    # a format llguidance does not know is an annotation: dropped, and the string bounded
    assert got["secret"] == {"type": "string", "maxLength": MAX_STRING_CHARS} and got["day"]["format"] == "date"
    check_schemas([Tool("f", None, schema)])
    with pytest.raises(ValueError, match=r"tools\[0\].function.parameters \(f\) is not a usable JSON schema"):
        check_schemas([Tool("f", None, {"type": "object", "properties": {"x": {"type": "strin"}}})])
    # a property called "properties" is a property, not a keyword
    assert got["named"]["properties"] == {"properties": {"type": "integer", "minimum": 0,
                                                         "maximum": MAX_SAFE_INTEGER}}
    assert closed(schema)["additionalProperties"] is False and "additionalProperties" not in schema


def test_hermes_parser():
    hermes = get_parser("hermes")
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    got = hermes.extract(text)
    assert got.content == "Let me look.\n"
    assert got.calls == [{"name": "get_weather", "arguments": {"city": "Paris"}},
                         {"name": "add", "arguments": {"a": 1, "b": 2}}]
    # an unclosed last block that parses still counts (a model that stops at EOS after the JSON)
    assert hermes.extract('<tool_call>{"name": "f", "arguments": {}}').calls == [{"name": "f", "arguments": {}}]
    # a block that does not parse makes the whole text content, as vLLM's hermes parser
    for bad in ('<tool_call>{"name": "f", "arguments": {</tool_call>', '<tool_call>[{"name": "f"}]</tool_call>',
                '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": "f", "arguments": 3}</tool_call>'):
        assert hermes.extract("x" + bad).calls == [] and hermes.extract("x" + bad).content == "x" + bad
    assert hermes.extract("no calls here") == hermes.extract("no calls here").__class__("no calls here", [])
    # arguments written as JSON text are read too
    assert hermes.extract('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>').calls == \
        [{"name": "f", "arguments": {"a": 1}}]


def test_smollm2_parser_reads_a_list_or_an_object():
    smol = get_parser("smollm2")
    text = '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]</tool_call>'
    assert smol.extract(text).calls == [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]
    assert smol.extract('<tool_call>{"name": "a", "arguments": {}}</tool_call>').calls == [{"name": "a",
                                                                                            "arguments": {}}]
    assert smol.extract("<tool_call>[]</tool_call>").calls == []  # SmolLM2's "no call": an empty list
    calls = [{"name": "a", "arguments": {"x": 1}}]
    assert smol.extract(smol.format_calls(calls)).calls == calls
    assert get_parser("hermes").extract(get_parser("hermes").format_calls(calls)).calls == calls
    with pytest.raises(ValueError, match="--tool-call-parser 'pythonic' is not available; use one of hermes"):
        get_parser("pythonic")


def test_answers_and_finish_reasons():
    call = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "add", "parameters": {"a": 3, "b": 4}}]'
    answer = read_answer(call, "stop", "required", None)
    assert answer.content is None and answer.finish_reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in answer.calls] == [("add", {"a": 1, "b": 2}),
                                                                          ("add", {"a": 3, "b": 4})]
    assert len({c.id for c in answer.calls}) == 2 and all(c.id.startswith("chatcmpl-tool-") for c in answer.calls)
    assert len(read_answer(call, "stop", "required", None, parallel=False).calls) == 1
    # cut by max_tokens: the text, no calls, finish_reason length
    cut = read_answer(call[:20], "length", "required", None)
    assert (cut.content, cut.calls, cut.finish_reason) == (call[:20], [], "length")
    assert read_answer(call, "length", "required", None).calls == []
    named = read_answer('{"a": 1, "b": 2}', "stop", Tool("add", None, {}), None)
    assert named.finish_reason == "stop" and named.content is None and named.calls[0].name == "add"
    auto = read_answer('Hi <tool_call>{"name": "f", "arguments": {}}</tool_call>', "stop", "auto", "hermes")
    assert (auto.content, auto.finish_reason, auto.calls[0].arguments) == ("Hi ", "tool_calls", "{}")
    plain = read_answer("Hello", "stop", "auto", "hermes")
    assert (plain.content, plain.calls, plain.finish_reason) == ("Hello", [], "stop")


@pytest.mark.parametrize("text", [
    'Sure <tool_call>{"name": "f", "arguments": {"a": "<tool"}}</tool_call>',
    "a < b, and <tool not a call",
    "ends with <tool_ca",
    '<tool_call>{"name": "f", "arguments": {</tool_call>',
])
def test_streamed_content_adds_up_and_never_shows_a_tag(text):
    for step in (1, 2, 5, len(text)):
        stream = ToolStream("auto", "hermes")
        sent = [stream.feed(text[i:i + step]) for i in range(0, len(text), step)]
        rest, answer = stream.finish("stop")
        whole = read_answer(text, "stop", "auto", "hermes")
        assert "".join(sent) + rest == (whole.content or "")
        assert [(c.name, c.arguments) for c in answer.calls] == [(c.name, c.arguments) for c in whole.calls]
        if whole.calls:
            assert "<tool_call>" not in "".join(sent)
    # required and named hold everything until the end
    stream = ToolStream("required", None)
    assert stream.feed('[{"name": "f", "parameters": {}}]') == ""
    assert stream.finish("stop")[1].calls[0].name == "f"


def test_rendering_tools_and_history():
    bare = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    reads = "{{ tools | length }} tools\n{% for m in messages %}{{ m.role }}{{ m.tool_calls }}\n{% endfor %}"
    user = [{"role": "user", "content": "hi"}]
    # a template without tools: a system prompt first, or merged into the system message
    conv, tools = with_tools(user, [WEATHER], bare, None)
    assert tools is None and conv[0] == {"role": "system", "content": tools_system_prompt([WEATHER])}
    assert json.dumps(WEATHER) in conv[0]["content"] and '"arguments": <args-json-object>' in conv[0]["content"]
    conv, _ = with_tools([{"role": "system", "content": "Be brief."}] + user, [WEATHER], bare, "smollm2")
    assert conv[0]["content"].startswith("Be brief.\n\nYou may call") and "<tool_call>[{" in conv[0]["content"]
    assert len(conv) == 2
    # OpenAI's content parts (chat_template_content_format "openai"): the prompt is a text part
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    conv, _ = with_tools(parts, [WEATHER], bare, None)
    assert conv[0]["content"] == [{"type": "text", "text": "Be brief."},
                                  {"type": "text", "text": tools_system_prompt([WEATHER])}] and len(conv) == 2
    conv, _ = with_tools(parts[1:], [WEATHER], bare, None)
    assert conv[0] == {"role": "system", "content": [{"type": "text", "text": tools_system_prompt([WEATHER])}]}
    # a template that reads tools gets them as tools=, the conversation as it was
    conv, tools = with_tools(user, [WEATHER], reads, None)
    assert tools == [WEATHER] and conv == user
    # history: arguments' JSON text becomes a dict; a template that does not read tool_calls
    # gets the calls in the content, in the parser's format
    history = user + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    conv, _ = with_tools(history, None, reads, None)
    assert conv[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    assert history[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'  # not mutated
    conv, _ = with_tools(history, None, bare, "hermes")
    assert conv[1]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    bad = [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\].tool_calls\[0\].function.arguments is not valid JSON"):
        with_tools(bad, None, bare, None)


def test_llm_chat_renders_tools_like_the_server():
    from nanokv.llm import render_chat
    from nanokv.testing.tiny import train_tiny_tokenizer

    tok = train_tiny_tokenizer()
    user = [{"role": "user", "content": "hi"}]
    text = render_chat(tok, user, tools=[WEATHER])["prompt"]
    assert text.startswith("<|im_start|>system\n" + tools_system_prompt([WEATHER]) + "<|im_end|>\n")
    history = user + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    text = render_chat(tok, history, tools=[ADD], tool_parser="smollm2")["prompt"]
    assert '<|im_start|>assistant\n<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call><|im_end|>' \
        in text and "<|im_start|>tool\n3<|im_end|>" in text


def test_parse_chat_tool_rules():
    pytest.importorskip("fastapi")
    from nanokv.entrypoints.openai.protocol import APIError, Limits, parse_chat
    from nanokv.entrypoints.openai.settings import ServerSettings
    from nanokv.testing.tiny import train_tiny_tokenizer

    tok = train_tiny_tokenizer()
    limits = Limits(1024, 16)
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    plain = ServerSettings(model_names=("m",))
    auto = ServerSettings(model_names=("m",), enable_auto_tool_choice=True, tool_call_parser="hermes")
    # tools without tool_choice are "auto", which needs both flags (vLLM's 400)
    for b in (body, {**body, "tool_choice": "auto"}):
        with pytest.raises(APIError) as e:
            parse_chat(b, plain, tok, limits)
        assert e.value.param == "tool_choice" and "--enable-auto-tool-choice and --tool-call-parser" in e.value.message
    gen = parse_chat(body, auto, tok, limits)
    assert gen.tools.choice == "auto" and gen.tools.parser == "hermes" and gen.params.structured_outputs is None
    assert "get_weather" in gen.prompts[0]["prompt"]
    # none: tools rendered, nothing read
    gen = parse_chat({**body, "tool_choice": "none"}, plain, tok, limits)
    assert gen.tools is None and "get_weather" in gen.prompts[0]["prompt"]
    # required: the grammar, compact JSON
    gen = parse_chat({**body, "tool_choice": "required", "parallel_tool_calls": False}, plain, tok, limits)
    spec = gen.params.structured_outputs
    assert spec.json == tool_schema(parse_tools([WEATHER]), "required", False) and spec.disable_any_whitespace
    with pytest.raises(APIError) as e:
        parse_chat({**body, "tool_choice": "required", "parallel_tool_calls": "no"}, plain, tok, limits)
    assert e.value.param == "parallel_tool_calls"
    # a tokenizer whose tag is a special token keeps it in the text for the parser (vLLM's hermes rule)
    assert parse_chat(body, auto, tok, limits).params.skip_special_tokens
    tok.add_tokens(["<tool_call>", "</tool_call>"], special_tokens=True)
    assert parse_chat(body, auto, tok, limits).params.skip_special_tokens is False
    assert parse_chat({**body, "tool_choice": "none"}, auto, tok, limits).params.skip_special_tokens
