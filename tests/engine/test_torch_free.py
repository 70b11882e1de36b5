"""The engine package (scheduler, block manager, sequences) must not import torch."""

import subprocess
import sys


def test_engine_imports_no_torch():
    code = ("import sys\n"
            "import nanokv.engine.scheduler, nanokv.engine.block_manager, nanokv.engine.sequence, "
            "nanokv.engine.types\n"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)
