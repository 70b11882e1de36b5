"""LLMEngine step API, streaming, abort, KV statistics and shared-prefix dedup on a real
tiny model."""

from __future__ import annotations

import logging

from nanokv import LLM, SamplingParams

from .conftest import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def check_stats(engine):
    kv = engine.kv_stats()
    bm, bs, running = engine.block_manager, engine.block_manager.block_size, engine.scheduler.running
    assert kv.free_blocks == sum(1 for b in bm.blocks if b.ref_count == 0)
    assert kv.used_blocks == sum(1 for b in bm.blocks if b.ref_count > 0)
    # every used block belongs to a running table (nothing leaked), and the stored tokens
    # are the distinct slots those tables fill
    assert {b for s in running for b in s.block_table} == {b.block_id for b in bm.blocks if b.ref_count > 0}
    slots = {(s.block_table[p // bs], p % bs) for s in running for p in range(s.num_computed_tokens)}
    assert kv.stored_tokens == len(slots)
    assert 0 <= kv.prefix_hit_tokens <= kv.prefix_query_tokens
    running = len(engine.scheduler.running)
    assert 0 <= kv.fragmentation_tokens < max(running, 1) * kv.block_size
    assert kv.peak_used_blocks >= kv.used_blocks
    return kv


def test_shared_prefix_submitted_together_is_computed_once(model_dir):
    prefix = random_prompts([512], 1024, seed=21)[0]
    suffixes = random_prompts([3, 8, 1, 15, 20, 5, 11, 2], 1024, seed=22)
    prompts = [prefix + s for s in suffixes]
    llm = LLM(model_dir, kvcache_block_size=16)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    kv = llm.kv_stats()
    assert kv.prefix_query_tokens == sum(len(p) for p in prompts)
    assert kv.prefix_hit_tokens == 7 * 512  # the prefix was computed by one request only
    plain = LLM(model_dir, kvcache_block_size=16, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in outs] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    off = plain.kv_stats()
    assert off.prefix_query_tokens == off.prefix_hit_tokens == 0
    assert plain.llm_engine.block_manager.cached == {}


def test_stats_add_up_after_every_step_and_nothing_leaks(model_dir):
    llm = LLM(model_dir, max_model_len=192, num_kvcache_blocks=24, kvcache_block_size=8,
              max_num_batched_tokens=48)
    engine = llm.llm_engine
    shared = random_prompts([40], 1024, seed=1)[0]
    prompts = [shared + p for p in random_prompts([5, 30, 1, 60, 12, 25, 9, 44], 1024, seed=2)]
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=20 + i, ignore_eos=True))
    finished = 0
    while engine.has_unfinished():
        finished += len(engine.step())
        check_stats(engine)
    kv = check_stats(engine)
    assert finished == len(prompts)
    assert kv.used_blocks == 0 and kv.free_blocks == kv.num_blocks
    assert kv.num_preemptions > 0 and kv.prefix_hit_tokens > 0
    assert kv.peak_used_blocks <= kv.num_blocks


def test_generate_logs_stats_and_bar_shows_kv(model_dir, caplog, capsys):
    llm = LLM(model_dir, disable_log_stats=False)  # LLM's default, as vLLM's, is True
    with caplog.at_level(logging.INFO, logger="nanokv"):
        llm.generate(random_prompts([20, 30], 1024), GREEDY, use_tqdm=True)
    assert any("prefix cache hit" in r.getMessage() for r in caplog.records)
    assert "KV " in capsys.readouterr().err


def test_step_api_and_abort_frees_blocks_at_once(model_dir):
    llm = LLM(model_dir)
    engine = llm.llm_engine
    keep = engine.add_request(random_prompts([30], 1024, seed=3)[0], GREEDY)
    drop = engine.add_request(random_prompts([100], 1024, seed=4)[0],
                              SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    engine.step()
    used = engine.kv_stats().used_blocks
    engine.abort(drop)
    assert engine.kv_stats().used_blocks == used - 7  # 101 tokens in blocks of 16
    engine.abort("no-such-request")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.request_id for o in outs] == [keep] and outs[0].finished
    alone = llm.generate(random_prompts([30], 1024, seed=3), GREEDY, use_tqdm=False)[0]
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids


def test_streaming_deltas_add_up_to_the_final_output(model_dir):
    llm = LLM(model_dir)
    prompt = "Simple is better than complex."
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    pieces = list(llm.stream(prompt, params))
    assert len(pieces) > 1 and "".join(pieces) == full.text

    engine = llm.llm_engine
    rid = engine.add_request(prompt, params, stream=True)
    other = engine.add_request(prompt, params)
    token_ids, finals = [], []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                token_ids += out.outputs[0].token_ids
                assert out.prompt == prompt
            else:
                finals.append(out)
    assert token_ids == full.token_ids
    assert [o.request_id for o in finals] == [other] and finals[0].outputs[0].token_ids == full.token_ids


def test_stream_stopped_early_aborts_the_request(model_dir):
    llm = LLM(model_dir)
    gen = llm.stream("Flat is better than nested.", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    next(gen)
    gen.close()
    assert not llm.llm_engine.has_unfinished()
    assert llm.kv_stats().used_blocks == 0
