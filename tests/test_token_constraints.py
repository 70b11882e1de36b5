"""Token constraints through LLM.generate: allowed_token_ids, bad_words (vLLM's rule) and
logit_bias, against transformers' logits on the tiny checkpoint; unconstrained neighbours
unchanged token for token; n > 1, seeds and preemption; bad values refused by name."""

from __future__ import annotations

import pytest
import torch

from nanokv import LLM, SamplingParams
from nanokv.constraints import TokenConstraint, bad_words_token_ids

from .conftest import random_prompts

POOL = dict(max_model_len=512, kv_cache_memory_bytes=64 << 20)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, **POOL)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def ids(outs):
    return [list(c.token_ids) for o in outs for c in o.outputs]


def greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@torch.inference_mode()
def hf_logits(hf, prompt, output):
    """transformers' next-token logits after prompt + each prefix of output: [len(output), V]."""
    return hf(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].float()


def test_allowed_token_ids_greedy_is_argmax_over_the_allowed_subset(llm, hf):
    prompts = random_prompts([9, 17, 5], 1024, seed=3)
    allowed = [7, 99, 300, 301, 512, 1000]
    plain = ids(llm.generate(prompts, greedy(), use_tqdm=False))
    # constrained rows batched with unconstrained neighbours, which must not move
    mixed = ids(llm.generate(prompts, [greedy(allowed_token_ids=allowed), greedy(), greedy(allowed_token_ids=allowed)],
                             use_tqdm=False))
    assert mixed[1] == plain[1]
    for prompt, out in zip([prompts[0], prompts[2]], [mixed[0], mixed[2]]):
        assert set(out) <= set(allowed)
        ref = hf_logits(hf, prompt, out)[:, allowed].argmax(dim=1)
        assert out == [allowed[i] for i in ref.tolist()]


def test_allowed_token_ids_sampled_n_and_seeds_under_preemption(model_dir, llm):
    prompts = random_prompts([30, 22, 41], 1024, seed=8)
    allowed = list(range(200, 260))
    params = [SamplingParams(temperature=1.2, seed=5, n=3, max_tokens=40, ignore_eos=True, allowed_token_ids=allowed),
              SamplingParams(temperature=0.9, top_p=0.9, seed=9, max_tokens=40, ignore_eos=True),
              greedy(40, allowed_token_ids=allowed[::7])]
    roomy = ids(llm.generate(prompts, params, use_tqdm=False))
    assert all(set(o) <= set(allowed) for o in roomy[:3] + roomy[4:])
    assert len({tuple(o) for o in roomy[:3]}) == 3  # each sample its own draw
    tight = LLM(model_dir, max_model_len=128, num_kvcache_blocks=12)
    assert ids(tight.generate(prompts, params, use_tqdm=False)) == roomy
    assert tight.kv_stats().num_preemptions > 0
    # a prefix hit (the same prompt again) changes nothing either
    assert ids(llm.generate(prompts, params, use_tqdm=False)) == roomy
    # nor prompts prefilled in chunks of 8 tokens beside decoding rows (masks only on sampled rows)
    chunked = LLM(model_dir, max_num_batched_tokens=8, **POOL)
    assert ids(chunked.generate(prompts, params, use_tqdm=False)) == roomy


def test_logit_bias_forces_and_bans_under_greedy(llm, hf):
    prompt = random_prompts([12], 1024, seed=21)[0]
    plain = ids(llm.generate(prompt, greedy(), use_tqdm=False))[0]
    forced = ids(llm.generate(prompt, greedy(logit_bias={"77": 100}), use_tqdm=False))[0]
    assert forced == [77] * 12
    banned = ids(llm.generate(prompt, greedy(logit_bias={plain[0]: -100}), use_tqdm=False))[0]
    assert plain[0] not in banned and banned[0] != plain[0]
    # a small bias: the argmax of transformers' logits plus that bias, step by step
    bias = {plain[0]: -0.5, 5: 2.0, 600: 1.0}
    out = ids(llm.generate(prompt, greedy(logit_bias=bias), use_tqdm=False))[0]
    ref = hf_logits(hf, prompt, out).clone()  # a normal tensor: written below
    for tid, b in bias.items():
        ref[:, tid] += b
    assert out == ref.argmax(dim=1).tolist()


