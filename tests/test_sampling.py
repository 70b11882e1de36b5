"""Sampling and output features: top-k/top-p/min-p, seeds, penalties, stop strings,
logprobs, n > 1, chat, streaming."""

from __future__ import annotations

import math
import random

import pytest
import torch

from nanokv import LLM, SamplingParams, kernels
from nanokv.layers.sampler import CANDIDATES, Sampler, SamplingTensors, greedy_tokens

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


# the sampler's two paths on the CPU: torch, and the C kernels where they build
PATHS = [pytest.param(False, id="torch"),
         pytest.param(True, id="c", marks=pytest.mark.skipif(not kernels.available(), reason="no CPU kernels"))]


@pytest.mark.parametrize("cpu_kernels", PATHS)
@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, -1, 1.0, 0.0), (0.5, -1, 1.0, 0.0), (1.5, 3, 1.0, 0.0), (1.0, -1, 0.7, 0.0),
    (1.0, -1, 1.0, 0.2), (0.8, 4, 0.8, 0.05),
])
def test_sample_distribution_matches_masked_softmax(temperature, top_k, top_p, min_p, cpu_kernels):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.3, 0.0, -0.5, -1.0])
    n, vocab = 4000, logits.numel()

    def full(v, dtype=torch.float32):
        return torch.full((n,), v, dtype=dtype)

    t = SamplingTensors(full(temperature), all_greedy=False,
                        top_k=full(top_k if top_k > 0 else vocab, torch.long) if top_k > 0 else None,
                        top_p=full(top_p) if top_p < 1 else None,
                        min_p=full(min_p) if min_p > 0 else None)
    gen = torch.Generator().manual_seed(0)
    drawn = Sampler(cpu_kernels)(logits.repeat(n, 1), t, gen).tokens
    empirical = torch.bincount(drawn, minlength=vocab).float() / n
    expected = expected_distribution(logits, temperature, top_k, top_p, min_p)
    assert (empirical[expected == 0] == 0).all()
    assert 0.5 * (empirical - expected).abs().sum() < 0.04  # total variation


def flat_logits(vocab, seed=0):
    """Distinct, evenly spread logits: at temperature 1 the nucleus of top_p 0.9 holds
    more than a third of the tokens, far more than the sampler's CANDIDATES."""
    g = torch.Generator().manual_seed(seed)
    return torch.linspace(3, -3, vocab)[torch.randperm(vocab, generator=g)]


@pytest.mark.parametrize("cpu_kernels", PATHS)
@pytest.mark.parametrize("temperature, top_p, min_p", [
    (1.0, 1.0, 0.0), (1.0, 0.9, 0.0), (0.7, 0.95, 0.0), (1.0, 1.0, 0.01), (1.0, 0.8, 0.05),
])
def test_kept_sets_larger_than_the_candidates_match_a_full_sort(temperature, top_p, min_p, cpu_kernels):
    """Rows whose kept set reaches past the candidates go on drawing among the other tokens
    (and reject what top-p / min-p drop): the distribution is still the full-sort one."""
    vocab, n = 300, 40000
    logits = flat_logits(vocab)
    expected = expected_distribution(logits, temperature, -1, top_p, min_p)
    assert (expected > 0).sum() > CANDIDATES
    t = SamplingTensors(torch.full((n,), temperature), all_greedy=False,
                        top_p=torch.full((n,), top_p) if top_p < 1 else None,
                        min_p=torch.full((n,), min_p) if min_p > 0 else None)
    drawn = Sampler(cpu_kernels)(logits.repeat(n, 1), t, torch.Generator().manual_seed(1)).tokens
    empirical = torch.bincount(drawn, minlength=vocab).float() / n
    assert (empirical[expected == 0] == 0).all()
    by_rank = expected.argsort(descending=True).view(30, 10)  # 30 groups of 10 tokens by probability
    assert 0.5 * (empirical[by_rank].sum(1) - expected[by_rank].sum(1)).abs().sum() < 0.02


def row_logits(vocab, kind, g):
    """One row of each shape the sampler treats differently: peaked (the nucleus inside
    the candidates), flat (draws past them), and a long tail with a few clear leaders."""
    if kind == "peaked":
        return torch.randn(vocab, generator=g) * 4
    if kind == "flat":
        return torch.randn(vocab, generator=g)
    x = torch.randn(vocab, generator=g)
    x[torch.randint(0, vocab, (5,), generator=g)] += 4
    return x


