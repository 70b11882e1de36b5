"""Tool calling (torch-free): OpenAI's tools / tool_choice validated, the JSON schema that
constrains required and named calls, the tool-call parsers that read calls out of free
text (auto), the default system prompt for chat templates without a tool section, and
history messages with tool calls made ready for a template.

vLLM's rules: tool_choice unset with tools is "auto", "none" renders the tools and parses
nothing, "required" and a named function are constrained by a grammar (the output is a
JSON array of {"name", "parameters"} items, or the named function's arguments object),
"auto" generates freely and a parser (--tool-call-parser) extracts the calls.
"""

from __future__ import annotations

import copy
import json
import secrets
from dataclasses import dataclass

from nanokv.grammar import closed

TOOL_CHOICES = ("none", "auto", "required")  # besides {"type": "function", "function": {"name": ...}}
_NAMED_FORM = '{"type": "function", "function": {"name": "my_function"}}'
_TOOL_FORM = '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {JSON schema}}}'
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # a function without parameters takes {}
# tool_choice "required" writes at most this many calls (1 with parallel_tool_calls false): a
# small sampled model, free to go on, repeats calls until max_tokens cuts the array
MAX_REQUIRED_CALLS = 4
@dataclass(frozen=True)
class Tool:
    """One function a request offers: its name, description and parameters schema."""

    name: str
    description: str | None
    parameters: dict  # a JSON schema ({} or absent in the request: an empty object)


@dataclass(frozen=True)
class ToolCall:
    """A call as the response carries it: arguments are the JSON text of an object."""

    id: str
    name: str
    arguments: str

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    """vLLM's id form: chatcmpl-tool-<32 hex digits>."""
    return f"chatcmpl-tool-{secrets.token_hex(16)}"


def parse_tools(tools) -> list[Tool]:
    """OpenAI's tools list -> Tools; ValueError naming the bad entry and the form."""
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list of {_TOOL_FORM}, got {type(tools).__name__}")
    result, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise ValueError(f"{where} has type {kind!r}; nanokv takes function tools: {_TOOL_FORM}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{where}.function is missing or not an object; give {_TOOL_FORM}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.function.name must be a non-empty string, got {name!r:.60}")
        if name in seen:
            raise ValueError(f"{where}.function.name {name!r} is given twice; tool names must be unique")
        seen.add(name)
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise ValueError(f"{where}.function.description must be a string, got {type(description).__name__}")
        params = fn.get("parameters")
        if params is None or params == {}:
            params = dict(_EMPTY_PARAMETERS)
        if not isinstance(params, dict):
            raise ValueError(f"{where}.function.parameters must be a JSON schema object, got "
                             f"{type(params).__name__}")
        result.append(Tool(name, description, params))
    return result


def parse_tool_choice(choice, tools: list[Tool] | None) -> str | Tool | None:
    """tool_choice -> "none" / "auto" / "required" / the named Tool, or None (no tools
    asked for). vLLM's rules: unset with tools is "auto"; "required" with an empty tools
    list is "none"; a choice other than "none" needs tools."""
    if choice is None:
        return "auto" if tools else None
    if choice == "none":
        return "none" if tools else None
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise ValueError(f"tool_choice {choice!r} is not one of none, auto, required or {_NAMED_FORM}")
        if tools is None:
            raise ValueError(f"tool_choice {choice!r} needs tools; send tools, or drop tool_choice")
        if not tools:
            return "none" if choice == "required" else None
        return choice
    if not isinstance(choice, dict) or choice.get("type", "function") != "function" \
            or not isinstance(choice.get("function"), dict):
        raise ValueError(f"tool_choice must be none, auto, required or {_NAMED_FORM}, got {choice!r:.80}")
    name = choice["function"].get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool_choice.function.name must be a non-empty string; give {_NAMED_FORM}")
    if not tools:
        raise ValueError(f"tool_choice names the function {name!r}, but the request has no tools; send tools")
    for tool in tools:
        if tool.name == name:
            return tool
    raise ValueError(f"tool_choice names the function {name!r}, which is not in tools (they are "
                     f"{', '.join(t.name for t in tools)})")


