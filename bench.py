"""Throughput of nanokv against Hugging Face generate, side by side in one run.

    python bench.py                                  # on a CPU: SmolLM2, workloads cpu and chat
    python bench.py --workload nano --shape qwen3-0.6b   # nano-vllm's workload (the GPU default)
    python bench.py --model /path/to/model --workload cpu --json
    python bench.py serve                            # servers under load: benchmarks/serve.py

Every engine runs the same requests (EOS ignored, fixed seeds) in this process and is
credited only with the output tokens each request asked for: HF generate has to run each
padded batch to its longest request, and that is its real cost. Ratios are against HF
generate's best batch size, so drifting machine speed cancels out. Workloads: random
token ids decoded greedily (nano, cpu, tiny), or chat-shaped prompts sampled with
temperature 0.8 and top_p 0.95, one seed per request (chat, chat-tiny). A GGUF model
(such as the built-in smollm2) is dequantized once into a temporary float32 copy that
every engine loads.
"""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import nanokv  # noqa: F401  before torch: OpenMP's wait setting (nanokv/cpu_threads.py)
    from benchmarks.cli import main  # the benchmarks, by subject: benchmarks/

    sys.exit(main(sys.argv[1:], description=__doc__))
