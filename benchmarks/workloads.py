"""The requests every engine runs: the named workloads, their overrides from the command
line, and the chat workloads' prompts (a shared system prompt and one user turn each)."""

from __future__ import annotations

import random
from dataclasses import dataclass


WORKLOADS = {
    # nano-vllm's published benchmark
    "nano": dict(num_requests=256, prompt=(100, 1024), output=(100, 1024)),
    # sized for a few minutes on 2 CPU cores
    "cpu": dict(num_requests=64, prompt=(16, 256), output=(16, 160)),
    # a quick look (CI smoke runs)
    "tiny": dict(num_requests=8, prompt=(4, 32), output=(4, 16)),
    # chat-shaped and sampled: a shared system prompt and varied user turns rendered with the
    # model's chat template (their lengths come from the text), SAMPLING, one seed per request
    "chat": dict(num_requests=64, output=(16, 160), chat=True),
    "chat-tiny": dict(num_requests=8, output=(4, 16), chat=True),
    # structured outputs (benchmarks/structured.py): nanokv alone, the same chat requests with
    # and without a 10-field JSON schema, all at once, and a 20-property schema's compile time;
    # outputs shorter than SmolLM2's records (about 100 tokens), so that rows rarely finish
    # their schema and go on with EOS alone (cheaper than sampling)
    "structured": dict(num_requests=64, output=(48, 96), chat=True, structured=True),
    "structured-tiny": dict(num_requests=4, output=(4, 12), chat=True, structured=True),
    # decode-heavy long contexts, where each step's KV read dominates: long prompts, outputs a
    # third of them (so that decode, not prefill, is most of the time), all wanted at once, in
    # a fixed KV budget (kv_cache_memory_bytes, 1 GiB: SmolLM2's float32 pool holds ~23k tokens
    # of the ~52k the 24 sequences need, ~10 at a time; int8 ~88k: all of them)
    "long": dict(num_requests=24, prompt=(1024, 2048), output=(512, 768), kv_cache_memory_bytes=1 << 30),
}
SAMPLING = dict(temperature=0.8, top_p=0.95)  # the chat workloads' sampling

SYSTEM_PROMPT = (
    "You are a friendly and knowledgeable assistant for a public library's help desk. Answer "
    "questions clearly and accurately in plain English, keep answers short unless asked for "
    "detail, use examples where they help, say so when you are unsure, and never make up "
    "facts, titles or quotations. If a question is ambiguous, answer the most likely reading.")
_TASKS = ["Explain {} to a ten-year-old.", "Give me three practical tips about {}.",
          "Write a short poem about {}.", "What are the pros and cons of {}?",
          "Summarize the history of {} in a few sentences.", "How would you teach {} to a beginner?",
          "Write a very short story that involves {}.", "What are common misconceptions about {}?"]
_SUBJECTS = ["photosynthesis", "the French Revolution", "black holes", "sourdough baking",
             "compound interest", "the immune system", "plate tectonics", "jazz improvisation",
             "machine learning", "the water cycle", "chess openings", "renewable energy",
             "the Roman Empire", "sleep", "volcanoes", "public speaking"]


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    seed: int | None = None  # sampled workloads: the request's own seed


def workload_spec(name: str, num_requests: int | None = None, prompt: str | None = None,
                  output: str | None = None) -> dict:
    """WORKLOADS[name], with any of its numbers replaced: lengths as "LO-HI" or "N"."""
    spec = dict(WORKLOADS[name])
    if prompt is not None and spec.get("chat"):
        raise ValueError(f"--prompt-lens does not apply to {name}: its prompts are rendered conversations")
    if num_requests is not None:
        if num_requests < 1:
            raise ValueError(f"--num-requests must be at least 1, got {num_requests}")
        spec["num_requests"] = num_requests
    for key, text in (("prompt", prompt), ("output", output)):
        if text is None:
            continue
        lo, _, hi = text.partition("-")
        try:
            bounds = (int(lo), int(hi or lo))
        except ValueError:
            raise ValueError(f"--{key}-lens takes LO-HI or N (token counts), got {text!r}") from None
        if not 1 <= bounds[0] <= bounds[1]:
            raise ValueError(f"--{key}-lens needs 1 <= LO <= HI, got {text!r}")
        spec[key] = bounds
    return spec


def make_workload(name: str | dict, vocab: int, seed: int = 0, tokenizer=None) -> list[Request]:
    """Requests of a named workload (or a spec from workload_spec): output lengths uniform in
    their range; prompts of token ids uniform in [0, vocab) with lengths uniform in theirs,
    or, for chat workloads, conversations rendered with the tokenizer's chat template."""
    spec = WORKLOADS[name] if isinstance(name, str) else name
    rng = random.Random(seed)
    reqs = []
    for _ in range(spec["num_requests"]):
        if spec.get("chat"):
            prompt = chat_prompt(tokenizer, rng.choice(_TASKS).format(rng.choice(_SUBJECTS)))
            reqs.append(Request(prompt, rng.randint(*spec["output"]), seed=rng.randrange(2**31)))
        else:
            n = rng.randint(*spec["prompt"])
            reqs.append(Request([rng.randrange(vocab) for _ in range(n)], rng.randint(*spec["output"])))
    return reqs


def chat_prompt(tokenizer, user: str) -> list[int]:
    """The shared system prompt and one user turn, as the chat template renders them."""
    conversation = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids
