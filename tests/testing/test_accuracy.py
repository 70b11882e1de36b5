"""nanokv/testing/accuracy.py: the corpus, window logits through nanokv's own prefill, and
the comparisons (an engine against itself is a perfect match; int8 weights are not)."""

from __future__ import annotations

import math

import pytest
import torch

from nanokv import SamplingParams, kernels
from nanokv.testing import accuracy


def test_corpus_is_english_prose_split_into_windows(model_dir):
    docs = accuracy.corpus()
    assert [d.name for d in docs] == list(accuracy.CORPUS_FILES)
    assert all("license" in d.text.lower() and len(d.text) > 1000 for d in docs)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    windows = accuracy.corpus_windows(tokenizer, window=300)
    assert all(2 <= len(w) <= 300 for w in windows)
    first = tokenizer(docs[0].text, add_special_tokens=False).input_ids
    assert sum(windows[:-(-len(first) // 300)], []) == first  # a document's windows are its tokens, in order
    assert len(accuracy.corpus_windows(tokenizer, window=300, max_tokens=1000)) == 4
    assert len(accuracy.CHAT_PROMPTS) == 32


def test_window_logits_are_the_engines_own(model_dir):
    """The last position's distribution is the one generate() samples its first token from."""
    llm = accuracy.scoring_engine(model_dir, max_model_len=256)
    prompt = [(13 * i) % 900 + 4 for i in range(70)]
    logits = accuracy.window_logits(llm, prompt)
    assert logits.shape == (70, llm.llm_engine.config.hf_config.vocab_size)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=1), use_tqdm=False)[0]
    token = out.outputs[0].token_ids[0]
    assert token == int(logits[-1].argmax())
    expected = float(torch.log_softmax(logits[-1], -1)[token])
    assert math.isclose(out.outputs[0].logprobs[0][token].logprob, expected, rel_tol=1e-5, abs_tol=1e-6)
    assert torch.equal(accuracy.window_logits(llm, prompt[:20]), accuracy.window_logits(llm, prompt[:20]))
    with pytest.raises(ValueError, match="prefix_caching"):
        accuracy.window_logits(__import__("nanokv").LLM(model_dir, max_model_len=256), prompt)


@pytest.mark.skipif(not kernels.available(), reason="no C compiler: CPU kernels not built")
def test_comparisons(model_dir):
    from transformers import AutoTokenizer

    windows = accuracy.corpus_windows(AutoTokenizer.from_pretrained(model_dir), window=128, max_tokens=400)
    reference = accuracy.scoring_engine(model_dir, max_model_len=256)
    same = accuracy.compare_perplexity(reference, accuracy.scoring_engine(model_dir, max_model_len=256), windows)
    assert same.tokens == sum(len(w) - 1 for w in windows) and same.dppl_percent == 0
    assert same.mean_kl == 0 and same.top1_agreement == 1
    int8 = accuracy.compare_perplexity(reference, accuracy.scoring_engine(model_dir, max_model_len=256,
                                                                          quantization="int8"), windows)
    assert int8.mean_kl > 0 and int8.ppl != int8.ppl_reference and 0 < int8.top1_agreement <= 1
    greedy = accuracy.compare_greedy(reference, reference, accuracy.CHAT_PROMPTS[:3], max_tokens=8)
    assert (greedy.identical, greedy.prefix_fraction, greedy.token_agreement) == (3, 1.0, 1.0)


@pytest.mark.skipif(not kernels.available(), reason="no C compiler: CPU kernels not built")
def test_greedy_divergences_name_their_margin(model_dir):
    """An int8 KV cache against the float32 one: every differing prompt is listed with the
    token where it first differs and the reference's margin there; near-ties are those
    under NEAR_TIE_NATS."""
    reference = accuracy.scoring_engine(model_dir, max_model_len=256)
    candidate = accuracy.scoring_engine(model_dir, max_model_len=256, kv_cache_dtype="int8")
    report = accuracy.compare_greedy(reference, candidate, accuracy.CHAT_PROMPTS[:8], max_tokens=16)
    assert len(report.first_divergences) == report.prompts - report.identical
    assert report.near_ties == sum(m < accuracy.NEAR_TIE_NATS for _, _, m in report.first_divergences)
    assert all(0 <= i < 16 and m >= 0 for _, i, m in report.first_divergences)
    same = accuracy.compare_greedy(reference, reference, accuracy.CHAT_PROMPTS[:2], max_tokens=8)
    assert (same.near_ties, same.first_divergences) == (0, ())