def tool_schema(tools: list[Tool], choice: str | Tool, parallel: bool = True) -> dict | None:
    """The JSON schema an output must follow: a named function's parameters, or for
    "required" an array of {"name": <one tool's name>, "parameters": <its arguments>} items
    (at most MAX_REQUIRED_CALLS, one with parallel=False); None for "none" and "auto". Each tool's "$defs" are
    lifted to the top, where their "#/$defs/..." references point (one name, one definition)."""
    if isinstance(choice, Tool):
        return closed(choice.parameters)
    if choice != "required":
        return None
    defs: dict = {}
    items = []
    for i, tool in enumerate(tools):
        params = closed(tool.parameters)
        if "$defs" in params:
            params = dict(params)
            for key, value in params.pop("$defs").items():
                if key in defs and defs[key] != value:
                    raise ValueError(f"tools[{i}].function.parameters defines $defs.{key} differently from an "
                                     "earlier tool; give the definitions distinct names")
                defs[key] = value
        items.append({"type": "object", "properties": {"name": {"const": tool.name}, "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "maxItems": MAX_REQUIRED_CALLS if parallel else 1,
              "items": {"anyOf": items}}
    if defs:
        schema["$defs"] = defs
    return schema


def required_calls(text: str) -> list[dict] | None:
    """A "required" output (the JSON array tool_schema asks for) as [{"name", "arguments"}];
    None if it is not one (cut short by max_tokens)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                              and isinstance(c.get("parameters"), dict) for c in items):
        return None
    return [{"name": c["name"], "arguments": c["parameters"]} for c in items]


def named_call(text: str) -> dict | None:
    """A named function's output (its arguments object) as a dict; None if it is not one."""
    try:
        arguments = json.loads(text)
    except ValueError:
        return None
    return arguments if isinstance(arguments, dict) else None


# ---- parsers (auto) ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Extracted:
    """What a parser read from a whole output: the content (text before the first call;
    the whole text when no call parsed) and the calls as {"name", "arguments": dict}."""

    content: str
    calls: list[dict]


class ToolParser:
    """Calls written as <tool_call>JSON</tool_call> blocks; text before the first block is
    content, text after the calls is dropped. A block whose JSON does not parse into calls
    makes the whole output content (no calls), as vLLM's hermes parser does. The last block
    may lack its end tag (a model that stops at EOS after the JSON)."""

    name = ""
    start, end = "<tool_call>", "</tool_call>"
    lists = False  # a block may hold a JSON list of calls (else one object)
    format_text = ""  # the format as the default system prompt describes it

    def extract(self, text: str) -> Extracted:
        first = text.find(self.start)
        if first < 0:
            return Extracted(text, [])
        calls = []
        rest = text[first:]
        while rest.startswith(self.start):
            body, closed, after = rest[len(self.start):].partition(self.end)
            found = self._calls(body)
            if found is None:
                return Extracted(text, [])
            calls += found
            if not closed:
                break
            rest = after.lstrip()
        return Extracted(text[:first], calls)

    def _calls(self, body: str) -> list[dict] | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        items = value if self.lists and isinstance(value, list) else [value]
        calls = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            arguments = item.get("arguments", item.get("parameters", {}))
            if isinstance(arguments, str):  # some models write the arguments' JSON text
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    return None
            if not isinstance(arguments, dict):
                return None
            calls.append({"name": item["name"], "arguments": arguments})
        return calls

    def format_calls(self, calls: list[dict]) -> str:
        """Calls as this parser reads them (history for templates without tool_calls)."""
        raise NotImplementedError


class HermesParser(ToolParser):
    """Hermes / Qwen 2.5 / Qwen 3: one <tool_call>{"name", "arguments"}</tool_call> per call."""

    name = "hermes"
    format_text = ('To call one, write for each call:\n<tool_call>\n{"name": <function-name>, "arguments": '
                   '<args-json-object>}\n</tool_call>')

    def format_calls(self, calls: list[dict]) -> str:
        return "\n".join(f"{self.start}\n{json.dumps(c, ensure_ascii=False)}\n{self.end}" for c in calls)


class SmolLM2Parser(ToolParser):
    """SmolLM2-Instruct's function-calling format: <tool_call>[{"name", "arguments"}, ...]
    </tool_call>, a JSON list of calls in one block (an object alone is taken too)."""

    name = "smollm2"
    lists = True
    format_text = ('To call them, write a list of calls:\n'
                   '<tool_call>[{"name": <function-name>, "arguments": <args-json-object>}, ...]</tool_call>')

    def format_calls(self, calls: list[dict]) -> str:
        return f"{self.start}{json.dumps(calls, ensure_ascii=False)}{self.end}"


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "smollm2": SmolLM2Parser}
DEFAULT_PROMPT_PARSER = "hermes"  # the format the default system prompt describes without --tool-call-parser


def get_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"--tool-call-parser {name!r} is not available; use one of "
                         f"{', '.join(TOOL_PARSERS)}") from None


