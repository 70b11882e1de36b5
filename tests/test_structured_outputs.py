"""Structured outputs (llguidance) through LLM.generate / LLM.chat on the real SmolLM2:
JSON schemas, json_object, regex, choice, Lark and GBNF grammars, greedy and sampled with
seeds and n > 1; every output parses and validates, unconstrained neighbours are unchanged
token for token, prefix hits change nothing, preempted outputs still validate; bad specs are ValueErrors
before any work starts."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from nanokv import LLM, SamplingParams
from nanokv.sampling_params import GuidedDecodingParams, StructuredOutputsParams


pytestmark = pytest.mark.slow

POOL = dict(kv_cache_memory_bytes=64 << 20, max_model_len=1024)

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        "tags": {"type": "array", "items": {"enum": ["big", "old", "coastal"]}, "maxItems": 3},
        "mayor": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}},
                  "required": ["name"], "additionalProperties": False},
    },
    "required": ["city", "population", "tags", "mayor"],
    "additionalProperties": False,
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                                                                         "maximum": 150},
                   "color": {"enum": ["red", "green", "blue"]}},
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
GREETING = 'start: greeting " " name\ngreeting: "hello" | "hi"\nname: /[a-z]{1,8}/'


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM("smollm2", **POOL)


def user(text):
    return [{"role": "user", "content": text}]


def so(max_tokens=200, temperature=0.0, **spec):
    return SamplingParams(temperature=temperature, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**spec))


def validate(value, schema):
    """jsonschema's verdict when installed, else the fields checked by hand."""
    if importlib.util.find_spec("jsonschema") is not None:
        import jsonschema

        jsonschema.validate(value, schema)
        return
    assert isinstance(value, dict) and set(value) == set(schema["required"])
    for key, sub in schema["properties"].items():
        if "enum" in sub:
            assert value[key] in sub["enum"]


def texts(outs):
    return [c for o in outs for c in o.outputs]


def test_json_schemas_greedy_sampled_and_n_validate(llm):
    convs = [user("Describe Paris as a JSON object."), user("Describe a person as JSON."),
             user("Give a JSON object describing Rome.")]
    params = [so(json=CITY), so(json=json.dumps(PERSON), temperature=0.9),
              SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=200,
                             structured_outputs=StructuredOutputsParams(json=CITY))]
    params[1].seed = 3
    outs = texts(llm.chat(convs, params, use_tqdm=False))
    assert len(outs) == 5
    for c, schema in zip(outs, [CITY, PERSON, CITY, CITY, CITY]):
        assert c.finish_reason == "stop", c.text
        validate(json.loads(c.text), schema)
    assert len({c.text for c in outs[2:]}) > 1  # the n samples draw on their own
    # the same seeds again, now with prefix hits: the same outputs
    again = texts(llm.chat(convs, params, use_tqdm=False))
    assert [c.token_ids for c in again] == [c.token_ids for c in outs]