def test_seeded_rows_draw_the_same_token_in_any_batch(llm, monkeypatch):
    """A seeded row's token depends on its logits, settings, seed and token index only:
    alone, or among greedy, unseeded, large-top_k and logprobs rows, at another position,
    split across other CPU chunks."""
    from nanokv.engine.types import ScheduledSeq
    from nanokv.layers import sampler as sampler_module

    runner, vocab = llm.llm_engine.runner, 5000
    g = torch.Generator().manual_seed(7)
    settings = [dict(temperature=0.9, top_p=0.95), dict(temperature=1.0), dict(temperature=0.8, min_p=0.02),
                dict(temperature=1.2, top_k=20, top_p=0.9), dict(temperature=0.6, top_p=0.5, min_p=0.1)]
    targets = [(row_logits(vocab, kind, g), ScheduledSeq(100 + j, [1], 0, [], True,
                                                         SamplingParams(**settings[j % 5], seed=1000 + j),
                                                         seed=1000 + j, num_generated=j % 4))
               for j, kind in enumerate(["peaked", "flat", "leaders"] * 10)]
    others = [(row_logits(vocab, ["peaked", "flat", "leaders"][j % 3], g),
               ScheduledSeq(900 + j, [1], 0, [], True, params))
              for j, params in enumerate([SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=400),
                                          SamplingParams(temperature=0.7, logprobs=3), SamplingParams(top_p=0.9)] * 4)]

    def draw(pairs):
        logits = torch.stack([x for x, _ in pairs])
        rows = [s for _, s in pairs]
        return runner.sampler(logits, runner._sampling_tensors(rows, vocab), runner.generator).tokens.tolist()

    alone = [draw([pair])[0] for pair in targets]
    assert alone == [draw([pair])[0] for pair in targets]
    assert len(set(alone)) > 20
    monkeypatch.setattr(sampler_module, "_CHUNK_BYTES", 3 * 4 * vocab)  # chunks of 3 rows
    mixed = targets[::-1] + others
    random.Random(3).shuffle(mixed)
    got = dict(zip([s.seq_id for _, s in mixed], draw(mixed)))
    assert [got[s.seq_id] for _, s in targets] == alone
    later = [(x, ScheduledSeq(s.seq_id, [1], 0, [], True, s.params, seed=s.seed, num_generated=s.num_generated + 1))
             for x, s in targets]
    assert [draw([pair])[0] for pair in later] != alone  # the next token index draws anew


def test_min_tokens_bans_stop_tokens_in_every_sampling_path(llm):
    """A stop token that dominates the logits is never drawn before min_tokens, whether the
    row is greedy, drawn among the candidates or past them; afterwards it is drawn."""
    from nanokv.engine.types import ScheduledSeq

    runner, vocab, n = llm.llm_engine.runner, 1024, 600
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(5))
    logits[:, [0, 3, 7]] = 6.0  # 0 and 3: the tiny model's EOS ids, banned too
    kinds = [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.8, top_p=0.9), dict(top_k=5)]

    def draw(num_generated):
        rows = [ScheduledSeq(i, [1], 0, [], True, SamplingParams(**kinds[i % 4], min_tokens=3, stop_token_ids=[7]),
                             num_generated=num_generated) for i in range(n)]
        return runner.sampler(logits.clone(), runner._sampling_tensors(rows, vocab), runner.generator).tokens

    assert not torch.isin(draw(2), torch.tensor([0, 3, 7])).any()
    assert torch.isin(draw(3), torch.tensor([0, 3, 7])).float().mean() > 0.5


