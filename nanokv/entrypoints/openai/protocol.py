"""OpenAI request bodies -> what the engine takes, and the error object.

Everything here is validation of a JSON body against OpenAI's (and vLLM's) field names:
nothing touches the engine. A bad field raises APIError(400) naming the field and the
fix. Unknown fields are ignored (as vLLM does); known fields nanokv cannot honour are
accepted only with their "off" value, so that a request is never silently answered as
something it did not ask for.
"""

from __future__ import annotations

import json
import re
import reprlib
from dataclasses import dataclass
from typing import Any, Callable

from nanokv.entrypoints.openai.settings import ServerSettings
from nanokv.llm import message_text, render_chat
from nanokv.llm_engine import check_text
from nanokv.sampling_params import SamplingParams, StructuredOutputsParams
from nanokv.tool_calls import Tool, check_schemas, get_parser, parse_tool_choice, parse_tools, tool_schema

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                404: "NotFoundError", 405: "MethodNotAllowedError", 408: "RequestTimeoutError",
                413: "RequestTooLargeError", 415: "UnsupportedMediaTypeError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}


class APIError(Exception):
    """An HTTP error with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


_MAX_MESSAGE = 2000  # a message quoting a huge value stays readable


def error_body(status: int, message: str, param: str | None = None) -> dict:
    if len(message) > _MAX_MESSAGE:
        message = message[:_MAX_MESSAGE - 3] + "..."
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "APIError"),
                      "param": param, "code": status}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


@dataclass(frozen=True)
class Limits:
    """What a request must fit, checked before any tokenizing."""

    max_model_len: int
    max_token_chars: int  # the longest token's text: a prompt of more than max_model_len times
    #                       this many characters cannot fit max_model_len tokens

    @classmethod
    def of(cls, tokenizer, max_model_len: int) -> "Limits":
        tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        return cls(max_model_len, max(len(t) for t in tokens if isinstance(t, str)))

    def check_text(self, num_chars: int, field: str) -> None:
        """A 400 for text too long for any tokenization to fit max_model_len (tokenizing
        megabytes costs seconds of CPU that other requests need)."""
        if num_chars > self.max_model_len * self.max_token_chars:
            raise bad_request(f"{field} has {num_chars} characters: more than max_model_len ({self.max_model_len}) "
                              f"tokens can hold (a token is at most {self.max_token_chars} characters); "
                              "shorten it", field)

    def check_max_tokens(self, params: SamplingParams, name: str) -> None:
        """A 400 for a max_tokens no request can use (more than max_model_len: OpenAI and
        vLLM refuse it too); one that merely exceeds the room after the prompt is clamped."""
        if params.max_tokens is not None and params.max_tokens > self.max_model_len:
            raise bad_request(f"{name}={_show(params.max_tokens)} is more than max_model_len "
                              f"({self.max_model_len}), which prompt and output share; lower it, or send null "
                              "for as many as fit", name)


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools and how its answers are read: "auto" (the server's parser
    extracts calls), "required" (a JSON array of calls) or a named Tool (its arguments)."""

    tools: list[Tool]
    choice: str | Tool
    parser: str | None  # auto: --tool-call-parser
    parallel: bool  # parallel_tool_calls: False keeps at most one call


@dataclass
class GenerationRequest:
    """A completions or chat request, validated (not yet against the model's limits,
    which make_request checks)."""

    model: str  # the served name the client asked for
    prompts: list  # for make_request: str, token ids, or {"prompt", "prompt_token_ids"} (chat)
    params: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage
    continuous_usage: bool  # stream_options.continuous_usage_stats (vLLM): usage on every chunk
    logprobs: int | None  # top-N per token (completions: logprobs; chat: top_logprobs), None: off
    param_names: dict[str, str]  # SamplingParams field -> the request field it came from
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:N" (return_tokens_as_token_ids)
    role: str = "assistant"  # chat: the answer's role
    # vLLM's echo: completions put each prompt's text before its answers (echo_text None);
    # chat puts echo_text (the last message's content, when its role is the answer's) first
    echo: bool = False
    echo_text: str | None = None
    # vLLM's add_special_tokens (completions: default true; chat: false, the template holds them)
    add_special_tokens: bool = True
    return_token_ids: bool = False  # vLLM's: token_ids on each choice, the prompt's prompt_token_ids
    # completions' echo with max_tokens=0 (vLLM's prompt scoring, as lm-eval sends): the engine
    # generates one token, which the answer leaves out; the choice is the scored prompt alone
    score_only: bool = False
    tools: ToolRequest | None = None  # chat with tools and a tool_choice other than "none"


