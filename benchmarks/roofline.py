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
    return dict(layers=layers, heads=heads, kv_heads=kv_heads, head_dim=d, vocab=vocab, hidden=h, intermediate=inter,
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


def _rate(fn, amount: float, device: torch.device, seconds: float = 0.3) -> float:
    """`amount` (FLOPs, bytes) per second of fn, run for about `seconds` after two warm-ups."""
    for _ in range(2):
        fn()
    sync(device)
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        reps += 1
    sync(device)
    return reps * amount / (time.perf_counter() - start)


def gemm_shapes(dims: dict) -> list[tuple[int, int]]:
    """(K, N) of the model's projections: q/k/v, o, gate/up, down, and the LM head."""
    h, d, inter = dims["hidden"], dims["head_dim"], dims["intermediate"]
    return [(h, (dims["heads"] + 2 * dims["kv_heads"]) * d), (dims["heads"] * d, h), (h, 2 * inter), (inter, h),
            (h, dims["vocab"])]


def measured_gemm_rate(dims: dict, dtype: torch.dtype, device: torch.device,
                       rows: tuple[int, ...] = (256, 1024, 4096)) -> float:
    """The machine's best GEMM FLOP/s at the model's shapes: the fastest of torch's matmul
    (its BLAS) and, on a CPU in float32, nanokv's own kernel on packed weights, over the
    model's projection shapes and `rows` tokens. A floor from a slower GEMM than the
    machine can run would let an engine beat its own roofline."""
    from nanokv import kernels

    use_kernels = device.type == "cpu" and dtype == torch.float32 and kernels.available()
    best = 0.0
    for k, n in gemm_shapes(dims):
        w = torch.randn(n, k, dtype=dtype, device=device) / k ** 0.5
        packed = kernels.pack_weight(w) if use_kernels else None
        for m in rows:
            a = torch.randn(m, k, dtype=dtype, device=device)
            out = torch.empty(m, n, dtype=dtype, device=device)
            flops = 2.0 * m * k * n
            best = max(best, _rate(lambda: torch.matmul(a, w.t(), out=out), flops, device))
            if packed is not None:
                best = max(best, _rate(lambda: kernels.linear(a, packed, out=out), flops, device))
    return best


def measured_copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (read + write)."""
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    return _rate(lambda: y.copy_(x), 2 * x.numel(), device, seconds=0.5)


def machine_rate(dims: dict, dtype: torch.dtype, device: torch.device) -> float:
    """The roofline's denominator: GEMM FLOP/s on the CPU, copy bytes/s on a GPU."""
    return measured_gemm_rate(dims, dtype, device) if device.type == "cpu" else measured_copy_bandwidth(device)


def roofline(dims: dict, reqs: list[Request], nanokv: Result, dtype: torch.dtype, device: torch.device,
             rate: float) -> dict:
    if device.type == "cpu":
        flops = workload_flops(dims, reqs, nanokv.extra["kv"]["prefix_hit_tokens"])
        floor = flops / rate
        return dict(kind="FLOPs / the best measured GEMM rate (torch or nanokv kernels, model shapes)", flops=flops, rate=rate, floor_seconds=floor,
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
