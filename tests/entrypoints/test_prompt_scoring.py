"""Prompt scoring through the server, as lm-eval-harness' log-likelihood tasks send it:
completions with echo, logprobs and max_tokens=0; chat's prompt_logprobs extra."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
import torch

from nanokv import LLM, SamplingParams

from .conftest import API_KEY, serve

MODEL = "tiny"
TEXT = "Beautiful is better than ugly. Explicit is better than implicit."


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    # 16 tokens a step: the prompts are scored over several prefill chunks
    yield from serve(model_dir, "--served-model-name", MODEL, "--api-key", API_KEY, "--max-model-len", "256",
               "--max-num-batched-tokens", "16", log_path=str(tmp_path_factory.mktemp("server") / "log"))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=60, max_retries=0)


def hf_token_logprobs(model_dir, ids: list[int]) -> list[float]:
    """transformers' float32 log-probability of each token after the first."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        lp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_echo_logprobs_max_tokens_0_scores_the_prompt(client, model_dir):
    r = client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=1, max_tokens=0, temperature=0,
                                  extra_body={"return_token_ids": True})
    choice = r.choices[0]
    ids = choice.prompt_token_ids
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
    hf = hf_token_logprobs(model_dir, ids)
    for got, want in zip(lp.token_logprobs[1:], hf):
        assert math.isclose(got, want, abs_tol=1e-3)
    offline = LLM(model_dir, max_model_len=256, kv_cache_memory_bytes=64 << 20).generate(
        TEXT, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert offline.prompt_token_ids == ids
    offline_sum = sum(e[t].logprob for e, t in zip(offline.prompt_logprobs[1:], ids[1:]))
    assert math.isclose(sum(lp.token_logprobs[1:]), offline_sum, abs_tol=1e-3)
    assert math.isclose(sum(lp.token_logprobs[1:]), sum(hf), abs_tol=1e-3)


def test_token_id_prompts_and_generated_logprobs_follow_the_prompts(client, model_dir):
    prompts = [[5, 17, 300, 41, 9, 77, 12, 600, 33, 2, 101, 55, 7, 8, 90, 19, 23, 400], [44, 45]]
    r = client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=2, max_tokens=0)
    for prompt, choice in zip(prompts, r.choices):
        got = choice.logprobs.token_logprobs
        assert len(got) == len(prompt) and got[0] is None
        for g, want in zip(got[1:], hf_token_logprobs(model_dir, prompt)):
            assert math.isclose(g, want, abs_tol=1e-3)
    # with generation: the prompt's entries, then the answer's
    r = client.completions.create(model=MODEL, prompt=prompts[0], echo=True, logprobs=1, max_tokens=3,
                                  temperature=0, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(prompts[0]) + 3 and lp.token_logprobs[0] is None
    assert all(isinstance(v, float) for v in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)


def test_streamed_echo_sends_the_prompt_logprobs_first(client):
    plain = client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=1, max_tokens=2, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=1, max_tokens=2,
                                            temperature=0, stream=True))
    first = chunks[0].choices[0]
    assert first.text == TEXT and first.logprobs.token_logprobs[0] is None
    tokens = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.token_logprobs]
    assert tokens == plain.choices[0].logprobs.token_logprobs
    assert "".join(ch.text for c in chunks for ch in c.choices) == plain.choices[0].text
    scored = list(client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=1, max_tokens=0,
                                            stream=True))
    assert "".join(ch.text for c in scored for ch in c.choices) == TEXT
    assert [ch.finish_reason for c in scored for ch in c.choices if ch.finish_reason] == ["length"]


def test_chat_prompt_logprobs_at_the_top_level(server, model_dir):
    body = {"model": MODEL, "messages": [{"role": "user", "content": TEXT}], "max_tokens": 2,
            "prompt_logprobs": 2, "return_token_ids": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}"}).json()
    ids, scored = r["prompt_token_ids"], r["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for entry, token, want in zip(scored[1:], ids[1:], hf_token_logprobs(model_dir, ids)):
        assert 1 <= len(entry) <= 3 and math.isclose(entry[str(token)]["logprob"], want, abs_tol=1e-3)
        assert {v["rank"] for t, v in entry.items() if t != str(token)} <= {1, 2}


@pytest.mark.parametrize("body, param, match", [
    ({"prompt": TEXT, "echo": True, "logprobs": 30, "max_tokens": 0}, "logprobs", "logprobs=30 is more than"),
    ({"prompt": TEXT, "prompt_logprobs": 21}, "prompt_logprobs", "prompt_logprobs=21 is more than"),
    ({"prompt": TEXT, "max_tokens": 0}, "max_tokens", "max_tokens must be"),
    ({"prompt": TEXT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "not available with stream"),
])
def test_bad_scoring_requests_are_400(server, body, param, match):
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, **body}, timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and match in error["message"], error


def test_streamed_chat_with_prompt_logprobs_is_400(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": TEXT}], "prompt_logprobs": 0, "stream": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
