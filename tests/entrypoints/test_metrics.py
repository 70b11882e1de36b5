"""`nanokv serve`'s /metrics against vLLM's own definitions (vllm/v1/metrics/loggers.py,
PrometheusStatLogger, written out here from its source rather than read from nanokv),
parsed with prometheus_client: every name, type, label set and bucket; the series a vLLM
Grafana dashboard and the Gateway API inference extension read; exact counts after known
requests, a non-streamed request's time to first token included; and
usage.prompt_tokens_details.cached_tokens with --enable-prompt-tokens-details."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from .conftest import metrics, serve, wait_idle  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "tiny"
MAX_LEN = 256
BLOCK = 16
L = {"model_name", "engine"}

# vLLM's buckets, from its source
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
        80.0, 160.0, 640.0, 2560.0]
TPOT = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
           960.0, 1920.0, 7680.0]
TOKENS = [1, 2, 5, 10, 20, 50, 100, 200]  # build_1_2_5_buckets(max_model_len=256)

# name -> (type, labels, buckets)
VLLM = {
    "vllm:num_requests_running": ("gauge", L, None),
    "vllm:num_requests_waiting": ("gauge", L, None),
    "vllm:kv_cache_usage_perc": ("gauge", L, None),
    "vllm:gpu_cache_usage_perc": ("gauge", L, None),  # deprecated in vLLM; its Grafana example reads it
    "vllm:prefix_cache_queries": ("counter", L, None),
    "vllm:prefix_cache_hits": ("counter", L, None),
    "vllm:num_preemptions": ("counter", L, None),
    "vllm:prompt_tokens": ("counter", L, None),
    "vllm:generation_tokens": ("counter", L, None),
    "vllm:request_success": ("counter", L | {"finished_reason"}, None),
    "vllm:request_prompt_tokens": ("histogram", L, TOKENS),
    "vllm:request_generation_tokens": ("histogram", L, TOKENS),
    "vllm:iteration_tokens_total": ("histogram", L, [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                                     16384]),
    "vllm:request_max_num_generation_tokens": ("histogram", L, TOKENS),
    "vllm:request_params_n": ("histogram", L, [1, 2, 5, 10, 20]),
    "vllm:request_params_max_tokens": ("histogram", L, TOKENS),
    "vllm:time_to_first_token_seconds": ("histogram", L, TTFT),
    "vllm:inter_token_latency_seconds": ("histogram", L, TPOT),
    "vllm:time_per_output_token_seconds": ("histogram", L, TPOT),  # deprecated; the Grafana example reads it
    "vllm:request_time_per_output_token_seconds": ("histogram", L, TPOT),
    "vllm:e2e_request_latency_seconds": ("histogram", L, LATENCY),
    "vllm:request_queue_time_seconds": ("histogram", L, LATENCY),
    "vllm:request_inference_time_seconds": ("histogram", L, LATENCY),
    "vllm:request_prefill_time_seconds": ("histogram", L, LATENCY),
    "vllm:request_decode_time_seconds": ("histogram", L, LATENCY),
    "vllm:cache_config_info": ("gauge", None, None),  # labels: the cache config's fields and engine
    "vllm:lora_requests_info": ("gauge", {"max_lora", "waiting_lora_adapters", "running_lora_adapters"}, None),
}

# the series vLLM's examples/online_serving/prometheus_grafana/grafana.json queries, and those
# the Gateway API inference extension's endpoint picker reads
DASHBOARD = ["vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
             "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
             "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
             "vllm:time_per_output_token_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
             "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
             "vllm:time_to_first_token_seconds_count", "vllm:gpu_cache_usage_perc",
             "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
             "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
             "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
             "vllm:request_max_num_generation_tokens_sum"]
GATEWAY = ["vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
           "vllm:gpu_cache_usage_perc", "vllm:lora_requests_info", "vllm:cache_config_info"]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    yield from serve(model_dir, "--served-model-name", MODEL, "--max-model-len", str(MAX_LEN), "--block-size", str(BLOCK),
               "--enable-prompt-tokens-details", log_path=str(tmp_path_factory.mktemp("server") / "log"))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)


def families(server) -> dict:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_every_vllm_metric_has_vllms_type_labels_and_buckets(server, client):
    client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2)  # every histogram has a series
    wait_idle(server.url)
    got = families(server)
    for name, (kind, labels, buckets) in VLLM.items():
        assert name in got, name
        family = got[name]
        assert family.type == kind, name
        assert family.samples, name
        for s in family.samples:
            if kind == "counter":
                assert s.name in (name + "_total", name + "_created"), s.name
            keys = set(s.labels) - {"le"}
            assert labels is None or keys == labels, (name, keys)
            if labels == L:
                assert (s.labels["model_name"], s.labels["engine"]) == (MODEL, "0")
        if buckets is not None:
            bounds = [float(s.labels["le"]) for s in family.samples if s.name == name + "_bucket"]
            assert bounds == [float(b) for b in buckets] + [float("inf")], name
    info = got["vllm:cache_config_info"].samples[0]
    assert info.value == 1 and info.labels["block_size"] == str(BLOCK) and info.labels["engine"] == "0"
    assert int(info.labels["num_gpu_blocks"]) == metrics(server.url)["nanokv:kv_cache_total_blocks"]
    reasons = {s.labels["finished_reason"] for s in got["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort", "error"}
    series = {s.name for f in got.values() for s in f.samples}
    assert not [n for n in DASHBOARD + GATEWAY if n not in series]
    assert "process_resident_memory_bytes" in series and "process_cpu_seconds_total" in series
    assert not [n for n in got if n.startswith("nanokv:") and n.replace("nanokv:", "vllm:") in VLLM]


def test_kv_pool_reserved_and_committed_bytes(server, client):
    """The CPU pool is reserved whole and committed by the blocks used so far: the tiny
    model's block is 16 tokens of 2 layers x K, V x 2 heads x 32 float32 = 16 KiB."""
    block_bytes = BLOCK * 2 * 2 * 2 * 32 * 4
    client.completions.create(model=MODEL, prompt=list(range(300, 300 + 5 * BLOCK)), max_tokens=1)
    m = wait_idle(server.url)
    total, reserved = m["nanokv:kv_cache_total_blocks"], m["nanokv:kv_cache_reserved_bytes"]
    committed = m["nanokv:kv_cache_committed_bytes"]
    assert reserved == (total + 1) * block_bytes  # and the runner's scratch block
    assert committed % block_bytes == 0 and 5 * block_bytes <= committed <= total * block_bytes
    assert committed < reserved / 4  # a few requests touched a small part of the pool


