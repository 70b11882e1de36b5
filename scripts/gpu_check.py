"""The steps of scripts/gpu_check.sh, one subcommand each, and their record.

Every step prints its result as soon as it has it (flushed) and merges it into
$OUT/gpu_check.json, rewritten after each step, so a run cut short keeps what it
measured. With --dry-run the same steps run at toy sizes on the CPU (Triton in its
interpreter, a tiny random model) to check the plumbing without a GPU; the numbers then
mean nothing (tests/test_gpu_check.py runs it).

    python3 scripts/gpu_check.py env|checkpoint|attention|latency|agreement [--dry-run]
    python3 scripts/gpu_check.py record-tests LOG RC | record-bench NAME JSON RC | mark NAME STATUS
    python3 scripts/gpu_check.py summary
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def out_path() -> str:
    out = os.environ.get("OUT") or "/tmp/gpu_check"
    os.makedirs(out, exist_ok=True)
    return os.path.join(out, "gpu_check.json")


def load_record() -> dict:
    try:
        with open(out_path()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"steps": {}}


def record(name: str, result: dict) -> None:
    """Merge one step's result into gpu_check.json (atomically) and print it."""
    data = load_record()
    data["steps"][name] = result
    tmp = out_path() + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, default=str)
    os.replace(tmp, out_path())
    print(f"[{name}] {json.dumps(result, default=str)}", flush=True)


def say(text: str) -> None:
    print(text, flush=True)


def sizes(dry: bool) -> dict:
    """What each step measures: the issue's sizes on a GPU, toy ones for --dry-run."""
    if dry:
        return dict(shape="qwen3-tiny", dtype="float32", heads=(4, 2, 32), points=[(1, 64), (2, 40)],
                    batches=(1, 4), prompt=16, steps=4, agree_prompts=2, agree_tokens=8, num_sms=8)
    return dict(shape="qwen3-0.6b", dtype="bfloat16", heads=(16, 8, 128),
                points=[(1, 8192), (4, 8192), (16, 4096), (64, 2048), (256, 1024), (256, 4096)],
                batches=(1, 32, 256), prompt=512, steps=32, agree_prompts=8, agree_tokens=64, num_sms=None)


def model_dir(dry: bool) -> str:
    """The random-weight checkpoint every step uses: bench.py's (same cache key)."""
    import torch

    from nanokv.testing.tiny import cached_tiny_checkpoint

    s = sizes(dry)
    return cached_tiny_checkpoint(s["shape"], dtype=getattr(torch, s["dtype"]))


def device(dry: bool):
    import torch

    return torch.device("cpu" if dry else "cuda")


def sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ---- steps ------------------------------------------------------------------------------

def step_env(args) -> None:
    import torch
    import transformers

    info = dict(python=sys.version.split()[0], torch=torch.__version__, transformers=transformers.__version__,
                cuda_available=torch.cuda.is_available(), dry_run=args.dry_run)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available() and not args.dry_run:
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
    record("env", info)


def step_checkpoint(args) -> None:
    start = time.perf_counter()
    path = model_dir(args.dry_run)
    record("checkpoint", dict(path=path, seconds=round(time.perf_counter() - start, 1)))