@dataclass
class TokenizeRequest:
    """POST /tokenize, validated and tokenized."""

    prompt: str  # the text (chat: the rendered conversation)
    token_ids: list[int]
    token_strs: bool  # return_token_strs


@dataclass
class DetokenizeRequest:
    """POST /detokenize, validated."""

    token_ids: list[int]


# ---- the fields ------------------------------------------------------------------------------

def _off(*values) -> Callable[[Any, dict], bool]:
    return lambda value, body: value in values


# SamplingParams fields taken as they are (None: the default).
_SAMPLING = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
             "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
             "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
             "truncate_prompt_tokens", "logit_bias", "allowed_token_ids", "bad_words", "prompt_logprobs")

# Known fields nanokv does not implement: accepted only when they ask for nothing.
_UNSUPPORTED_COMMON = {
    "use_beam_search": _off(None, False),
    "logits_processors": _off(None, []),
    # vLLM keeps salted requests' prefix-cache blocks apart; here every request shares them,
    # so a salt (which asks for that isolation) is refused rather than silently ignored
    "cache_salt": _off(None),
}
_UNSUPPORTED_COMPLETION = {
    **_UNSUPPORTED_COMMON,
    "suffix": _off(None, ""),
    "best_of": lambda v, body: v is None or (v == body.get("n", 1) or (v == 1 and body.get("n") is None)),
}
_UNSUPPORTED_CHAT = {
    **_UNSUPPORTED_COMMON,
    "functions": _off(None, []),
    "function_call": lambda v, body: v is None or v == "none" or (v == "auto" and not body.get("functions")),
    "audio": _off(None),
    "modalities": lambda v, body: v is None or v == ["text"],
    "prediction": _off(None),
    "documents": _off(None),
    "web_search_options": _off(None),
}
_UNSUPPORTED_TOKENIZE = {
    "mm_processor_kwargs": _off(None, {}),
}


def parse_completion(body: dict, settings: ServerSettings, limits: Limits,
                     defaults: dict | None = None) -> GenerationRequest:
    """POST /v1/completions. defaults: SamplingParams field -> the model's default
    (EngineConfig.default_sampling_params) for the fields the request leaves unset."""
    _check_unsupported(body, _UNSUPPORTED_COMPLETION)
    model = check_model(body, settings.model_names)
    prompts = _prompts(body.get("prompt"))
    for prompt in prompts:
        if isinstance(prompt, str):
            limits.check_text(len(prompt), "prompt")
    kwargs = _sampling_kwargs(body, defaults)
    # unset: the model's default, else OpenAI's and vLLM's 16 tokens; an explicit null means
    # up to max_model_len
    kwargs["max_tokens"] = body["max_tokens"] if "max_tokens" in body else _unset_max_tokens(defaults, limits, 16)
    echo = _get(body, "echo", bool, "true or false", False)
    # vLLM's prompt scoring: echo with max_tokens=0 returns the prompt alone (one token is
    # generated and left out, so the request still runs through the sampler once)
    score_only = echo and type(kwargs["max_tokens"]) is int and kwargs["max_tokens"] == 0
    if score_only:
        kwargs["max_tokens"] = 1
    logprobs = body.get("logprobs")
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
        if echo and kwargs.get("prompt_logprobs") is None:  # the echoed prompt's logprobs (vLLM's rule)
            kwargs["prompt_logprobs"] = logprobs
    names = {"max_tokens": "max_tokens", "logprobs": "logprobs"}
    params = _sampling_params(kwargs, names)
    limits.check_max_tokens(params, "max_tokens")
    stream, include_usage, continuous = _stream(body)
    _check_streamed_prompt_logprobs(body, stream)
    return GenerationRequest(model, prompts, params, stream, include_usage, continuous, params.logprobs,
                             {"prompt": "prompt", **names}, _tokens_as_ids(body, settings), echo=echo,
                             score_only=score_only,
                             add_special_tokens=_get(body, "add_special_tokens", bool, "true or false", True),
                             return_token_ids=_get(body, "return_token_ids", bool, "true or false", False))