def test_counts_after_known_requests_include_a_non_streamed_first_token(server, client):
    before = wait_idle(server.url)
    prompt = list(range(700, 723))  # 23 new tokens: no prefix hit
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (23, 6)
    after = wait_idle(server.url)

    def delta(name: str) -> float:
        return after[name] - before[name]

    assert delta("vllm:prompt_tokens_total") == 23 and delta("vllm:generation_tokens_total") == 6
    assert delta("vllm:prefix_cache_queries_total") == 23 and delta("vllm:prefix_cache_hits_total") == 0
    assert delta("vllm:request_success_total{finished_reason=length}") == 1
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds"):
        assert delta(f"vllm:{name}_count") == 1, name
    assert delta("vllm:inter_token_latency_seconds_count") == 0  # not streamed
    assert delta("vllm:request_prompt_tokens_sum") == 23 and delta("vllm:request_generation_tokens_sum") == 6
    assert delta("vllm:request_params_max_tokens_sum") == 6 and delta("vllm:request_params_n_sum") == 1
    assert delta("vllm:request_max_num_generation_tokens_sum") == 6
    assert delta("vllm:iteration_tokens_total_sum") == 23 + 5  # the prompt, then a decode per later token
    assert delta("vllm:request_prompt_tokens_bucket{le=20.0}") == 0
    assert delta("vllm:request_prompt_tokens_bucket{le=50.0}") == 1


def test_cached_tokens_in_usage(server, client):
    prefix = list(range(500, 500 + 2 * BLOCK))
    first = client.completions.create(model=MODEL, prompt=prefix + [7, 8, 9], max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=MODEL, prompt=prefix + [10, 11], max_tokens=2)
    assert second.usage.prompt_tokens_details.cached_tokens == 32
    two = client.completions.create(model=MODEL, prompt=[prefix + [12], list(range(600, 620))], max_tokens=2)
    assert two.usage.prompt_tokens_details.cached_tokens == 32  # summed over the prompts
    usage = [c.usage for c in client.completions.create(model=MODEL, prompt=prefix + [13, 14], max_tokens=2,
                                                         stream=True, stream_options={"include_usage": True})
             if c.usage]
    assert [u.prompt_tokens_details.cached_tokens for u in usage] == [32]
    chat = [{"role": "user", "content": "a shared question about the KV cache " * 4}]
    runs = [client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2) for _ in range(2)]
    n = runs[0].usage.prompt_tokens
    assert n > BLOCK and runs[1].usage.prompt_tokens_details.cached_tokens == min(n // BLOCK * BLOCK, n - 1)
    usage = [c.usage for c in client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2, stream=True,
                                                              stream_options={"include_usage": True}) if c.usage]
    assert [u.prompt_tokens_details.cached_tokens for u in usage] == [min(n // BLOCK * BLOCK, n - 1)]
