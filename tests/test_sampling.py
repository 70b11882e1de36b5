"""Sampling and output features: top-k/top-p/min-p, seeds, penalties, stop strings,
logprobs, n > 1, chat, streaming."""

from __future__ import annotations

import math

import pytest
import torch

from nanokv import LLM, SamplingParams
from nanokv.layers.sampler import Sampler, SamplingTensors

from .conftest import random_prompts


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


PROMPTS = random_prompts([7, 30, 2, 55], 1024, seed=31)


def test_top_k_1_and_tiny_top_p_equal_greedy(llm):
    greedy = tokens(llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False))
    for params in (SamplingParams(temperature=1.3, top_k=1, max_tokens=16),
                   SamplingParams(temperature=0.7, top_p=1e-6, max_tokens=16)):
        assert tokens(llm.generate(PROMPTS, params, use_tqdm=False)) == greedy


def test_seeded_request_is_independent_of_batch_and_preemption(model_dir, llm):
    target = random_prompts([25], 1024, seed=40)[0]
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=40, ignore_eos=True)
    alone = tokens(llm.generate([target], seeded, use_tqdm=False))[0]
    assert alone == tokens(llm.generate([target], seeded, use_tqdm=False))[0]

    others = random_prompts([3 + 7 * i for i in range(15)], 1024, seed=41)
    prompts = others[:7] + [target] + others[7:]
    params = [SamplingParams(temperature=[0, 1.0, 0.5][i % 3], seed=None if i % 2 else i, max_tokens=10 + i,
                             top_k=[-1, 5][i % 2]) for i in range(15)]
    params = params[:7] + [seeded] + params[7:]
    mixed = tokens(llm.generate(prompts, params, use_tqdm=False))
    assert mixed[7] == alone

    tight = LLM(model_dir, max_model_len=128, num_kvcache_blocks=10)
    pressured = tight.generate(prompts, params, use_tqdm=False)
    assert tight.kv_stats().num_preemptions > 0
    assert tokens(pressured)[7] == alone
    different = SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=40, ignore_eos=True)
    assert tokens(llm.generate([target], different, use_tqdm=False))[0] != alone


def expected_distribution(logits, temperature, top_k, top_p, min_p):
    """vLLM's order: top-k, then top-p over the renormalised top-k set, then min-p."""
    probs = torch.softmax(logits / temperature, dim=-1)
    order = probs.argsort(descending=True).tolist()
    if top_k > 0:
        probs[order[top_k:]] = 0
        probs /= probs.sum()
    if top_p < 1:
        mass = 0.0
        for i in order:
            if mass >= top_p:
                probs[i] = 0
            mass += probs[i].item()
        probs /= probs.sum()
    probs[probs < min_p * probs.max()] = 0
    return probs / probs.sum()


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, -1, 1.0, 0.0), (0.5, -1, 1.0, 0.0), (1.5, 3, 1.0, 0.0), (1.0, -1, 0.7, 0.0),
    (1.0, -1, 1.0, 0.2), (0.8, 4, 0.8, 0.05),
])
def test_sample_distribution_matches_masked_softmax(temperature, top_k, top_p, min_p):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.3, 0.0, -0.5, -1.0])
    n, vocab = 4000, logits.numel()

    def full(v, dtype=torch.float32):
        return torch.full((n,), v, dtype=dtype)

    t = SamplingTensors(full(temperature), all_greedy=False,
                        top_k=full(top_k if top_k > 0 else vocab, torch.long) if top_k > 0 else None,
                        top_p=full(top_p) if top_p < 1 else None,
                        min_p=full(min_p) if min_p > 0 else None)
    gen = torch.Generator().manual_seed(0)
    drawn = Sampler()(logits.repeat(n, 1), t, gen).tokens
    empirical = torch.bincount(drawn, minlength=vocab).float() / n
    expected = expected_distribution(logits, temperature, top_k, top_p, min_p)
    assert (empirical[expected == 0] == 0).all()
    assert 0.5 * (empirical - expected).abs().sum() < 0.04  # total variation


def reference_penalties(logits, prompt, output, rep, pres, freq):
    logits = logits.clone()
    for tok in set(prompt) | set(output):
        logits[tok] = logits[tok] / rep if logits[tok] > 0 else logits[tok] * rep
    for tok in set(output):
        logits[tok] -= freq * output.count(tok) + pres
    return logits