def step_attention(args) -> None:
    """Decode paged attention (Triton) at a few (batch, context) points: GB/s of K/V read
    against the device's measured copy bandwidth, single pass and every split count."""
    import torch

    from benchmarks.roofline import measured_copy_bandwidth
    from nanokv.attention import triton_kernels as tk

    s, dev = sizes(args.dry_run), device(args.dry_run)
    dtype = getattr(torch, s["dtype"])
    hkv, d = s["heads"][1:]
    bs = 16
    sms = s["num_sms"] or torch.cuda.get_device_properties(dev).multi_processor_count
    copy = measured_copy_bandwidth(dev)
    say(f"copy bandwidth (read + write): {copy / 1e9:,.0f} GB/s")
    most = max(b * -(-ctx // bs) for b, ctx in s["points"])
    g = torch.Generator(device=dev).manual_seed(0)
    k_cache = torch.randn(most, bs, hkv, d, generator=g, device=dev).to(dtype)
    v_cache = torch.randn(most, bs, hkv, d, generator=g, device=dev).to(dtype)
    rows, errors = [], []
    say("| batch | context | auto splits | single pass | best (splits) | best GB/s | % of copy |")
    say("|---|---|---|---|---|---|---|")
    for batch, ctx in s["points"]:
        try:
            rows.append(_attention_point(tk, batch, ctx, k_cache, v_cache, s["heads"], sms, copy, g))
        except Exception as e:  # noqa: BLE001 - reported, and the step counts as failed
            errors.append(f"batch {batch}, context {ctx}: {type(e).__name__}: {e}"[:300])
            say(errors[-1])
    result = dict(copy_gb_per_s=round(copy / 1e9, 1), heads=s["heads"], dtype=s["dtype"], block_size=bs,
                  points=rows)
    if errors:
        result["error"] = errors
    record("attention", result)


def _attention_point(tk, batch, ctx, k_cache, v_cache, heads, sms, copy, g) -> dict:
    """One (batch, context) point: every split count timed; one row of the table."""
    import torch

    hq, hkv, d = heads
    dev, dtype, bs, most = k_cache.device, k_cache.dtype, k_cache.shape[1], k_cache.shape[0]
    nb = -(-ctx // bs)
    tables = torch.randperm(most, generator=g, device=dev)[:batch * nb].view(batch, nb).to(torch.int32)
    q = torch.randn(batch, hq, d, generator=g, device=dev).to(dtype)
    out = torch.empty_like(q)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    block_q = tk.tile_shape(hq, hkv, d, 1, q.element_size())[1]
    auto = tk.choose_num_splits(batch, hkv, 1, block_q, ctx, sms)
    kv_bytes = 2 * batch * ctx * hkv * d * q.element_size()
    times = {}
    for n in tk.possible_num_splits(hkv, ctx, sms):
        times[n] = _time_ms(lambda: tk.paged_attention(q, k_cache, v_cache, out, qsl, seq_lens, tables,
                                                       scale=d ** -0.5, max_query_len=1, max_seq_len=ctx,
                                                       num_sms=sms, num_splits=n), dev)
    best = min(times, key=times.get)
    gbs = kv_bytes / (times[best] / 1e3) / 1e9
    row = dict(batch=batch, context=ctx, kv_mb=round(kv_bytes / 2**20, 1), auto_splits=auto,
               ms={str(n): round(t, 4) for n, t in times.items()}, best_splits=best,
               gb_per_s={str(n): round(kv_bytes / (t / 1e3) / 1e9, 1) for n, t in times.items()},
               best_percent_of_copy=round(100 * gbs * 1e9 / copy, 1),
               auto_speed_percent_of_best=round(100 * times[best] / times[auto], 1))
    say(f"| {batch} | {ctx} | {auto} | {times[1]:.3f} ms | {times[best]:.3f} ms ({best}) | {gbs:,.0f} | "
        f"{row['best_percent_of_copy']:.0f}% |")
    return row


def _time_ms(fn, dev) -> float:
    """Median milliseconds of fn (triton's do_bench on CUDA; a few wall-clock runs on the CPU)."""
    if dev.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=40, return_mode="median")
    fn()
    runs = []
    for _ in range(2):
        start = time.perf_counter()
        fn()
        runs.append(1000 * (time.perf_counter() - start))
    return statistics.median(runs)


def step_latency(args) -> None:
    """Decode step latency at batch 1 / 32 / 256 with CUDA graphs on and off: the model
    forward (synchronised) against the wall time of a whole engine step."""
    import torch

    from nanokv import LLM

    s, dev = sizes(args.dry_run), device(args.dry_run)
    path = model_dir(args.dry_run)
    rows = []
    say("| CUDA graphs | batch | step wall (ms) | forward (ms) | outside the forward (ms) | tok/s |")
    say("|---|---|---|---|---|---|")
    errors = []
    for graphs in (True, False):
        try:  # one setting failing (a capture, say) must not hide the other
            llm = LLM(path, device=dev.type, max_model_len=s["prompt"] + s["steps"] + 16,
                      max_num_seqs=max(s["batches"]), enforce_eager=not graphs)
            for batch in s["batches"]:
                row = _decode_latency(llm, batch, s["prompt"], s["steps"])
                rows.append(dict(asked_graphs=graphs, **row))
                say(f"| {'on' if row['graphs'] else 'off'} | {batch} | {row['wall_ms']:.2f} | {row['forward_ms']:.2f} "
                    f"| {row['outside_ms']:.2f} | {row['tok_per_s']:,} |")
            llm.close()
            del llm
        except Exception as e:  # noqa: BLE001 - reported, and the step counts as failed
            errors.append(f"graphs {'on' if graphs else 'off'}: {type(e).__name__}: {e}"[:300])
            say(f"latency with graphs {'on' if graphs else 'off'} failed: {errors[-1]}")
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    result = dict(shape=s["shape"], prompt=s["prompt"], steps=s["steps"], rows=rows)
    if errors:
        result["error"] = errors
    record("latency", result)


def _decode_latency(llm, batch: int, prompt_len: int, steps: int) -> dict:
    """Median over `steps` decode steps of `batch` sequences: engine step wall time and
    the model forward's (synchronised) time."""
    from nanokv import SamplingParams

    engine = llm.llm_engine
    runner, sched = engine.runner, engine.scheduler
    rng = random.Random(batch)
    ids = [engine.add_request([rng.randrange(4, 1000) for _ in range(prompt_len)],
                              SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
           for _ in range(batch)]
    while any(seq.num_output_tokens == 0 for seq in sched.running + list(sched.waiting)):
        engine.step()  # prefill (and the first token)
    for _ in range(3):
        engine.step()  # warm
    runner.reset_timers()
    walls, forwards = [], []
    for _ in range(steps):
        before = runner.forward_seconds
        start = time.perf_counter()
        engine.step()
        walls.append(1000 * (time.perf_counter() - start))
        forwards.append(1000 * (runner.forward_seconds - before))
    for request_id in ids:
        engine.abort(request_id)
    wall, fwd = statistics.median(walls), statistics.median(forwards)
    return dict(graphs=runner.graphs is not None, batch=batch, wall_ms=round(wall, 3), forward_ms=round(fwd, 3),
                outside_ms=round(wall - fwd, 3), tok_per_s=round(1000 * batch / wall))


def step_agreement(args) -> None:
    """Greedy tokens of nanokv against transformers (teacher-forced argmax at every
    position of nanokv's own continuation), and the first token's top-5 logprobs."""
    import torch
    from transformers import AutoModelForCausalLM

    from nanokv import LLM, SamplingParams

    s, dev = sizes(args.dry_run), device(args.dry_run)
    dtype = getattr(torch, s["dtype"])
    path = model_dir(args.dry_run)
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 1000) for _ in range(rng.randint(16, 64))] for _ in range(s["agree_prompts"])]
    llm = LLM(path, device=dev.type, dtype=s["dtype"], max_model_len=256, max_num_seqs=16)
    params = SamplingParams(temperature=0, max_tokens=s["agree_tokens"], ignore_eos=True, logprobs=5)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    backend = llm.llm_engine.config.attention_backend
    llm.close()
    del llm
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(dev).eval()
    agree = total = 0
    first_divergence, logprob_err = [], 0.0
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs):
            full = torch.tensor([prompt + out.token_ids], device=dev)
            logits = hf(full).logits[0, len(prompt) - 1:-1].float()
            hf_next = logits.argmax(-1).tolist()
            same = [a == b for a, b in zip(out.token_ids, hf_next)]
            agree, total = agree + sum(same), total + len(same)
            first_divergence.append(same.index(False) if False in same else len(same))
            ref = torch.log_softmax(logits[0], -1)
            logprob_err = max(logprob_err, max(abs(lp.logprob - ref[t].item()) for t, lp in out.logprobs[0].items()))
    result = dict(shape=s["shape"], dtype=s["dtype"], backend=backend, prompts=len(prompts),
                  tokens_each=s["agree_tokens"], agreement=round(agree / total, 4),
                  first_divergence=first_divergence, max_first_token_logprob_error=round(logprob_err, 4))
    say(f"greedy agreement with transformers ({s['shape']}, {s['dtype']}, {backend}): {agree}/{total} = "
        f"{agree / total:.1%}; first divergence per prompt {first_divergence}; first-token logprob error "
        f"<= {logprob_err:.3f}")
    record("agreement", result)