def test_bad_words_never_appear(llm):
    tok = llm.get_tokenizer()
    prompts = random_prompts([10, 14, 7, 20], 1024, seed=33)
    plain = ids(llm.generate(prompts, greedy(24), use_tqdm=False))
    # a one-token word and a two-token word the unconstrained run generates
    single = multi = None
    for out in plain:
        for a, b in zip(out, out[1:]):
            word = tok.decode([a, b])
            if multi is None and bad_words_token_ids([word], tok)[0] == [a, b]:
                multi = (word, [a, b])
        for a in out:
            word = tok.decode([a])
            if single is None and word.strip() and bad_words_token_ids([word], tok)[0] == [a]:
                single = (word, a)
    assert single and multi
    for words in ([single[0]], [multi[0]], [single[0], multi[0]]):
        got = ids(llm.generate(prompts, greedy(24, bad_words=words), use_tqdm=False))
        assert got != plain
        for out in got:
            if single[0] in words:
                assert single[1] not in out
            if multi[0] in words:
                assert all([a, b] != multi[1] for a, b in zip(out, out[1:]))
    # the word's first token alone is still allowed: only the pair is banned
    firsts = ids(llm.generate(prompts, greedy(24, bad_words=[multi[0]]), use_tqdm=False))
    assert any(multi[1][0] in out for out in firsts)


def test_constraint_row_follows_vllms_bad_words_rule():
    c = TokenConstraint(70, allowed=None, bad_ids=[[5], [1, 2, 9], [3, 64]])
    def banned(tokens, num_prompt):
        row = c.row(tokens, num_prompt)
        return [t for t in range(70) if not row[t // 32] >> (t % 32) & 1]
    assert banned([1, 2], 0) == [5, 9]
    assert banned([1, 2], 1) == [5]  # the prefix must be generated tokens, not the prompt
    assert banned([7, 3], 1) == [5, 64]
    assert banned([], 0) == [5]
    a = TokenConstraint(70, allowed=[0, 31, 32, 69], bad_ids=[[31]])
    assert [t for t in range(96) if a.row([], 0)[t // 32] >> (t % 32) & 1] == [0, 32, 69]


@pytest.mark.parametrize("kwargs, match", [
    (dict(allowed_token_ids=[]), "allowed_token_ids is empty"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
    (dict(allowed_token_ids="5"), "allowed_token_ids"),
    (dict(logit_bias={5: 101}), r"logit_bias\[5\] must be in \[-100, 100\]"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"),
    (dict(logit_bias={"x": 1}), "logit_bias keys must be token ids"),
    (dict(logit_bias=[1, 2]), "logit_bias must be an object"),
    (dict(logit_bias={i: 1 for i in range(1025)}), "at most 1024"),
    (dict(bad_words=[""]), "bad_words"),
    (dict(bad_words=["x"] * 257), "at most 256"),
])
def test_bad_values_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(allowed_token_ids=[5, 4096]), "allowed_token_ids has token ids \\[4096\\] outside the vocabulary"),
    (dict(logit_bias={4096: 1.0}), "logit_bias has token ids \\[4096\\] outside the vocabulary"),
])
def test_ids_outside_the_vocabulary_are_refused_by_name(llm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([5, 6], SamplingParams(**kwargs), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_logprobs_are_those_of_the_masked_distribution(llm, hf):
    """The mask comes before logprobs: each token's logprob is transformers' log-softmax over
    the allowed tokens alone, and a banned token among the top N is -inf."""
    prompt = random_prompts([11], 1024, seed=44)[0]
    allowed = [3, 50, 700]
    out = llm.generate(prompt, greedy(6, allowed_token_ids=allowed, logprobs=4), use_tqdm=False)[0].outputs[0]
    ref = torch.log_softmax(hf_logits(hf, prompt, list(out.token_ids))[:, allowed], dim=1)
    for pos, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert entry[token].logprob == pytest.approx(ref[pos, allowed.index(token)].item(), abs=1e-4)
        assert entry[token].rank == 1
        assert sorted(t for t, lp in entry.items() if lp.logprob > float("-inf")) == allowed
