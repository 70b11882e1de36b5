"""Random workloads through a real tiny model: tiny pools, any block size, small token
budgets, shared prefixes and aborts; greedy outputs equal the unconstrained run's."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanokv import LLM, SamplingParams

from .conftest import random_prompts

MAX_LEN = 96


@pytest.fixture(scope="module")
def setup(checkpoint):
    model_dir = checkpoint("llama3-tiny")
    return model_dir, LLM(model_dir, max_model_len=MAX_LEN)


@st.composite
def workloads(draw):
    prefix = random_prompts([draw(st.integers(1, 40))], 1024, seed=draw(st.integers(0, 9)))[0]
    requests = []
    for i in range(draw(st.integers(1, 6))):
        own = random_prompts([draw(st.integers(1, 30))], 1024, seed=100 + i)[0]
        prompt = ((prefix if draw(st.booleans()) else []) + own)[:MAX_LEN - 1]
        requests.append((prompt, draw(st.integers(1, 24)), draw(st.one_of(st.none(), st.integers(0, 15)))))
    block_size = draw(st.integers(1, 16))
    min_blocks = -(-MAX_LEN // block_size)
    return dict(block_size=block_size, num_blocks=draw(st.integers(min_blocks, 2 * min_blocks)),
                budget=draw(st.integers(4, 128)), max_num_seqs=draw(st.integers(1, 6)),
                requests=requests)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(w=workloads())
def test_random_workloads_on_a_real_model(setup, w):
    model_dir, reference = setup
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m, _ in w["requests"]]
    prompts = [p for p, _, _ in w["requests"]]
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]

    llm = LLM(model_dir, max_model_len=MAX_LEN, kvcache_block_size=w["block_size"],
              num_kvcache_blocks=w["num_blocks"], max_num_batched_tokens=w["budget"],
              max_num_seqs=w["max_num_seqs"])
    engine = llm.llm_engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    results, step = {}, 0
    while engine.has_unfinished():
        for i, (_, _, abort_at) in enumerate(w["requests"]):
            if abort_at == step:
                engine.abort(ids[i])
        for out in engine.step():
            results[out.request_id] = out.outputs[0].token_ids
        step += 1
    kv = engine.kv_stats()
    assert kv.used_blocks == 0 and kv.free_blocks == kv.num_blocks
    for i, (_, _, abort_at) in enumerate(w["requests"]):
        if ids[i] in results:
            assert results[ids[i]] == expected[i], f"request {i}"
        else:
            assert abort_at is not None