def record_tests(args) -> None:
    """The gpu-marked tests' pytest log -> counts and the failures' names."""
    text = open(args.log, errors="replace").read() if os.path.exists(args.log) else ""
    counts = {}
    words = ("passed", "failed", "skipped", "error", "deselected", "collected")
    last = [line for line in text.splitlines() if " in " in line and any(w in line for w in words)]
    for part in (last[-1].strip("= ").split(" in ")[0].replace(" (", ", ").rstrip(")").split(", ") if last else []):
        n, _, what = part.partition(" ")
        if n.split("/")[0].isdigit():
            counts[what.split()[-1] if what else what] = int(n.split("/")[0])
    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in text.splitlines()
              if line.startswith(("FAILED ", "ERROR "))]
    record("gpu_tests", dict(rc=int(args.rc), counts=counts, failed=failed))


def record_bench(args) -> None:
    """A bench.py --json report -> its rows' numbers (tok/s, seconds, runs, memory)."""
    try:
        with open(args.json) as f:
            report = json.load(f)
    except (OSError, ValueError) as e:
        record(args.name, dict(rc=int(args.rc), error=f"no report: {e}"))
        return
    if "sampler" in report or "host_time" in report:  # bench.py --micro: its sections as they are
        record(args.name, dict(rc=int(args.rc), micro=report))
        return
    keep = ("engine", "output_tokens", "seconds", "tok_per_s", "runs", "note", "peak_memory_gib", "kv_pool_gib",
            "kv_used_peak_gib", "steps", "forward_seconds", "backend")
    rows = [{k: r[k] for k in keep if k in r} for r in report.get("results", [])]
    extra = {k: report[k] for k in ("ms_per_step", "outside_forward_percent", "roofline") if k in report}
    record(args.name, dict(rc=int(args.rc), workload=report.get("workload"), device=report.get("device"),
                           results=rows, **extra))