def test_penalties_equal_a_straightforward_reference(llm):
    vocab = 1024
    runner = llm.llm_engine.runner
    from nanokv.engine.types import ScheduledSeq

    g = torch.Generator().manual_seed(3)
    rows, refs = [], []
    logits = torch.randn(3, vocab, generator=g) * 3
    cases = [(1.3, 0.5, 0.2), (1.0, 0.0, 0.0), (0.8, -0.4, 1.1)]
    for i, (rep, pres, freq) in enumerate(cases):
        prompt = torch.randint(0, vocab, (20,), generator=g).tolist()
        output = torch.randint(0, 50, (30,), generator=g).tolist()
        params = SamplingParams(temperature=0, repetition_penalty=rep, presence_penalty=pres,
                                frequency_penalty=freq, logprobs=vocab)
        rows.append(ScheduledSeq(i, [output[-1]], 49, [], True, params, num_generated=30,
                                 all_token_ids=prompt + output, num_prompt_tokens=20))
        refs.append(reference_penalties(logits[i], prompt, output, rep, pres, freq))
    out = Sampler()(logits.clone(), runner._sampling_tensors(rows, vocab))
    expected = torch.stack(refs)
    assert out.tokens.tolist() == expected.argmax(-1).tolist()
    got = torch.full_like(expected, float("nan")).scatter_(1, out.top_ids, out.top_logprobs)
    torch.testing.assert_close(got, torch.log_softmax(expected, -1), rtol=1e-5, atol=1e-5)


def test_logprobs_equal_hf_log_softmax(model_dir, llm):
    from transformers import AutoModelForCausalLM

    prompt = random_prompts([12], 1024, seed=50)[0]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert len(out.logprobs) == 6
    total = 0.0
    for pos, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        top = ref[pos].topk(3)
        assert list(entry)[:3] == top.indices.tolist()
        for tid, lp in entry.items():
            assert math.isclose(lp.logprob, ref[pos, tid].item(), abs_tol=1e-4)
        assert entry[token].rank == 1 and entry[token].decoded_token is not None
        total += entry[token].logprob
    assert math.isclose(out.cumulative_logprob, total, abs_tol=1e-4)


def test_stop_string_across_a_token_boundary(llm):
    tok = llm.get_tokenizer()
    prompt = "Readability counts."
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    # a stop string made of the end of one token and the start of the next
    pieces = [tok.decode(base.token_ids[:i], skip_special_tokens=True) for i in range(len(base.token_ids) + 1)]
    added = [pieces[j + 1][len(pieces[j]):] for j in range(len(base.token_ids))]
    candidates = [(len(pieces[j + 1]) - 2, added[j][-2:] + added[j + 1][:2])
                  for j in range(len(added) - 1) if len(added[j]) >= 2 and len(added[j + 1]) >= 2]
    cut, stop = next((c, st) for c, st in candidates if base.text.find(st) == c)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop, "never-there"])
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[:cut]
    assert out.token_ids == base.token_ids[:len(out.token_ids)] and len(out.token_ids) < 30
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=stop,
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == base.text[:cut + len(stop)]
    streamed = "".join(llm.stream(prompt, params))
    assert streamed == out.text


def test_stop_token_ids_and_min_tokens(llm):
    prompt = random_prompts([9], 1024, seed=60)[0]
    base = tokens(llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                               use_tqdm=False))[0]
    stop_id = base[4]
    first = base.index(stop_id)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id
    late = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, min_tokens=first + 2,
                                               stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert stop_id not in late.token_ids[:first + 2]
    assert len(late.token_ids) >= first + 2


def test_n_samples_share_the_prompt_blocks(model_dir):
    llm = LLM(model_dir, kvcache_block_size=16)
    prompt = random_prompts([40], 1024, seed=70)[0]
    out = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, max_tokens=12, ignore_eos=True, seed=5),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 12 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # independent samples
    kv = llm.kv_stats()
    assert kv.prefix_hit_tokens == 3 * 32  # two full blocks computed once, hit three times
    again = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, max_tokens=12, ignore_eos=True, seed=5),
                         use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    greedy = llm.generate(prompt, SamplingParams(n=2, temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_chat_uses_the_chat_template(llm):
    tok = llm.get_tokenizer()
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why paging?"}]
    expected = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False)
    outs = llm.chat(conv, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert outs[0].prompt_token_ids == list(expected)
    many = llm.chat([conv, conv[1:]], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert len(many) == 2 and many[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_skip_special_tokens(llm):
    tok = llm.get_tokenizer()
    special = tok.convert_tokens_to_ids("<|im_end|>")
    params = SamplingParams(temperature=0, max_tokens=3, skip_special_tokens=False, stop_token_ids=[])
    out = llm.generate([special, special, 40], params, use_tqdm=False)[0].outputs[0]
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=False)


@pytest.mark.parametrize("kwargs", [
    dict(n=0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=2.0), dict(seed=1.5),
    dict(min_tokens=5, max_tokens=3), dict(stop=[""]), dict(stop=[3]), dict(logprobs=-1),
    dict(repetition_penalty=0.0), dict(presence_penalty=3.0), dict(frequency_penalty=-2.5),
])
def test_bad_sampling_values(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