def test_settings_carried_across_steps_equal_settings_built_afresh(llm):
    """Steps whose rows hold the same params objects reuse what those params decide; what
    moves with the tokens (seeds' keys, min_tokens bans, penalty counts) is still every
    step's own, and another params object in a row is noticed: the same tokens as settings
    built from scratch at every step."""
    from nanokv.engine.types import ScheduledSeq

    runner, vocab = llm.llm_engine.runner, 1024
    g = torch.Generator().manual_seed(9)
    kinds = [dict(temperature=0.9, top_p=0.9, seed=5), dict(temperature=0), dict(temperature=1.0, min_tokens=2),
             dict(temperature=0.7, top_k=30, seed=8, repetition_penalty=1.3), dict(temperature=1.1, logprobs=2)]
    params = [SamplingParams(**kinds[i % 5]) for i in range(40)]
    tokens = [torch.randint(0, vocab, (10,), generator=g).tolist() for _ in params]
    last = None
    for step in range(5):
        if step == 3:  # a row's settings change (another request in its place)
            params[2] = SamplingParams(temperature=0.5, top_p=0.5, seed=3)
        rows = [ScheduledSeq(i, t[-1:], len(t) - 1, [], True, p, seed=p.seed, num_generated=len(t) - 8,
                             all_token_ids=t, num_prompt_tokens=8) for i, (p, t) in enumerate(zip(params, tokens))]
        logits = torch.randn(len(rows), vocab, generator=g) * 2
        logits[:, 0] = 8.0  # the EOS: banned below min_tokens
        carried = runner._sampling_tensors(rows, vocab)
        runner._fixed_settings = None
        afresh = runner._sampling_tensors(rows, vocab)
        if step:  # the last step's settings carried over, unless a row changed
            assert (carried.temperatures is last.temperatures) == (step != 3)
        last = afresh
        got = [runner.sampler(logits.clone(), t, torch.Generator().manual_seed(1)).tokens.tolist()
               for t in (carried, afresh)]
        assert got[0] == got[1]
        assert carried.seeded == afresh.seeded and carried.seeded is not None
        for t in tokens:
            t.append(int(torch.randint(0, vocab, (1,), generator=g)))


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


def test_penalty_counts_kept_across_steps_equal_a_reference_from_scratch(llm):
    """The runner counts each sequence's tokens as they come and drops the counts when the
    scheduler frees the sequence: every step's penalised logits equal the reference built
    from the whole token list, through a preemption and the sequence's return."""
    from nanokv.engine.types import ScheduledBatch, ScheduledSeq

    runner, vocab = llm.llm_engine.runner, 1024
    g = torch.Generator().manual_seed(11)
    params = [SamplingParams(temperature=0, repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.3,
                             logprobs=vocab),
              SamplingParams(temperature=0, frequency_penalty=1.1, logprobs=vocab)]
    seqs = [(500 + i, torch.randint(0, 40, (12 + i,), generator=g).tolist(), 12 + i) for i in range(2)]
    for step in range(12):
        preempted = step in (5, 6)  # sequence 501 is preempted at step 5 and back at step 7
        batch = ScheduledBatch(freed_seq_ids=[501] if step == 5 else [])
        for (seq_id, tokens, num_prompt), p in zip(seqs, params):
            if not (preempted and seq_id == 501):
                batch.seqs.append(ScheduledSeq(seq_id, tokens[-1:], len(tokens) - 1, [], True, p,
                                               num_generated=len(tokens) - num_prompt, all_token_ids=tokens,
                                               num_prompt_tokens=num_prompt))
        logits = torch.randn(len(batch.seqs), vocab, generator=g) * 3
        rows = batch.seqs
        out = runner.sample(logits.clone(), batch)
        assert set(runner.token_counts) >= {s.seq_id for s in rows}
        assert (501 in runner.token_counts) == (not preempted)
        refs = [reference_penalties(logits[i], s.all_token_ids[:s.num_prompt_tokens],
                                    s.all_token_ids[s.num_prompt_tokens:], s.params.repetition_penalty,
                                    s.params.presence_penalty, s.params.frequency_penalty) for i, s in enumerate(rows)]
        got = torch.stack([torch.full((vocab,), float("nan")).scatter_(0, torch.tensor(lp.top_ids),
                                                                       torch.tensor(lp.top_logprobs))
                           for lp in out.logprobs])
        torch.testing.assert_close(got, torch.log_softmax(torch.stack(refs), -1), rtol=1e-5, atol=1e-5)
        for s in rows:  # the next token: often one already generated, sometimes a new one
            s.all_token_ids.append(int(torch.randint(0, 45, (1,), generator=g)))
    for seq_id, *_ in seqs:
        runner.token_counts.pop(seq_id)


