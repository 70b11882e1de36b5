"""Throughput benchmark against Hugging Face generate: not built yet.

The benchmark (workloads, engines side by side, ratios, roofline) is issue 6. Until it
lands this script reports nothing rather than numbers nobody measured.
"""

import sys

if __name__ == "__main__":
    sys.exit("bench.py is not implemented yet: see issue 6 (throughput against HF generate).")
