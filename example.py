"""Generate with nanokv.

    python example.py                 # a tiny random-weight Qwen3 built locally (no download)
    python example.py --model DIR     # any supported Hugging Face model directory
"""

from __future__ import annotations

import argparse
import logging

from nanokv import LLM, SamplingParams

PROMPTS = [
    "The Zen of Python says",
    "A paged KV cache is",
    "def fibonacci(n):",
    "Once upon a time",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="Hugging Face model directory (default: a built-in tiny model)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: the model's max_position_embeddings")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    model = args.model
    if model is None:
        from nanokv.tiny import cached_tiny_checkpoint

        model = cached_tiny_checkpoint("qwen3-tiny")
        print(f"Using the built-in tiny Qwen3 at {model}.\n"
              "Its weights are random, so the text below is gibberish; pass --model DIR for a real model.\n")

    llm = LLM(model, max_model_len=args.max_model_len, device=args.device)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    for out in llm.generate(PROMPTS, params):
        print(f"{out.prompt!r} -> {out.outputs[0].text!r}  [{out.outputs[0].finish_reason}]")


if __name__ == "__main__":
    main()
