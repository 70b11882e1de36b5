"""Accuracy of one engine configuration against another (weight or KV-cache formats):
perplexity, mean KL divergence and top-1 agreement of the next-token distributions over
English prose that ships with the machine, and greedy agreement on chat prompts.

The text: the license texts of Debian's base-files package (/usr/share/common-licenses,
present on every Debian and Ubuntu system), nine distinct licenses (older versions of
the same license are left out), about 37,000 SmolLM2 tokens. Each document is split into
windows of `window` tokens scored independently (the first token of a window has no
context and is not scored).

Everything runs through nanokv itself: a window is one prefill of the engine's own model,
with its KV cache and attention, and the logits of every position are kept (the engine's
generate() samples only the last one). Both engines run in one process, window by window,
so that no distribution is stored.

A quantized KV cache (kv_cache_dtype='int8') is measured through its pages: every
attention backend writes a step's K/V into the cache first and then attends over the
cache, so in a window's prefill each query reads every earlier token's K/V (and its own)
back from the int8 pages, as a decode step would (tests/attention/test_kv_int8.py checks
that the logits differ from the float32 cache's). The reference for such a variant is
the same weights with the full-precision cache (bench.py --accuracy --kv-cache-dtype).

    from nanokv.testing.accuracy import compare_engines
    report = compare_engines("smollm2", dict(), dict(quantization="int8"))

bench.py --accuracy prints these numbers for its --dtype / --quantization variants.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

CORPUS_DIR = "/usr/share/common-licenses"
CORPUS_FILES = ("GPL-3", "GPL-2", "LGPL-2.1", "GFDL-1.3", "MPL-2.0", "Apache-2.0", "Artistic", "CC0-1.0", "MPL-1.1")
WINDOW = 1024

# 32 chat prompts for greedy agreement (rendered with the model's chat template)
CHAT_PROMPTS = [
    "What is the capital of France?", "Name three primary colors.", "Write a haiku about the ocean.",
    "Explain what a prime number is in one sentence.", "What is 12 times 7?",
    "Give me one tip for sleeping better.", "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?", "Why is the sky blue?", "Describe a cat to someone who has never seen one.",
    "What are the three states of matter?", "Write a short poem about autumn leaves.",
    "How do plants make their food?", "List four planets of the solar system.",
    "What is the difference between weather and climate?", "Give me a recipe idea for a quick breakfast.",
    "Explain gravity to a child.", "What does a computer's CPU do?", "Suggest a name for a friendly robot.",
    "Why do we have seasons?", "What is the boiling point of water in Celsius?",
    "Write a two-sentence story about a dragon.", "How can I save money on groceries?",
    "What is photosynthesis?", "Tell me a fun fact about octopuses.", "What is the largest ocean on Earth?",
    "How many days are there in a leap year?", "Give three reasons to learn a second language.",
    "What is the purpose of a dictionary?", "Explain what a rainbow is.", "How do bees make honey?",
    "What should I pack for a day at the beach?",
]


@dataclass(frozen=True)
class Document:
    name: str
    text: str


def corpus() -> list[Document]:
    """The prose the measurements run on (CORPUS_FILES under CORPUS_DIR)."""
    missing = [f for f in CORPUS_FILES if not os.path.isfile(os.path.join(CORPUS_DIR, f))]
    if missing:
        raise ValueError(f"{CORPUS_DIR} lacks {', '.join(missing)} (Debian's base-files package ships them)")
    docs = []
    for name in CORPUS_FILES:
        with open(os.path.join(CORPUS_DIR, name), encoding="utf-8") as f:
            docs.append(Document(name, f.read()))
    return docs


def corpus_windows(tokenizer, window: int = WINDOW, max_tokens: int | None = None) -> list[list[int]]:
    """The corpus as windows of at most `window` token ids (each document split on its
    own), in order; with max_tokens, only the first windows that hold that many."""
    windows, total = [], 0
    for doc in corpus():
        ids = tokenizer(doc.text, add_special_tokens=False).input_ids
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start:start + window]
            if len(chunk) < 2:
                continue
            windows.append(chunk)
            total += len(chunk)
            if max_tokens is not None and total >= max_tokens:
                return windows
    return windows


@torch.inference_mode()
def window_logits(llm, tokens: list[int]) -> torch.Tensor:
    """The engine's logits at every position of one prompt, [len(tokens), vocab] float32:
    one prefill through its model, KV cache and attention (an engine with no requests in
    flight and prefix caching off: the window's pages are taken from the start of the pool)."""
    from nanokv.engine.types import ScheduledBatch, ScheduledSeq
    from nanokv.sampling_params import SamplingParams

    engine = llm.llm_engine
    if engine.config.enable_prefix_caching or engine.has_unfinished():
        raise ValueError("window_logits needs an idle engine built with enable_prefix_caching=False")
    runner = engine.runner
    pages = list(range(-(-len(tokens) // runner.block_size)))
    if len(pages) > runner.num_blocks:
        raise ValueError(f"a window of {len(tokens)} tokens needs {len(pages)} KV blocks; the pool has "
                         f"{runner.num_blocks}")
    seq = ScheduledSeq(0, list(tokens), 0, pages, True, SamplingParams(temperature=0))
    input_ids, positions, meta, _ = runner.prepare(ScheduledBatch([seq], len(tokens)))
    runner.backend.prepare(meta, runner.block_size)
    hidden = runner.model(input_ids, positions, meta)  # [T, hidden]: every row
    return runner.model.compute_logits(hidden).float()  # [T, vocab]


@dataclass(frozen=True)
class PerplexityReport:
    tokens: int  # scored tokens
    ppl_reference: float
    ppl: float
    dppl_percent: float  # 100 * (ppl / ppl_reference - 1)
    mean_kl: float  # KL(reference || candidate) per token, nats
    top1_agreement: float  # fraction of positions where both predict the same next token


@torch.inference_mode()
def compare_perplexity(reference, candidate, windows: list[list[int]]) -> PerplexityReport:
    """Both engines (LLM objects) on the same windows."""
    nll_ref = nll = kl = agree = 0.0
    count = 0
    for tokens in windows:
        target = torch.tensor(tokens[1:])
        ref = torch.log_softmax(window_logits(reference, tokens)[:-1], -1)  # [n - 1, vocab]
        got = torch.log_softmax(window_logits(candidate, tokens)[:-1], -1)
        nll_ref -= float(ref.gather(1, target[:, None]).sum())
        nll -= float(got.gather(1, target[:, None]).sum())
        kl += float((ref.exp() * (ref - got)).sum())
        agree += float((ref.argmax(-1) == got.argmax(-1)).sum())
        count += len(tokens) - 1
    ppl_ref, ppl = math.exp(nll_ref / count), math.exp(nll / count)
    return PerplexityReport(count, ppl_ref, ppl, 100 * (ppl / ppl_ref - 1), kl / count, agree / count)


# A greedy divergence is a near-tie when, at the first differing token, the candidate's
# choice is within this many nats of the reference's in the reference's own distribution
# (same prefix up to there): the two were all but equally likely, and any rounding flips it.
NEAR_TIE_NATS = 0.1
_TOP = 5  # reference logprobs kept per token, to find the candidate's choice among them


@dataclass(frozen=True)
class GreedyReport:
    prompts: int
    max_tokens: int
    identical: int  # prompts whose greedy outputs are the same, token for token
    prefix_fraction: float  # mean share of the reference's tokens before the first difference
    token_agreement: float  # share of positions with the same token (after a difference too)
    near_ties: int = 0  # of the prompts that differ, those whose first difference is a near-tie
    first_divergences: tuple = ()  # per differing prompt: (prompt index, token index, reference margin in nats)


def compare_greedy(reference, candidate, prompts: list[str] = CHAT_PROMPTS, max_tokens: int = 64) -> GreedyReport:
    """Greedy chat replies of both engines (each prompt one user turn, EOS honoured)."""
    from nanokv import SamplingParams

    conversations = [[{"role": "user", "content": p}] for p in prompts]
    ref_out = [o.outputs[0] for o in reference.chat(
        conversations, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=_TOP), use_tqdm=False)]
    ref = [o.token_ids for o in ref_out]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    got = [o.outputs[0].token_ids for o in candidate.chat(conversations, params, use_tqdm=False)]
    identical = sum(a == b for a, b in zip(ref, got))
    prefix = same = total = 0.0
    divergences = []
    for n, (a, b, out) in enumerate(zip(ref, got, ref_out)):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix += (first if a != b else len(a)) / max(len(a), 1)
        same += sum(x == y for x, y in zip(a, b))
        total += max(len(a), len(b))
        if a != b:
            margin = float("inf")  # one reply stopped early (EOS), or the candidate's token is not in the top
            if first < len(a) and first < len(b) and b[first] in out.logprobs[first]:
                top = out.logprobs[first]
                margin = top[a[first]].logprob - top[b[first]].logprob
            divergences.append((n, first, margin))
    near = sum(m < NEAR_TIE_NATS for _, _, m in divergences)
    return GreedyReport(len(prompts), max_tokens, identical, prefix / len(prompts), same / max(total, 1), near,
                        tuple(divergences))


def scoring_engine(model: str, **kwargs):
    """An LLM fit for window_logits: prefix caching off, room for one window."""
    from nanokv import LLM

    kwargs.setdefault("max_model_len", max(WINDOW, 2048))
    return LLM(model, enable_prefix_caching=False, **kwargs)


def compare_engines(model: str, reference_kwargs: dict, candidate_kwargs: dict, max_tokens: int | None = None,
                    window: int = WINDOW, prompts: list[str] = CHAT_PROMPTS,
                    greedy_tokens: int = 64) -> tuple[PerplexityReport, GreedyReport]:
    """Build both engines on `model` and compare them on the corpus and the chat prompts."""
    reference = scoring_engine(model, **reference_kwargs)
    candidate = scoring_engine(model, **candidate_kwargs)
    windows = corpus_windows(reference.get_tokenizer(), window, max_tokens)
    return (compare_perplexity(reference, candidate, windows),
            compare_greedy(reference, candidate, prompts, greedy_tokens))
