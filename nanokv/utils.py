"""Small helpers with vLLM's names (vllm.utils), for ported scripts."""

from __future__ import annotations

import uuid


def random_uuid() -> str:
    """A fresh request id: 32 hex digits (vLLM's random_uuid)."""
    return uuid.uuid4().hex