def held_back(text: str, start: str) -> int:
    """How many characters at the end of text may begin `start` (streamed content holds
    them back until the next delta tells)."""
    for n in range(min(len(start) - 1, len(text)), 0, -1):
        if start.startswith(text[-n:]):
            return n
    return 0


# ---- rendering -------------------------------------------------------------------------------

DEFAULT_TOOLS_PROMPT = "You may call these functions:\n<tools>\n{tools}\n</tools>\n{format}"


def tools_system_prompt(tools: list[dict], parser: str | None = None) -> str:
    """The system prompt that gives a template without a tool section its tools, in the
    format `parser` reads (DEFAULT_PROMPT_PARSER when None)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return DEFAULT_TOOLS_PROMPT.format(tools=listed, format=get_parser(parser or DEFAULT_PROMPT_PARSER).format_text)


def template_reads(source, name: str) -> bool:
    """Whether a chat template's source reads a variable (tools) or a message key
    (tool_calls). Not a str (a dict of named templates, None): assumed to."""
    if not isinstance(source, str):
        return True
    if name == "tools":
        import jinja2
        from jinja2 import meta

        try:
            return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(source))
        except jinja2.TemplateSyntaxError:
            return True  # the template's own error shows when it is applied
    return name in source


def with_tools(conversation: list[dict], tools: list[dict] | None, template_source, parser: str | None) -> \
        tuple[list[dict], list[dict] | None]:
    """The conversation and the tools= argument for a template: history tool calls'
    arguments as dicts (templates index them, as vLLM passes them); for a template that
    does not read tools, the tools go into the system prompt (merged into the first system
    message, else a new one first); for one that does not read tool_calls, an assistant
    message's calls are written into its content in the parser's format."""
    conversation = [_history_message(m, i) for i, m in enumerate(conversation)]
    if any(m.get("tool_calls") for m in conversation) and not template_reads(template_source, "tool_calls"):
        fmt = get_parser(parser or DEFAULT_PROMPT_PARSER)
        conversation = [_calls_in_content(m, fmt) for m in conversation]
    if not tools or template_reads(template_source, "tools"):
        return conversation, tools or None
    prompt = tools_system_prompt(tools, parser)
    first = conversation[0] if conversation else {}
    if first.get("role") == "system" and isinstance(first.get("content"), str):
        merged = f"{first['content']}\n\n{prompt}" if first["content"] else prompt
        return [{**first, "content": merged}, *conversation[1:]], None
    if first.get("role") == "system" and isinstance(first.get("content"), list):  # OpenAI's parts
        return [{**first, "content": [*first["content"], {"type": "text", "text": prompt}]}, *conversation[1:]], None
    parts = any(isinstance(m.get("content"), list) for m in conversation)
    content = [{"type": "text", "text": prompt}] if parts else prompt
    return [{"role": "system", "content": content}, *conversation], None


def _history_message(m: dict, i: int) -> dict:
    calls = m.get("tool_calls")
    if calls is None:
        return m
    if not isinstance(calls, list):
        raise ValueError(f"messages[{i}].tool_calls must be a list of {{id, type, function: {{name, arguments}}}}")
    fixed = []
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where} must be {{id, type: function, function: {{name, arguments}}}}")
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as e:
                raise ValueError(f"{where}.function.arguments is not valid JSON: {e}") from None
        if not isinstance(arguments, dict):
            raise ValueError(f"{where}.function.arguments must be the JSON text of an object")
        call = copy.deepcopy(call)
        call["function"] = {**call["function"], "arguments": arguments}
        call.setdefault("type", "function")
        fixed.append(call)
    return {**m, "tool_calls": fixed, "content": m.get("content")}


def _calls_in_content(m: dict, parser: ToolParser) -> dict:
    if not m.get("tool_calls"):
        return m
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
    text = m.get("content") or ""
    if not isinstance(text, str):
        return m  # content parts: the template gets the calls as they are
    written = parser.format_calls(calls)
    return {**m, "content": f"{text}\n{written}" if text else written}


def check_schemas(tools: list[Tool]) -> None:
    """ValueError naming the first tool whose parameters llguidance cannot compile (the
    grammar that constrains required and named calls is built from them)."""
    try:
        from llguidance import LLMatcher
    except ImportError:  # nothing to compile with; required / named then fail at make_request
        return
    for i, tool in enumerate(tools):
        try:
            grammar = LLMatcher.grammar_from_json_schema(closed(tool.parameters))
            error = LLMatcher.validate_grammar(grammar, None)
        except (ValueError, TypeError) as e:
            error = str(e)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"tools[{i}].function.parameters ({tool.name}) is not a usable JSON schema: {error}")


# ---- answers -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolAnswer:
    """One choice's answer: content (None when only calls), the calls, the finish reason."""

    content: str | None
    calls: list[ToolCall]
    finish_reason: str | None