def test_json_object_regex_choice_lark_gbnf_and_guided_decoding(llm):
    convs = [user('Reply with the JSON object {"ok": true}.'), user("Give a phone-like code."),
             user("Is the sky blue?"), user("Greet someone."), user("Yes or no?"), user("Pick a color.")]
    params = [so(json_object=True), so(regex=r"\d{3}-[a-z]{2,8}"),
              SamplingParams(temperature=1.0, seed=11, n=4, max_tokens=10,
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe so"])),
              so(grammar=GREETING), so(grammar='root ::= "yes" | "no"', temperature=1.0),
              SamplingParams(temperature=0, max_tokens=10,
                             guided_decoding=GuidedDecodingParams(choice=["red", "green"]))]
    params[4].seed = 1
    outs = texts(llm.chat(convs, params, use_tqdm=False))
    assert all(c.finish_reason == "stop" for c in outs), [c.text for c in outs]
    assert isinstance(json.loads(outs[0].text), dict)
    assert re.fullmatch(r"\d{3}-[a-z]{2,8}", outs[1].text)
    assert all(c.text in ("yes", "no", "maybe so") for c in outs[2:6])
    assert re.fullmatch(r"(hello|hi) [a-z]{1,8}", outs[6].text)
    assert outs[7].text in ("yes", "no")
    assert outs[8].text in ("red", "green")


def test_neighbours_unchanged_and_preemption_keeps_outputs_valid(llm):
    free = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    convs = [user("Tell me about cats."), user("Describe Paris as a JSON object."), user("Count to ten.")]
    alone = texts(llm.chat([convs[0], convs[2]], free, use_tqdm=False))
    params = [free, SamplingParams(temperature=0.8, seed=4, n=2, max_tokens=200,
                                   structured_outputs=StructuredOutputsParams(json=CITY)), free]
    mixed = texts(llm.chat(convs, params, use_tqdm=False))
    assert mixed[0].token_ids == alone[0].token_ids and mixed[3].token_ids == alone[1].token_ids
    for c in mixed[1:3]:
        validate(json.loads(c.text), CITY)
    tight = LLM("smollm2", max_model_len=160, num_kvcache_blocks=10)
    try:
        squeezed = texts(tight.chat(convs, params, use_tqdm=False))
        assert tight.kv_stats().num_preemptions > 0
    finally:
        tight.close()
    # recomputed logits differ from decoded ones in the last bits (1e-5), so a sampled
    # output may take another path after a preemption: it must still validate
    assert squeezed[0].token_ids == mixed[0].token_ids and squeezed[3].token_ids == mixed[3].token_ids
    for c in squeezed[1:3]:
        assert c.finish_reason == "stop", c.text
        validate(json.loads(c.text), CITY)


def test_grammar_with_allowed_token_ids_ands_the_masks(llm):
    tok = llm.get_tokenizer()
    no = tok.encode("no", add_special_tokens=False)
    allowed = no + [2]  # "no" and EOS only: of the choices, just "no" fits
    params = SamplingParams(temperature=1.0, seed=2, n=3, max_tokens=10, allowed_token_ids=allowed,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    assert [c.text for c in texts(llm.chat(user("Yes?"), params, use_tqdm=False))] == ["no"] * 3


def test_grammar_that_cannot_finish_ends_with_length(llm):
    out = texts(llm.chat(user("Write digits."), so(regex=r"[0-9]{50}", max_tokens=5), use_tqdm=False))[0]
    assert out.finish_reason == "length" and re.fullmatch(r"[0-9]+", out.text) and len(out.token_ids) == 5


def test_rollback_and_lazy_advance_give_the_masks_of_a_fresh_matcher(llm):
    engine = llm.llm_engine
    engine.make_request("Name:", so(json=PERSON))  # builds the engine's compiler; not queued
    grammar = engine._grammars.compile(StructuredOutputsParams(json=PERSON))
    prompt = [1, 2, 3]
    out = engine.tokenizer.encode('{"name":"Al', add_special_tokens=False)
    used = engine._grammars.constraint(grammar, None)
    for k in range(len(out) + 1):  # step by step
        used.row(prompt + out[:k], len(prompt))
    short = used.row(prompt + out[:2], len(prompt))  # the output got shorter: rolled back
    fresh = engine._grammars.constraint(grammar, None)
    assert not fresh.matcher.is_error()
    assert short == fresh.row(prompt + out[:2], len(prompt))  # lazily advanced two tokens at once
    assert not fresh.matcher.is_error() and not used.matcher.is_error()  # the text is JSON the grammar writes
    assert short != engine._grammars.constraint(grammar, None).row(prompt, len(prompt))


@pytest.mark.parametrize("spec, words", [
    (dict(json='{"type":'), "json is not valid JSON"),
    (dict(regex="("), "regex is not usable"),
    (dict(grammar="start: foo"), "unknown name"),
    (dict(json={"type": "strin"}), "Invalid type"),
    (dict(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
])
def test_bad_specs_are_value_errors_at_make_request(llm, spec, words):
    before = llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match=re.escape(words)):
        llm.generate("x", so(**spec), use_tqdm=False)
    assert llm.llm_engine.has_unfinished_requests() == before


@pytest.mark.parametrize("kwargs, words", [
    (dict(structured_outputs=dict(json={"type": "object"}, regex="a")), "exactly one of"),
    (dict(structured_outputs=dict()), "exactly one of"),
    (dict(structured_outputs=dict(jsn={})), "no field 'jsn'"),
    (dict(structured_outputs="a|b"), "a dict of its fields"),
    (dict(structured_outputs=dict(choice=[])), "choice is empty"),
    (dict(structured_outputs=dict(regex="a"), guided_decoding=dict(regex="b")), "not both"),
    (dict(structured_outputs=dict(choice=["yes", "no"]), min_tokens=5), "min_tokens cannot be combined"),
])
def test_bad_structured_outputs_fields_are_value_errors(kwargs, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        SamplingParams(**kwargs)


def test_dict_and_guided_decoding_forms_are_the_same_params():
    a = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    b = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["a", "b"]))
    assert a.structured_outputs == b.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    assert a.has_token_mask


def test_batch_cli_request_lines_take_structured_outputs_as_a_dict():
    from nanokv.entrypoints.cli.inputs import _line_params

    params = _line_params({"structured_outputs": {"choice": ["a", "b"]}}, SamplingParams(), None)
    assert params.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    with pytest.raises(ValueError, match="exactly one of"):
        _line_params({"structured_outputs": {"choice": ["a"], "regex": "x"}}, SamplingParams(), None)


def test_batch_cli_lines_take_response_format_and_structured_outputs_like_the_server(llm, tmp_path):
    from nanokv.entrypoints.cli import main

    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    rows = [
        {"id": "schema", "messages": user("Describe a person as JSON."), "response_format": schema_format},
        {"id": "object", "messages": user("Give me a JSON object with the keys a and b."),
         "response_format": {"type": "json_object"}},
        {"id": "choice", "prompt": "Yes or no?", "structured_outputs": {"choice": ["yes", "no"]}},
        {"id": "text", "prompt": "Hello", "response_format": {"type": "text"}, "sampling_params": {"max_tokens": 4}},
        {"id": "two", "prompt": "x", "response_format": {"type": "json_object"},
         "structured_outputs": {"regex": "a+"}},
        {"id": "bad", "prompt": "x", "response_format": {"type": "xml"}},
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["generate", "--model", "smollm2", "--input", str(inp), "--output", str(out), "--max-tokens", "120", "--temperature", "0",
                 "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "1024"]) == 3  # lines failed
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(records) == ["choice", "object", "schema", "text"]
    validate(json.loads(records["schema"]["text"]), PERSON)
    assert records["object"]["finish_reason"] == "stop"
    assert isinstance(json.loads(records["object"]["text"]), dict)
    assert records["choice"]["text"] in ("yes", "no")
    # the same line as LLM.chat with the same constraint: token for token
    chat = llm.chat(user("Describe a person as JSON."), so(max_tokens=120, json=PERSON), use_tqdm=False)
    assert records["schema"]["token_ids"] == chat[0].outputs[0].token_ids
    errors = {r["id"]: r["error"] for r in map(json.loads, (tmp_path / "out.errors.jsonl").read_text().splitlines())}
    assert "one structured-output constraint per line" in errors["two"]
    assert "type text, json_object or json_schema" in errors["bad"]


def test_json_is_compact_unless_whitespace_is_asked_for(llm):
    """Unset disable_any_whitespace: no whitespace between JSON tokens (a sampled model free to
    write it can repeat it until max_tokens); False: JSON's whitespace; a pattern: its own."""
    from nanokv.grammar import GrammarCompiler

    engine = llm.llm_engine
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.config.eos_token_ids)
    tok = engine.tokenizer
    brace, newline, space = (tok.encode(t, add_special_tokens=False) for t in ("{", "\n", " "))
    assert len(brace) == len(newline) == len(space) == 1
    prompt = [1, 2, 3]

    def allowed_after_brace(**ws):
        c = compiler.constraint(compiler.compile(StructuredOutputsParams(json=PERSON, **ws)), None)
        row = c.row(prompt + brace, len(prompt))
        return {t: bool(row[t >> 5] >> (t & 31) & 1) for t in (newline[0], space[0])}

    assert allowed_after_brace() == {newline[0]: False, space[0]: False}
    assert allowed_after_brace(disable_any_whitespace=True) == {newline[0]: False, space[0]: False}
    assert allowed_after_brace(disable_any_whitespace=False) == {newline[0]: True, space[0]: True}
    assert allowed_after_brace(whitespace_pattern=r"[ ]{0,2}") == {newline[0]: False, space[0]: True}


def test_json_schemas_get_bounds_where_they_set_none(llm):
    """A string without maxLength ends by MAX_STRING_CHARS, an object that lists its properties
    takes no others, an integer stays in JSON's safe range: a sampled model cannot write one
    value until max_tokens, and every output is still valid against the request's schema."""
    from nanokv.grammar import MAX_STRING_CHARS, GrammarCompiler

    engine = llm.llm_engine
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.config.eos_token_ids)
    tok = engine.tokenizer
    schema = {"type": "object", "properties": {"s": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["s", "n"]}
    prompt = [1, 2, 3]

    def allowed(text, spec_schema=schema) -> list[str]:
        """The texts of the tokens the grammar allows after text."""
        c = compiler.constraint(compiler.compile(StructuredOutputsParams(json=spec_schema)), None)
        row = c.row(prompt + tok.encode(text, add_special_tokens=False), len(prompt))
        assert not c.matcher.is_error(), text
        return [tok.decode([t]) for t in range(engine.vocab_size) if row[t >> 5] >> (t & 31) & 1]

    full = allowed('{"s":"' + "a" * MAX_STRING_CHARS)
    assert full and all(t.startswith('"') for t in full)  # the string must end
    assert "a" in allowed('{"s":"' + "a" * (MAX_STRING_CHARS - 1))
    long_ok = dict(schema, properties={"s": {"type": "string", "maxLength": 1000}, "n": {"type": "integer"}})
    assert "a" in allowed('{"s":"' + "a" * MAX_STRING_CHARS, long_ok)  # the schema's own bound wins
    assert not any(t[:1].isdigit() for t in allowed('{"s":"x","n":9007199254740991'))  # 2**53 - 1: no digit more
    after = allowed('{"s":"x","n":1')
    assert "}" in after and not any(t.startswith(",") for t in after)  # no third key