def parse_chat(body: dict, settings: ServerSettings, tokenizer, limits: Limits,
               defaults: dict | None = None) -> GenerationRequest:
    """POST /v1/chat/completions; the messages are rendered with the chat template.
    defaults: as parse_completion's."""
    _check_unsupported(body, _UNSUPPORTED_CHAT)
    model = check_model(body, settings.model_names)
    messages = _messages(body.get("messages"))
    _check_messages_length(messages, limits)
    add_generation_prompt = _get(body, "add_generation_prompt", bool, "true or false", True)
    kwargs = _sampling_kwargs(body, defaults)
    tools, tool_request = _tools(body, settings)
    if tool_request is not None and tool_request.choice != "auto":
        if "structured_outputs" in kwargs:
            raise bad_request("tool_choice required or a named function constrains the output to tool calls; "
                              "drop response_format / structured_outputs / guided_*, or use tool_choice auto",
                              "tool_choice")
        try:
            schema = tool_schema(tool_request.tools, tool_request.choice, tool_request.parallel)
        except ValueError as e:
            raise bad_request(str(e), "tools") from None
        # compact JSON: a small model given free whitespace can spend max_tokens on it
        kwargs["structured_outputs"] = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    elif tool_request is not None and _special(tokenizer, get_parser(tool_request.parser).start):
        kwargs["skip_special_tokens"] = False  # the parser reads the tag (vLLM's hermes parser does the same)
    names = {"prompt": "messages"}
    if body.get("max_completion_tokens") is not None:
        kwargs["max_tokens"], names["max_tokens"] = body["max_completion_tokens"], "max_completion_tokens"
    else:  # unset or null: the model's default, else as many as fit
        given = body.get("max_tokens")
        kwargs["max_tokens"] = _unset_max_tokens(defaults, limits, None) if given is None else given
        names["max_tokens"] = "max_tokens"
    want_logprobs = _get(body, "logprobs", bool, "true or false", False)
    top = body.get("top_logprobs")
    if top is not None and not want_logprobs:
        raise bad_request("top_logprobs needs logprobs: true; set it, or drop top_logprobs", "top_logprobs")
    if want_logprobs:
        kwargs["logprobs"] = 0 if top is None else top
        names["logprobs"] = "top_logprobs"
    params = _sampling_params(kwargs, names)
    limits.check_max_tokens(params, names["max_tokens"])
    stream, include_usage, continuous = _stream(body)
    _check_streamed_prompt_logprobs(body, stream)
    prompt = _render(body, messages, settings, tokenizer, add_generation_prompt, tools)
    add_special = _get(body, "add_special_tokens", bool, "true or false", False)
    if add_special:  # the tokenizer's own (a BOS) on top of the template's
        prompt = {**prompt, "prompt_token_ids": tokenizer(prompt["prompt"], add_special_tokens=True).input_ids}
    # vLLM's rule: the configured role answers a generation prompt; without one the model
    # continues the last message, so the answer has that message's role
    role = settings.response_role if add_generation_prompt else messages[-1]["role"]
    # vLLM's echo: the answer starts with the last message when that message has the answer's role
    echo = _get(body, "echo", bool, "true or false", False)
    echo_text = messages[-1]["content"] if echo and messages[-1]["role"] == role else None
    return GenerationRequest(model, [prompt], params, stream, include_usage, continuous, params.logprobs, names,
                             _tokens_as_ids(body, settings), role, echo=echo_text is not None,
                             echo_text=echo_text, add_special_tokens=add_special,
                             return_token_ids=_get(body, "return_token_ids", bool, "true or false", False),
                             tools=tool_request)


def _special(tokenizer, text: str) -> bool:
    """Whether text is lost when the output is decoded with skip_special_tokens."""
    return tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids, skip_special_tokens=True) != text


def _tools(body: dict, settings: ServerSettings) -> tuple[list[dict] | None, ToolRequest | None]:
    """The request's tools for the template (None: none) and, unless tool_choice is "none",
    how its answers are read. vLLM's rules: tool_choice unset with tools is "auto", which
    needs the server's --enable-auto-tool-choice and --tool-call-parser."""
    raw = body.get("tools")
    try:
        tools = None if raw is None else parse_tools(raw)
    except ValueError as e:
        raise bad_request(str(e), "tools") from None
    try:
        choice = parse_tool_choice(body.get("tool_choice"), tools)
    except ValueError as e:
        raise bad_request(str(e), "tool_choice") from None
    parallel = _get(body, "parallel_tool_calls", bool, "true or false", True)
    if choice is None or choice == "none":
        return (raw or None) if choice else None, None
    if choice == "auto" and not (settings.enable_auto_tool_choice and settings.tool_call_parser):
        raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                          "on the server; send tool_choice required, none or a named function, or restart the "
                          "server with both flags", "tool_choice")
    if choice != "auto":
        try:
            check_schemas(tools if choice == "required" else [choice])
        except ValueError as e:
            raise bad_request(str(e), "tools") from None
    return raw, ToolRequest(tools, choice, settings.tool_call_parser, parallel)


