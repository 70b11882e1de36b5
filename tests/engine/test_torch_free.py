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


def test_engine_args_import_no_torch():
    """`nanokv --help` builds its parser from EngineArgs: reading the arguments and their
    flags must not pull in torch (1-2 s)."""
    code = ("import argparse, sys\n"
            "from nanokv.engine.arg_utils import EngineArgs\n"
            "EngineArgs.add_cli_args(argparse.ArgumentParser())\n"
            "EngineArgs.from_kwargs(model='m', block_size=8)\n"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)