def mark(args) -> None:
    record(args.name, dict(status=args.status))


def summary(args) -> None:
    """One table of every step, and nanokv against HF generate on the nano workload."""
    steps = load_record()["steps"]
    say("\n== summary ==")
    for name, result in steps.items():
        status = result.get("status") or ("ok" if result.get("rc", 0) == 0 and "error" not in result else "failed")
        say(f"- {name}: {status}")
    nano, hf = steps.get("nano_nanokv", {}), steps.get("nano_hf", {})
    rate = {r["engine"]: r["tok_per_s"] for s in (nano, hf) for r in s.get("results", []) if r.get("tok_per_s")}
    if "nanokv" in rate and "HF generate" in rate:
        ratio = rate["nanokv"] / rate["HF generate"]
        runs = next((r.get("runs") for r in nano["results"] if r["engine"] == "nanokv"), None)
        say(f"nano workload: nanokv {rate['nanokv']:,.0f} tok/s (runs, cold then warm: {runs} s), HF generate "
            f"{rate['HF generate']:,.0f} tok/s: {ratio:.2f}x")
        record("nano_ratio", dict(nanokv_tok_per_s=rate["nanokv"], hf_tok_per_s=rate["HF generate"],
                                  ratio=round(ratio, 2)))
    # a step that failed, timed out or never ran (budget spent) leaves the check incomplete
    incomplete = [n for n, r in steps.items() if r.get("rc", 0) != 0 or "error" in r or "status" in r]
    sys.exit(1 if incomplete or steps.get("gpu_tests", {}).get("failed") else 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, fn in (("env", step_env), ("checkpoint", step_checkpoint), ("attention", step_attention),
                     ("latency", step_latency), ("agreement", step_agreement)):
        q = sub.add_parser(name)
        q.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU")
        q.set_defaults(fn=fn)
    q = sub.add_parser("record-tests")
    q.add_argument("log")
    q.add_argument("rc")
    q.set_defaults(fn=record_tests)
    q = sub.add_parser("record-bench")
    q.add_argument("name")
    q.add_argument("json")
    q.add_argument("rc")
    q.set_defaults(fn=record_bench)
    q = sub.add_parser("mark")
    q.add_argument("name")
    q.add_argument("status")
    q.set_defaults(fn=mark)
    q = sub.add_parser("summary")
    q.set_defaults(fn=summary)
    args = p.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
