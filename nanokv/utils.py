"""Small helpers with vLLM's names (vllm.utils), for ported scripts."""

from __future__ import annotations

import argparse
import uuid


def random_uuid() -> str:
    """A fresh request id: 32 hex digits (vLLM's random_uuid)."""
    return uuid.uuid4().hex


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's argument parser name (vllm.utils.FlexibleArgumentParser), for scripts that
    build theirs with `parser = EngineArgs.add_cli_args(FlexibleArgumentParser())`. A
    plain argparse.ArgumentParser (vLLM's also reads --config YAML files; this one does not)."""
