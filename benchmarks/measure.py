"""What one engine's run measured (Result), and how: peak memory (torch's on a GPU, the
process's VmHWM on a CPU) and device synchronization around the timed part."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch


@dataclass
class Result:
    engine: str
    output_tokens: int
    seconds: float
    peak_memory_gib: float
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds


def reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:  # Linux: reset the process's peak RSS (VmHWM) to its current RSS
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
