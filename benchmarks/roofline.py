"""The roofline under each nanokv run: the work a workload needs (matmul FLOPs on a CPU;
weight and KV bytes read on a GPU) over the machine's measured rate (a model-shaped GEMM's
FLOP/s; a device copy's bytes/s), as a floor in seconds and nanokv's percent of it."""

from __future__ import annotations

import time

import torch

from benchmarks.measure import Result, sync
from benchmarks.workloads import Request


def model_dims(hf_config) -> dict:
    h, layers = hf_config.hidden_size, hf_config.num_hidden_layers
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    d = getattr(hf_config, "head_dim", None) or h // heads
    inter, vocab = hf_config.intermediate_size, hf_config.vocab_size
    past_attention = heads * d * h + 3 * h * inter  # o_proj and the MLP
    per_layer = h * (heads + 2 * kv_heads) * d + past_attention
    return dict(layers=layers, heads=heads, kv_heads=kv_heads, head_dim=d, vocab=vocab, hidden=h,
                linear_params=layers * per_layer, head_params=vocab * h, past_attention_params=past_attention)


def workload_flops(dims: dict, reqs: list[Request], hit_tokens: int = 0) -> float:
    """Matmul FLOPs nanokv must do: every prompt token and every generated token but the
    last goes through the layers, except that of the prompt only the last token needs the
    last layer's o_proj and MLP; attention over its context; the LM head once per
    generated token. Prompt tokens found in the prefix cache (hit_tokens) skip the layers'
    projections."""
    flops = -2.0 * (dims["linear_params"] - dims["past_attention_params"]) * hit_tokens
    attn = 4 * dims["layers"] * dims["heads"] * dims["head_dim"]  # QK^T and PV, per (query, key)
    for r in reqs:
        computed = len(r.prompt) + r.max_tokens - 1
        flops += 2 * dims["linear_params"] * computed
        flops -= 2 * dims["past_attention_params"] * (len(r.prompt) - 1)
        flops += attn * computed * (computed + 1) / 2  # causal: query p sees p + 1 keys
        flops += 2 * dims["head_params"] * r.max_tokens
    return flops


def measured_gemm_rate(dims: dict, dtype: torch.dtype, device: torch.device) -> float:
    """FLOP/s of this machine on a model-shaped GEMM (tokens x hidden @ hidden x 3*hidden)."""
    a = torch.randn(1024, dims["hidden"], dtype=dtype, device=device)
    b = torch.randn(dims["hidden"], 3 * dims["hidden"], dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    sync(device)
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < 1.0:
        a @ b
        reps += 1
    sync(device)
    return reps * 2 * a.shape[0] * b.shape[0] * b.shape[1] / (time.perf_counter() - start)


def measured_copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (read + write)."""
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(device)
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.5:
        y.copy_(x)
        reps += 1
    sync(device)
    return reps * 2 * x.numel() / (time.perf_counter() - start)


def machine_rate(dims: dict, dtype: torch.dtype, device: torch.device) -> float:
    """The roofline's denominator: GEMM FLOP/s on the CPU, copy bytes/s on a GPU."""
    return measured_gemm_rate(dims, dtype, device) if device.type == "cpu" else measured_copy_bandwidth(device)


def roofline(dims: dict, reqs: list[Request], nanokv: Result, dtype: torch.dtype, device: torch.device,
             rate: float) -> dict:
    if device.type == "cpu":
        flops = workload_flops(dims, reqs, nanokv.extra["kv"]["prefix_hit_tokens"])
        floor = flops / rate
        return dict(kind="FLOPs / measured GEMM rate", flops=flops, rate=rate, floor_seconds=floor,
                    percent=100 * floor / nanokv.seconds)
    elem = torch.empty(0, dtype=dtype).element_size()
    weights = (dims["linear_params"] + dims["head_params"]) * elem
    kv_per_token = 2 * dims["layers"] * dims["kv_heads"] * dims["head_dim"] * elem
    steps = nanokv.extra.get("steps", 0)
    kv_read = sum(kv_per_token * (len(r.prompt) + i) for r in reqs for i in range(r.max_tokens))
    total = weights * steps + kv_read
    floor = total / rate
    return dict(kind="HBM bytes (weights per step + KV read) / measured copy bandwidth", bytes=total,
                bandwidth=rate, floor_seconds=floor, percent=100 * floor / nanokv.seconds)
