"""Structured outputs on `nanokv serve smollm2` with the official openai client:
response_format json_schema / json_object / text, vLLM's structured_outputs and guided_*
extras; answers equal LLM.chat with the same StructuredOutputsParams; bad specs are 400s
naming the field."""

from __future__ import annotations

import json
import re

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from nanokv import LLM, SamplingParams  # noqa: E402
from nanokv.sampling_params import StructuredOutputsParams  # noqa: E402

from ..test_structured_outputs import PERSON  # noqa: E402
from .conftest import API_KEY, serve  # noqa: E402


pytestmark = pytest.mark.slow

MAX_LEN = 1024
SCHEMA = PERSON  # the offline tests' schema: the server must answer as LLM.chat does
USER = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    yield from serve("smollm2", "--api-key", API_KEY, "--max-model-len", str(MAX_LEN),
               "--kv-cache-memory-bytes", str(64 << 20), log_path=str(tmp_path_factory.mktemp("server") / "log"))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM("smollm2", max_model_len=MAX_LEN, kv_cache_memory_bytes=64 << 20)


def chat(client, **kw):
    return client.chat.completions.create(model="smollm2", messages=USER, temperature=0, max_tokens=120, **kw)


def test_response_format_and_extras_equal_llm_chat(client, llm):
    cases = [
        (dict(response_format={"type": "json_schema",
                               "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}),
         StructuredOutputsParams(json=SCHEMA)),
        (dict(response_format={"type": "json_object"}), StructuredOutputsParams(json_object=True)),
        (dict(extra_body={"guided_choice": ["red", "blue"]}), StructuredOutputsParams(choice=["red", "blue"])),
        (dict(extra_body={"guided_regex": r"\d{3}-[a-z]{2,6}"}), StructuredOutputsParams(regex=r"\d{3}-[a-z]{2,6}")),
        (dict(extra_body={"structured_outputs": {"json": SCHEMA}, "guided_decoding_backend": "guidance"}),
         StructuredOutputsParams(json=SCHEMA)),
        (dict(extra_body={"guided_json": json.dumps(SCHEMA)}), StructuredOutputsParams(json=json.dumps(SCHEMA))),
    ]
    for kw, spec in cases:
        got = chat(client, **kw).choices[0]
        want = llm.chat(USER, SamplingParams(temperature=0, max_tokens=120, structured_outputs=spec),
                        use_tqdm=False)[0].outputs[0]
        assert got.message.content == want.text, kw
        assert got.finish_reason == want.finish_reason
    person = json.loads(chat(client, response_format={"type": "json_schema", "json_schema": {
        "name": "person", "schema": SCHEMA}}).choices[0].message.content)
    assert set(person) == {"name", "age", "color"} and person["color"] in ("red", "green", "blue")
    assert chat(client, extra_body={"guided_choice": ["red", "blue"]}).choices[0].message.content in ("red", "blue")
    assert re.fullmatch(r"\d{3}-[a-z]{2,6}", chat(client, extra_body={"guided_regex": r"\d{3}-[a-z]{2,6}"})
                        .choices[0].message.content)
    # text is no constraint; completions take the same fields
    plain = chat(client, response_format={"type": "text"}).choices[0].message.content
    assert plain == llm.chat(USER, SamplingParams(temperature=0, max_tokens=120), use_tqdm=False)[0].outputs[0].text
    done = client.completions.create(model="smollm2", prompt="Answer:", max_tokens=8, temperature=0,
                                     extra_body={"guided_choice": ["yes", "no"]})
    assert done.choices[0].text in ("yes", "no")


@pytest.mark.parametrize("kw, param, words", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format", "schema"),
    (dict(response_format={"type": "xml"}), "response_format", "json_schema"),
    (dict(extra_body={"guided_regex": "("}), None, "unclosed group"),
    (dict(extra_body={"guided_json": {"type": "strin"}}), None, "Invalid type"),
    (dict(extra_body={"guided_grammar": "start: foo"}), None, "unknown name"),
    (dict(extra_body={"guided_choice": []}), "guided_choice", "empty"),
    (dict(extra_body={"guided_regex": "a", "guided_choice": ["a"]}), "guided_choice", "one structured-output"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}), "guided_regex",
     "one structured-output"),
    (dict(extra_body={"structured_outputs": {"jsn": {}}}), "structured_outputs", "no field 'jsn'"),
    (dict(extra_body={"guided_regex": "a", "guided_decoding_backend": "xgrammar"}), "guided_decoding_backend",
     "llguidance"),
])
def test_bad_specs_are_400_naming_the_field(client, kw, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, **kw)
    error = e.value.body
    assert words in error["message"], error
    if param is not None:
        assert error["param"] == param, error