def parse_tokenize(body: dict, settings: ServerSettings, tokenizer, limits: Limits) -> TokenizeRequest:
    """POST /tokenize: {"prompt": text} or {"messages": [...]} (vLLM's two bodies); special
    tokens are added to a prompt by default, not to a conversation (its template holds them)."""
    check_model(body, settings.model_names)
    token_strs = _get(body, "return_token_strs", bool, "true or false", False)
    if "messages" in body:
        _check_unsupported(body, _UNSUPPORTED_TOKENIZE)
        messages = _messages(body["messages"])
        _check_messages_length(messages, limits)
        add_generation_prompt = _get(body, "add_generation_prompt", bool, "true or false", True)
        add_special = _get(body, "add_special_tokens", bool, "true or false", False)
        tools = body.get("tools")  # rendered by the template only: /tokenize calls no tools
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise bad_request(f"tools must be a list of tool objects, got {_show(tools)}", "tools")
        text = _render(body, messages, settings, tokenizer, add_generation_prompt, tools or None)["prompt"]
    else:
        text = body.get("prompt")
        if not isinstance(text, str):
            raise bad_request(f'send "prompt": a string, or "messages": a list of messages; got prompt '
                              f"{_show(text)}", "prompt")
        limits.check_text(len(text), "prompt")
        try:
            check_text(text, "prompt")
        except ValueError as e:
            raise bad_request(str(e), "prompt") from None
        add_special = _get(body, "add_special_tokens", bool, "true or false", True)
    return TokenizeRequest(text, tokenizer(text, add_special_tokens=add_special).input_ids, token_strs)


def parse_detokenize(body: dict, settings: ServerSettings, vocab_size: int) -> DetokenizeRequest:
    """POST /detokenize: {"tokens": [ids]}; an id outside the vocabulary is a 400."""
    check_model(body, settings.model_names)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request(f"tokens must be a list of token ids, got {_show(tokens)}", "tokens")
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"tokens holds {bad}, which is not a token id: the vocabulary has ids 0 to "
                          f"{vocab_size - 1}", "tokens")
    return DetokenizeRequest(tokens)


def check_model(body: dict, names: tuple[str, ...]) -> str:
    """The served name the request asked for (none: the first); 404 for another, as vLLM."""
    model = body.get("model")
    if model is None:
        return names[0]
    if not isinstance(model, str):
        raise bad_request(f"model must be a string, got {_show(model)}", "model")
    if model not in names:
        raise model_not_found(model)
    return model


def model_not_found(model: str) -> APIError:
    """vLLM's 404 for a model that is not served."""
    shown = model if len(model) <= 200 else model[:197] + "..."
    return APIError(404, f"The model `{shown}` does not exist.", "model")


def _check_messages_length(messages: list[dict], limits: Limits) -> None:
    limits.check_text(sum(len(m["content"]) + len(m["role"]) + len(m.get("name", ""))
                          + (len(_json_text(m["tool_calls"])) if "tool_calls" in m else 0) for m in messages),
                      "messages")


def _json_text(value) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def _chat_template(body: dict, settings: ServerSettings) -> str | None:
    """The request's chat_template when the server trusts requests' templates, else the
    server's (None: the tokenizer's)."""
    template = _get(body, "chat_template", str, "a string (a Jinja template)")
    if template is None:
        return settings.chat_template
    if not settings.trust_request_chat_template:
        raise bad_request("chat_template in a request is refused: the server uses its own (--chat-template, else "
                          "the tokenizer's); start it with --trust-request-chat-template to allow it, or drop the "
                          "field", "chat_template")
    return template