def test_penalised_requests_give_the_same_tokens_under_preemption(model_dir, llm):
    prompts = random_prompts([20, 35, 11, 28, 40, 17], 1024, seed=90)
    params = [SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
                             max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.9, seed=3, frequency_penalty=1.5, max_tokens=30,
                             ignore_eos=True)] * 3
    roomy = tokens(llm.generate(prompts, params, use_tqdm=False))
    tight = LLM(model_dir, max_model_len=128, num_kvcache_blocks=12)
    assert tokens(tight.generate(prompts, params, use_tqdm=False)) == roomy
    assert tight.kv_stats().num_preemptions > 0
    tight.generate(prompts[0], params[0], use_tqdm=False)
    # the first call's sequences were dropped; the last call's go with the next step
    assert len(tight.llm_engine.runner.token_counts) <= 1


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
    dict(min_tokens=5, max_tokens=3), dict(stop=[""]), dict(stop=[3]), dict(logprobs=-2),
    dict(repetition_penalty=0.0), dict(presence_penalty=3.0), dict(frequency_penalty=-2.5),
])
def test_bad_sampling_values(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("vocab", [96, 1000, 1024, 1056, 49152])
def test_greedy_tokens_equal_argmax_with_ties_infinities_and_nans(vocab):
    """The CPU's block-maxima argmax picks exactly argmax's ids: ties go to the lowest id
    (also across blocks), all -inf rows, +inf, NaN rows, and strided views."""
    threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(64, vocab, generator=g)
    logits[1:8] = torch.randint(0, 3, (7, vocab), generator=g).float()  # many ties
    logits[8, :] = float("-inf")
    logits[9, vocab // 2] = float("inf")
    logits[10, [3, vocab - 1]] = 50.0  # a tie at both ends
    logits[11, vocab - 1] = 50.0  # the maximum in the last block
    logits[12] = -logits[12].abs()
    logits[12, [5, vocab // 3]] = torch.tensor([-0.0, 0.0])
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    logits[13, 7] = float("nan")
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    wide = torch.randn(32, 2 * vocab, generator=g)
    assert torch.equal(greedy_tokens(wide[:, :vocab]), wide[:, :vocab].argmax(dim=-1))
    assert torch.equal(greedy_tokens(wide[::2, vocab:]), wide[::2, vocab:].argmax(dim=-1))
    assert torch.get_num_threads() == threads  # one_thread() gave the threads back


def test_seed_keys_are_seed_for_token_for_every_seed():
    """seed_keys (the runner's per-step keys, inlined) is seed_for_token, for seeds of any
    sign and size a request may give, at any token index; rows without a seed are left out."""
    from types import SimpleNamespace

    from nanokv.layers.sampler import seed_for_token, seed_keys

    rng = random.Random(5)
    seeds = [0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1, 2**64 + 40]
    seeds += [rng.randrange(-(2**63), 2**64) for _ in range(200)]
    rows = [SimpleNamespace(seed=s, num_generated=rng.randrange(0, 10**6)) for s in seeds]
    rows.insert(3, SimpleNamespace(seed=None, num_generated=4))
    picked = list(range(len(rows)))
    assert seed_keys(rows, picked) == [(i, seed_for_token(r.seed, r.num_generated)) for i, r in enumerate(rows)
                                       if r.seed is not None]
    assert all(0 <= k < 2**63 for _, k in seed_keys(rows, picked))


# ---- what one request may send: bounded lists and penalties, numpy scalars -----------------

def test_sampling_params_take_numpy_scalars_as_python_numbers(llm):
    """numpy integers where ints go, numpy floats where numbers go (as numpy prompt ids
    are taken): stored as Python int / float, the same tokens as Python values; a numpy
    bool or an integral float is still no int."""
    np = pytest.importorskip("numpy")
    plain = dict(n=2, temperature=0.75, top_p=0.5, top_k=40, min_p=0.125, seed=7, max_tokens=6, min_tokens=2,
                 logprobs=2, repetition_penalty=1.25, presence_penalty=0.5, frequency_penalty=-0.25,
                 stop_token_ids=[5, 9])
    numpy = {k: np.float32(v) if isinstance(v, float) else np.int64(v) for k, v in plain.items()
             if k != "stop_token_ids"}
    numpy["stop_token_ids"] = [np.int32(5), np.uint64(9)]
    params = SamplingParams(**numpy)
    assert params == SamplingParams(**plain)
    for name, value in plain.items():
        got = getattr(params, name)
        assert type(got) is type(value) and (name == "stop_token_ids" or type(got) in (int, float)), name
    assert type(params.stop_token_ids[1]) is int
    assert SamplingParams(stop_token_ids=np.array([5, 9])).stop_token_ids == [5, 9]
    assert SamplingParams(seed=np.uint64(2**64 - 1)).seed == 2**64 - 1
    flags = SamplingParams(ignore_eos=np.bool_(True), include_stop_str_in_output=np.True_,
                           skip_special_tokens=np.bool_(False))
    assert (flags.ignore_eos, flags.include_stop_str_in_output, flags.skip_special_tokens) == (True, True, False)
    assert all(type(getattr(flags, k)) is bool for k in ("ignore_eos", "include_stop_str_in_output"))
    prompt = random_prompts([9], 1024, seed=80)[0]
    outs = [[c.token_ids for c in llm.generate(prompt, p, use_tqdm=False)[0].outputs]
            for p in (params, SamplingParams(**plain))]
    assert outs[0] == outs[1]
    for bad in (dict(n=np.bool_(True)), dict(max_tokens=np.float64(4.0)), dict(seed=np.float32(1)),
                dict(stop_token_ids=[np.bool_(False)]), dict(temperature=np.bool_(True)),
                dict(top_p=np.float64("nan")), dict(temperature=10**400), dict(ignore_eos=np.int64(1)),
                dict(skip_special_tokens=1), dict(include_stop_str_in_output=np.array([True]))):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


@pytest.mark.parametrize("name, make, limit", [
    ("stop", lambda k: [f"s{i}" for i in range(k)], "MAX_STOP_STRINGS"),
    ("stop", lambda k: "x" * k, "MAX_STOP_STRING_CHARS"),
    ("stop", lambda k: ["ok", "y" * k], "MAX_STOP_STRING_CHARS"),
    ("stop_token_ids", lambda k: [5] * k, "MAX_STOP_TOKEN_IDS"),
])
def test_request_lists_are_bounded(name, make, limit):
    """Every list a request sends has a documented bound; one past it is a ValueError naming
    the field and the bound (the server's 400), the bound itself is fine."""
    from nanokv import sampling_params

    bound = getattr(sampling_params, limit)
    SamplingParams(**{name: make(bound)})
    with pytest.raises(ValueError, match=rf"^{name} has .*at most {bound} are allowed"):
        SamplingParams(**{name: make(bound + 1)})
    with pytest.raises(ValueError, match=f"at most {bound}"):
        SamplingParams(**{name: make(1_000_000)})


def test_penalties_are_bounded_and_their_extremes_keep_logits_finite(llm):
    """repetition_penalty 1e-40 (a float32 subnormal) turned the penalised logits into inf
    (greedy repeated one token, sampling drew from NaN): refused. At the bounds allowed, the
    penalised logits of large and small, positive and negative logits stay finite, and
    greedy and logprobs equal a float64 reference."""
    from nanokv.engine.types import ScheduledSeq
    from nanokv.sampling_params import MAX_ADDITIVE_PENALTY, MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY

    for bad in (1e-40, 0.0, MIN_REPETITION_PENALTY / 2, MAX_REPETITION_PENALTY * 2, 1e40, -1.0):
        with pytest.raises(ValueError, match=r"repetition_penalty must be in \[0.01, 100"):
            SamplingParams(repetition_penalty=bad)
    for name in ("presence_penalty", "frequency_penalty"):
        for bad in (-MAX_ADDITIVE_PENALTY - 0.01, MAX_ADDITIVE_PENALTY + 0.01):
            with pytest.raises(ValueError, match=rf"{name} must be in \[-2, 2\]"):
                SamplingParams(**{name: bad})

    runner, vocab = llm.llm_engine.runner, 1024
    g = torch.Generator().manual_seed(21)
    cases = [(MIN_REPETITION_PENALTY, MAX_ADDITIVE_PENALTY, MAX_ADDITIVE_PENALTY),
             (MAX_REPETITION_PENALTY, -MAX_ADDITIVE_PENALTY, -MAX_ADDITIVE_PENALTY),
             (MIN_REPETITION_PENALTY, -MAX_ADDITIVE_PENALTY, MAX_ADDITIVE_PENALTY),
             (MAX_REPETITION_PENALTY, MAX_ADDITIVE_PENALTY, -MAX_ADDITIVE_PENALTY)] * 2
    logits = torch.randn(len(cases), vocab, generator=g) * 20
    extremes = torch.tensor([3e4, -3e4, 1e-30, -1e-30, 0.0, 3e35, -3e35, float("-inf")])
    logits[4:, :8] = extremes  # all in the prompt; the first four rows: greedy among ordinary logits
    rows, refs = [], []
    for i, (rep, pres, freq) in enumerate(cases):
        prompt = list(range(8)) + torch.randint(0, vocab, (20,), generator=g).tolist()
        output = torch.randint(0, 60, (300,), generator=g).tolist()
        params = SamplingParams(temperature=0, repetition_penalty=rep, presence_penalty=pres,
                                frequency_penalty=freq, logprobs=20)
        rows.append(ScheduledSeq(i, [output[-1]], len(prompt) + 299, [], True, params, num_generated=300,
                                 all_token_ids=prompt + output, num_prompt_tokens=len(prompt)))
        refs.append(reference_penalties(logits[i].double(), prompt, output, rep, pres, freq))
    penalised = logits.clone()
    out = runner.sampler(penalised, runner._sampling_tensors(rows, vocab))
    expected = torch.stack(refs)
    finite = torch.ones_like(penalised, dtype=torch.bool)
    finite[4:, 7] = False  # the -inf stays -inf
    assert torch.isfinite(penalised[finite]).all() and (penalised[4:, 7] == float("-inf")).all()
    torch.testing.assert_close(penalised.double(), expected, rtol=1e-5, atol=1e-4)
    assert out.tokens.tolist() == expected.argmax(-1).tolist()
    assert len(set(out.tokens[:4].tolist()) - set(range(8))) > 0  # ordinary rows: not just the extremes
    assert torch.isfinite(out.top_logprobs).all() and torch.isfinite(out.logprobs).all()


def test_penalties_at_float32s_limits_saturate_instead_of_making_inf(llm):
    """Penalties at their bounds on logits near float32's largest (a model's extremes):
    1e37 / 0.01 and -3e38 * 100 were +-inf, so the row's logprobs were inf - inf = NaN and
    a sampled row drew from NaN. They saturate at the largest finite float (as a float64
    reference clamped to it), banned -inf logits stay -inf, and greedy, sampled tokens and
    logprobs are finite and follow the saturated logits."""
    from nanokv.engine.types import ScheduledSeq
    from nanokv.sampling_params import MAX_ADDITIVE_PENALTY, MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY

    runner, vocab, big = llm.llm_engine.runner, 1024, torch.finfo(torch.float32).max
    g = torch.Generator().manual_seed(5)
    extremes = torch.tensor([-3e38, -1e37, float("-inf"), 3e38, 1e37, big, -big, 2e36, -2e36, 7.0])
    cases = [(MIN_REPETITION_PENALTY, MAX_ADDITIVE_PENALTY, -MAX_ADDITIVE_PENALTY, 0.0),
             (MAX_REPETITION_PENALTY, -MAX_ADDITIVE_PENALTY, MAX_ADDITIVE_PENALTY, 0.0),
             (MIN_REPETITION_PENALTY, -MAX_ADDITIVE_PENALTY, MAX_ADDITIVE_PENALTY, 0.9),
             (MAX_REPETITION_PENALTY, MAX_ADDITIVE_PENALTY, -MAX_ADDITIVE_PENALTY, 0.9)]
    logits = torch.randn(len(cases), vocab, generator=g) * 3
    logits[:, :len(extremes)] = extremes
    logits[1, len(extremes):] = -3e38  # rows where every token is in the prompt, most of them
    logits[3, len(extremes):] = -3e38  # far below zero: x 100 was -inf for all but a few
    rows, refs = [], []
    for i, (rep, pres, freq, temp) in enumerate(cases):
        prompt = list(range(vocab)) if i % 2 else list(range(len(extremes)))
        output = [0, 3, 3, 9, 9, 9, 5]
        params = SamplingParams(temperature=temp, seed=i, repetition_penalty=rep, presence_penalty=pres,
                                frequency_penalty=freq, logprobs=20)
        rows.append(ScheduledSeq(i, [output[-1]], len(prompt) + len(output) - 1, [], True, params,
                                 num_generated=len(output), all_token_ids=prompt + output,
                                 num_prompt_tokens=len(prompt)))
        ref = reference_penalties(logits[i].double(), prompt, output, rep, pres, freq)
        refs.append(torch.where(ref.isinf(), ref, ref.clamp(-big, big)))
    penalised = logits.clone()
    out = runner.sampler(penalised, runner._sampling_tensors(rows, vocab), torch.Generator().manual_seed(0))
    banned = torch.zeros_like(penalised, dtype=torch.bool)
    banned[:, 2] = True
    assert torch.isfinite(penalised[~banned]).all() and (penalised[:, 2] == float("-inf")).all()
    expected = torch.stack(refs)
    torch.testing.assert_close(penalised.double(), expected, rtol=1e-6, atol=0)
    greedy = expected.argmax(-1)
    assert out.tokens[0].item() == greedy[0].item() == 3  # the first of the saturated
    assert out.tokens[1].item() == greedy[1].item()
    # the sampled tokens' logprobs finite; a top candidate 6.8e38 below the best is -inf, never NaN
    assert torch.isfinite(out.logprobs).all() and not out.top_logprobs.isnan().any()
    for i in (2, 3):  # sampled rows: a token of the largest logits (the others are 1e30+ below)
        assert expected[i, out.tokens[i]] == expected[i].max()


def test_min_tokens_ban_list_is_built_once_per_request(llm, monkeypatch):
    """A request's min_tokens ban list (its stop_token_ids and EOS) is built once, not per
    row per step (n=32 and a million ids made a GB a step): its n rows share one [K] id
    tensor across steps and across batches that change around it, a step holds one row
    index per banned row, and once min_tokens is reached nothing is banned."""
    from nanokv.engine.types import ScheduledSeq
    from nanokv.sampling_params import MAX_STOP_TOKEN_IDS

    runner, vocab = llm.llm_engine.runner, 1024
    built = []
    ban_tensor = runner._ban_tensor
    monkeypatch.setattr(runner, "_ban_tensor", lambda p: built.append(p) or ban_tensor(p))
    stop_ids = [(2 * i) % vocab for i in range(MAX_STOP_TOKEN_IDS)]  # the even ids, each twice
    wide = SamplingParams(n=32, temperature=0.8, min_tokens=3, stop_token_ids=stop_ids)
    plain = SamplingParams(temperature=0, min_tokens=3)  # EOS only
    others = [SamplingParams(temperature=0.5) for _ in range(3)]
    expected_ids = torch.tensor(list(dict.fromkeys(stop_ids + runner.eos_token_ids)))
    shared = None
    for step in range(5):
        batch_params = [wide] * 32 + [plain] + others[:1 + step % 3]  # other requests come and go
        rows = [ScheduledSeq(i, [1], 0, [], True, p, num_generated=step) for i, p in enumerate(batch_params)]
        runner._fixed_settings = None if step == 2 else runner._fixed_settings  # and settings afresh
        t = runner._sampling_tensors(rows, vocab)
        if step >= 3:
            assert t.banned is None
            continue
        (wide_rows, wide_ids), (plain_rows, plain_ids) = t.banned
        assert wide_rows.tolist() == list(range(32)) and plain_rows.tolist() == [32]
        assert torch.equal(wide_ids, expected_ids) and plain_ids is runner._eos_ids
        shared = wide_ids if shared is None else shared
        assert wide_ids is shared
        tokens = runner.sampler(torch.zeros(len(rows), vocab), t, torch.Generator().manual_seed(step)).tokens
        assert not torch.isin(tokens[:32], expected_ids).any()
    assert built == [wide, plain]  # once each; plain's ids are the runner's EOS tensor
    runner._sampling_tensors([ScheduledSeq(0, [1], 0, [], True, others[0])], vocab)
    assert runner._ban_ids == {}  # requests no longer in the batch are let go


def reference_stop(text, num_new, stops):
    """The stop string ending in the newest num_new characters that starts first (the
    first listed at the same start), scanning every stop string."""
    best = None
    for stop in stops:
        pos = text.find(stop, max(0, len(text) - num_new - len(stop) + 1))
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, stop)
    return best


def test_stop_strings_automaton_equals_scanning_every_stop_string():
    """Fed text in random pieces, the automaton reports what scanning every stop string over
    each new piece finds: overlapping, nested and repeated stop strings, hits that span
    pieces, several hits in one piece."""
    from nanokv.output_processor import StopStrings

    rng = random.Random(12)
    for trial in range(2000):
        alphabet = "ab" if trial % 2 else "abcé"
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 8))]
        matcher, node, text = StopStrings(stops), 0, ""
        for _ in range(rng.randint(1, 10)):
            piece = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))
            text += piece
            node, hit = matcher.scan(node, piece, len(text) - len(piece))
            assert hit == reference_stop(text, len(piece), stops), (stops, text, piece)