def read_answer(text: str, finish_reason: str | None, choice: str | Tool, parser: str | None,
                parallel: bool = True) -> ToolAnswer:
    """A whole output as content and calls. Only an output that ended on its own (finish
    reason "stop") is read for calls: one cut by max_tokens (or aborted) is text, with its
    own finish reason. Calls of "auto" and "required" finish with "tool_calls"; a named
    function's call finishes with "stop" (OpenAI's and vLLM's rule). parallel=False keeps
    the first call."""
    if finish_reason != "stop":
        return ToolAnswer(text, [], finish_reason)
    content: str | None = None
    if isinstance(choice, Tool):
        arguments = named_call(text)
        found = None if arguments is None else [{"name": choice.name, "arguments": arguments}]
    elif choice == "required":
        found = required_calls(text)
    else:
        extracted = get_parser(parser).extract(text)
        found, content = extracted.calls or None, extracted.content or None
    if not found:
        return ToolAnswer(text, [], finish_reason)
    if not parallel:
        found = found[:1]
    calls = [ToolCall(new_call_id(), c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in found]
    return ToolAnswer(content, calls, "stop" if isinstance(choice, Tool) else "tool_calls")


class ToolStream:
    """One streamed choice: text deltas in, the content that is safe to send out. With
    "auto" the text before the parser's start tag streams (what may begin the tag is held
    back); from the tag on, and for "required" and named calls the whole output, is held
    until the end, where finish() reads it as read_answer does. So the deltas add up to
    the non-streamed answer."""

    def __init__(self, choice: str | Tool, parser: str | None, parallel: bool = True):
        self.choice, self.parser, self.parallel = choice, parser, parallel
        self.start = get_parser(parser).start if choice == "auto" else None
        self.text = ""
        self.sent = 0  # characters of text sent as content
        self.holding = self.start is None  # from here on nothing is sent until finish()

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.holding:
            return ""
        found = self.text.find(self.start, self.sent)
        end = found if found >= 0 else len(self.text) - held_back(self.text, self.start)
        self.holding = found >= 0
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self, finish_reason: str | None) -> tuple[str, ToolAnswer]:
        """The content still to send, and the whole answer."""
        answer = read_answer(self.text, finish_reason, self.choice, self.parser, self.parallel)
        return (answer.content or "")[self.sent:], answer