def _render(body: dict, messages: list[dict], settings: ServerSettings, tokenizer, add_generation_prompt: bool,
            tools: list[dict] | None = None) -> dict:
    """The conversation through the chat template with the request's template options
    (vLLM's continue_final_message, chat_template_kwargs) and the server's
    (--chat-template, --chat-template-content-format)."""
    template = _chat_template(body, settings)
    continue_final = _get(body, "continue_final_message", bool, "true or false", False)
    kwargs = _get(body, "chat_template_kwargs", dict, "an object of template variables")
    if settings.chat_template_content_format == "openai":  # the template reads a list of parts
        messages = [{**m, "content": _parts(raw.get("content"))} for m, raw in zip(messages, body["messages"])]
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise bad_request(f"tools must be a list of tool objects, got {_show(tools)}", "tools")
    try:
        return render_chat(tokenizer, messages, template, add_generation_prompt,
                           continue_final_message=continue_final, tools=tools, chat_template_kwargs=kwargs,
                           content_format=settings.chat_template_content_format,
                           tool_parser=settings.tool_call_parser)
    except ValueError as e:
        param = next((f for f in ("continue_final_message", "chat_template_kwargs") if f in str(e)), "messages")
        raise bad_request(str(e), param) from None


def _parts(content) -> list[dict]:
    """Validated content (_messages) as OpenAI's text parts."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [{"type": "text", "text": part["text"]} for part in content]


def _tokens_as_ids(body: dict, settings: ServerSettings) -> bool:
    return _get(body, "return_tokens_as_token_ids", bool, "true or false", settings.return_tokens_as_token_ids)


def rename_fields(message: str, names: dict[str, str]) -> str:
    """A SamplingParams / engine message with the request's field name at its front
    ('max_tokens must be ...' -> 'max_completion_tokens must be ...')."""
    for ours, theirs in names.items():
        if ours != theirs and ours != "prompt" and re.match(rf"{ours}\b", message):
            return theirs + message[len(ours):]
    return message


def param_of(message: str, names: dict[str, str]) -> str | None:
    """The request field a validation message is about (it starts with the field's name)."""
    match = re.match(r"(?:each of )?([a-z_]+)", message)
    if not match:
        return None
    word = match.group(1)
    if word == "prompt":
        return names.get("prompt", "prompt")
    return word if word in names.values() or word in _SAMPLING else None


# ---- helpers -----------------------------------------------------------------------------------

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxdict = 6
_REPR.maxlevel = 3


def _show(value: Any) -> str:
    """A short repr, however big or deep the value."""
    return _REPR.repr(value)


def _get(body: dict, name: str, kinds, what: str, default=None):
    """body[name] if it has the right type; None or absent: the default."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise bad_request(f"{name} must be {what}, got {_show(value)}", name)
    return value


def _check_unsupported(body: dict, fields: dict) -> None:
    for name, harmless in fields.items():
        if name in body:
            try:
                ok = harmless(body[name], body)
            except TypeError:  # an unhashable or odd value
                ok = False
            if not ok:
                raise bad_request(f"{name}={_show(body[name])} is not supported by nanokv; remove it "
                                  "(docs/vllm-compat.md lists what is)", name)


_PROMPT_FORMS = "a string, a list of strings, a list of token ids or a list of token-id lists"


def _prompts(prompt) -> list:
    if prompt is None:
        raise bad_request(f"prompt is required: {_PROMPT_FORMS}", "prompt")
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad_request(f"prompt must be {_PROMPT_FORMS}, got {_show(prompt)}", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [prompt]
    if all(isinstance(p, list) for p in prompt):
        return list(prompt)  # each checked as token ids by the engine
    raise bad_request(f"prompt must be {_PROMPT_FORMS} (not a mix), got {_show(prompt)}", "prompt")


def _messages(messages) -> list[dict]:
    """OpenAI messages -> {"role", "content": str} for the chat template; content parts
    of type "text" are joined with newlines (vLLM's rule for string templates)."""
    fix = 'send [{"role": "user", "content": "Hi"}, ...]'
    if messages is None:
        raise bad_request(f"messages is required; {fix}", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request(f"messages must be a non-empty list of messages, got {_show(messages)}; {fix}",
                          "messages")
    result = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object with role and content, got {_show(m)}; {fix}", "messages")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise bad_request(f"{where}.role must be a string such as 'user', got {_show(role)}", "messages")
        if m.get("function_call"):
            raise bad_request(f"{where} has function_call (OpenAI's deprecated form); send tool_calls", "messages")
        calls = m.get("tool_calls")
        if "content" not in m and not calls:
            raise bad_request(f"{where} has no content; {fix}", "messages")
        message = {"role": role, "content": _content(m.get("content"), where)}
        if isinstance(m.get("name"), str):
            message["name"] = m["name"]
        if calls:
            if role != "assistant":
                raise bad_request(f"{where} has tool_calls, which only assistant messages carry", "messages")
            message["tool_calls"] = calls  # checked and converted by render_chat (tool_calls.with_tools)
        if m.get("tool_call_id") is not None:
            if not isinstance(m["tool_call_id"], str):
                raise bad_request(f"{where}.tool_call_id must be a string, got {_show(m['tool_call_id'])}",
                                  "messages")
            message["tool_call_id"] = m["tool_call_id"]
        result.append(message)
    return result


def _content(content, where: str) -> str:
    try:
        return message_text(content, where)
    except ValueError as e:
        raise bad_request(str(e), "messages") from None


def _sampling_kwargs(body: dict, defaults: dict | None = None) -> dict:
    """The request's sampling fields over the model's defaults (vLLM's rule: a default
    fills each field the request leaves unset or null)."""
    given = {name: body[name] for name in _SAMPLING if body.get(name) is not None}
    spec = _structured_outputs(body)
    if spec is not None:
        given["structured_outputs"] = spec
    return {**(defaults or {}), **given}


# vLLM's guided_* extras -> StructuredOutputsParams fields
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
GRAMMAR_BACKENDS = ("auto", "guidance", "llguidance")  # guided_decoding_backend values served (llguidance)


def _structured_outputs(body: dict) -> StructuredOutputsParams | None:
    """response_format, structured_outputs or vLLM's guided_* fields as one
    StructuredOutputsParams (compiled later, when the request is made); None: none given."""
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in GRAMMAR_BACKENDS:
        raise bad_request(f"guided_decoding_backend {_show(backend)} is not available: nanokv compiles grammars "
                          f"with llguidance; use one of {', '.join(GRAMMAR_BACKENDS)} or leave it unset",
                          "guided_decoding_backend")
    found: list[tuple[str, Any]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            found.append(("response_format", spec))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", body["structured_outputs"]))
    guided = {field: body[name] for name, field in _GUIDED.items() if body.get(name) is not None}
    if guided:
        if body.get("guided_whitespace_pattern") is not None:
            guided["whitespace_pattern"] = body["guided_whitespace_pattern"]
        found.append((next(n for n in _GUIDED if body.get(n) is not None), guided))
    if not found:
        return None
    names = [name for name, _ in found]
    if len(found) > 1 or len(guided) > 1 + ("whitespace_pattern" in guided):
        names += [n for n in _GUIDED if body.get(n) is not None and n not in names]
        raise bad_request(f"give one structured-output constraint per request, got {', '.join(names)}", names[-1])
    name, spec = found[0]
    try:
        return StructuredOutputsParams.of(spec, name)
    except (ValueError, TypeError) as e:
        message = str(e).replace("structured_outputs", name) if name != "structured_outputs" else str(e)
        raise bad_request(message, name) from None


def _response_format(fmt) -> StructuredOutputsParams | None:
    """OpenAI's response_format as a spec (None: text)."""
    try:
        return StructuredOutputsParams.from_response_format(fmt)
    except ValueError as e:
        raise bad_request(str(e).replace("structured_outputs.json", "response_format.json_schema.schema"),
                          "response_format") from None


def _unset_max_tokens(defaults: dict | None, limits: Limits, fallback: int | None) -> int | None:
    """max_tokens for a request that sets none: the model's default, at most max_model_len
    (a default is no request for more; the engine clamps it to what the prompt leaves),
    else `fallback`."""
    value = (defaults or {}).get("max_tokens", fallback)
    return value if value is None else min(value, limits.max_model_len)


def _sampling_params(kwargs: dict, names: dict[str, str]) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        message = rename_fields(str(e), names)
        raise bad_request(message, param_of(message, names)) from None


def _check_streamed_prompt_logprobs(body: dict, stream: bool) -> None:
    """vLLM's rule: the prompt_logprobs field is not streamed (completions' echo with logprobs
    streams the prompt's logprobs in its echo chunk instead)."""
    if stream and body.get("prompt_logprobs") is not None:
        raise bad_request("prompt_logprobs is not available with stream: true; drop one of them (completions: "
                          "echo with logprobs streams the prompt's logprobs)", "prompt_logprobs")


def _stream(body: dict) -> tuple[bool, bool, bool]:
    stream = _get(body, "stream", bool, "true or false", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False, False
    if not stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(options, dict):
        raise bad_request(f"stream_options must be an object, got {_show(options)}", "stream_options")
    include_usage = _get(options, "include_usage", bool, "true or false", False)
    continuous = _get(options, "continuous_usage_stats", bool, "true or false", False)
    return stream, include_usage, continuous