def test_stop_string_work_per_character_does_not_grow_with_their_number():
    """The automaton's lookups per character fed are bounded (at most 3, amortised) however
    many stop strings there are and however they overlap the text (counted, not timed)."""
    from nanokv.output_processor import StopStrings
    from nanokv.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

    class Counting(dict):
        lookups = 0

        def __contains__(self, key):
            Counting.lookups += 1
            return super().__contains__(key)

        def get(self, key, default=None):
            Counting.lookups += 1
            return super().get(key, default)

    text = ("a" * 300 + "b") * 20
    for stops in (["ab"], ["a" * k + "c" for k in range(1, MAX_STOP_STRINGS + 1)],
                  ["a" * (MAX_STOP_STRING_CHARS - 1) + chr(0x100 + i) for i in range(MAX_STOP_STRINGS)]):
        matcher = StopStrings(stops)
        matcher.next = Counting(matcher.next)
        Counting.lookups, node = 0, 0
        for start in range(0, len(text), 3):
            node, _ = matcher.scan(node, text[start:start + 3], start)
        assert Counting.lookups <= 3 * len(text), (len(stops), Counting.lookups)


def test_many_stop_strings_stop_like_one_and_are_built_once_per_request(llm, monkeypatch):
    """The most stop strings allowed, one of them in the text: the same text, stop reason
    and stream as that one alone, for each of n samples; the automaton is built once for the
    request, not per sample or step (and once for the prompts of one call)."""
    from nanokv import output_processor
    from nanokv.sampling_params import MAX_STOP_STRINGS

    prompt = random_prompts([11], 1024, seed=81)[0]
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = base.text[len(base.text) // 2:len(base.text) // 2 + 3]
    assert len(stop) == 3
    one = SamplingParams(n=3, temperature=0, max_tokens=24, ignore_eos=True, stop=stop)
    many = SamplingParams(n=3, temperature=0, max_tokens=24, ignore_eos=True,
                          stop=[f"never-{i}" for i in range(MAX_STOP_STRINGS - 1)] + [stop])
    built, real = [], output_processor.StopStrings
    monkeypatch.setattr(output_processor, "StopStrings", lambda stops: built.append(stops) or real(stops))
    want = llm.generate(prompt, one, use_tqdm=False)[0].outputs
    got = llm.generate(prompt, many, use_tqdm=False)[0].outputs
    assert [(c.text, c.stop_reason, c.finish_reason) for c in got] == \
        [(c.text, c.stop_reason, c.finish_reason) for c in want]
    assert want[0].stop_reason == stop and want[0].text == base.text[:base.text.index(stop)]
    assert built == [[stop], many.stop]
    assert "".join(llm.stream(prompt, SamplingParams(**{**many.__dict__, "n": 1}))) == want[0].text
    outs = llm.generate([prompt] * 3, one, use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == [want[0].text] * 3
    assert built == [[stop], many.stop, [stop]]  # the same stop strings: the last automaton again
