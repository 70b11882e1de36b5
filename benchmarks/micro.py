"""`bench.py --micro`: microbenchmarks instead of the workloads, one section each (host
time per decode step, phase by phase; the sampler per mode). Each section measures, prints
its own table and returns what --json prints under its name; MICRO_SECTIONS lists them in
the order --micro runs them."""

from __future__ import annotations

import json
import random
import time

import torch

from benchmarks.measure import sync
from benchmarks.workloads import SAMPLING, make_workload, workload_spec


def micro_host_time(device: torch.device, num_seqs: int = 256, context_lens: tuple[int, ...] = (40, 1000),
                    steps: int = 32, warmup: int = 5, quiet: bool = False) -> dict:
    """Host time per decode step, phase by phase, with num_seqs sequences decoding at each
    context length: the scheduler's schedule(), the runner's input preparation (prepare)
    and its attention plan (the backend's prepare), sampling (greedy, the model's vocab)
    and the engine's update (scheduler and output processor). No forward runs: what is
    left is what the host spends around it. Medians over `steps` decode steps, and the mean
    step (32 steps: two rounds of 16, in each of which every sequence starts a block once,
    whether they start them in the same step, as at short contexts, or spread out)."""
    import statistics

    from nanokv import SamplingParams
    from nanokv.engine.arg_utils import EngineArgs
    from nanokv.llm_engine import LLMEngine
    from nanokv.testing.tiny import cached_tiny_checkpoint

    budget, block_size = 4096, 16

    def new_tokens(ctx: int) -> int:  # sequences prefilled early decode while the others prefill
        return -(-num_seqs * ctx // budget) + warmup + steps + 4

    longest = max(ctx + new_tokens(ctx) for ctx in context_lens)
    model_dir = cached_tiny_checkpoint("qwen3-tiny", max_position_embeddings=max(2048, longest))
    rows = []
    for ctx in context_lens:
        blocks = num_seqs * -(-(ctx + new_tokens(ctx)) // block_size)
        config = EngineArgs(model=model_dir, device=str(device), max_model_len=longest, max_num_seqs=num_seqs,
                            max_num_batched_tokens=budget, num_kvcache_blocks=blocks,
                            kvcache_block_size=block_size, enforce_eager=True).create_engine_config()
        engine = LLMEngine(config)
        runner, sched = engine.runner, engine.scheduler
        vocab = config.hf_config.vocab_size
        rng = random.Random(ctx)
        for _ in range(num_seqs):
            prompt = [rng.randrange(4, min(vocab, 1024)) for _ in range(ctx)]
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=new_tokens(ctx), ignore_eos=True))
        logits = torch.randn(num_seqs, vocab, device=device)
        phases = {k: [] for k in ("schedule", "prepare", "plan", "sample", "update")}
        decode_steps = 0
        while decode_steps < warmup + steps:
            t0 = time.perf_counter()
            batch = sched.schedule()
            t1 = time.perf_counter()
            inputs = runner.prepare(batch)
            t2 = time.perf_counter()
            runner.backend.prepare(inputs.meta, runner.block_size)
            t3 = time.perf_counter()
            rows_n = 0 if inputs.logits_rows is None else inputs.logits_rows.shape[0]
            out = runner.sample(logits[:rows_n] if rows_n else None, batch)
            t4 = time.perf_counter()
            engine._apply(batch, out, {})
            t5 = time.perf_counter()
            if len(batch.seqs) == num_seqs and all(len(s.token_ids) == 1 for s in batch.seqs):
                decode_steps += 1
                if decode_steps > warmup:
                    for key, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                        phases[key].append(1000 * dt)
        row = dict(context=ctx, num_seqs=num_seqs, backend=config.attention_backend, vocab=vocab,
                   **{f"{k}_ms": round(statistics.median(v), 3) for k, v in phases.items()})
        row["total_ms"] = round(sum(row[f"{k}_ms"] for k in phases), 3)
        row["mean_step_ms"] = round(statistics.mean(map(sum, zip(*phases.values()))), 3)
        rows.append(row)
        engine.close()
        del engine, runner, sched
    result = dict(section="host time per decode step", device=str(device), threads=torch.get_num_threads(),
                  rows=rows)
    if not quiet:
        print(f"host time per decode step, {num_seqs} sequences decoding, median of {steps} steps "
              f"(no forward; {device}, {torch.get_num_threads()} threads, backend {rows[0]['backend']}, "
              f"greedy over vocab {rows[0]['vocab']})\n")
        print("| context | schedule | prepare | attention plan | sample | update | total (ms) | mean step (ms) |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['context']} | {r['schedule_ms']:.3f} | {r['prepare_ms']:.3f} | {r['plan_ms']:.3f} | "
                  f"{r['sample_ms']:.3f} | {r['update_ms']:.3f} | {r['total_ms']:.3f} | {r['mean_step_ms']:.3f} |")
    return result


# ---- micro: the sampler ----------------------------------------------------------------

# (column, SamplingParams fields): each mode adds to the one before, greedy aside
MICRO_SAMPLER_MODES = [
    ("greedy", dict(temperature=0)),
    ("temperature", dict(temperature=0.8)),
    ("+ top_p", dict(temperature=0.8, top_p=0.95)),
    ("+ seeds", dict(temperature=0.8, top_p=0.95, seed=True)),
    ("+ top_k", dict(temperature=0.8, top_p=0.95, seed=True, top_k=50)),
    ("+ penalties", dict(temperature=0.8, top_p=0.95, seed=True, top_k=50, repetition_penalty=1.1,
                         presence_penalty=0.3, frequency_penalty=0.3)),
    ("+ logprobs", dict(temperature=0.8, top_p=0.95, seed=True, top_k=50, repetition_penalty=1.1,
                        presence_penalty=0.3, frequency_penalty=0.3, logprobs=5)),
]


def model_logits(model_dir: str, device: torch.device, num_rows: int) -> torch.Tensor:
    """num_rows next-token logits [num_rows, vocab] the model produced while nanokv sampled
    the chat workload (temperature 0.8, top_p 0.95): a model's real distributions."""
    from nanokv import LLM, SamplingParams

    llm = LLM(model_dir, device=str(device), max_model_len=512)
    reqs = make_workload(workload_spec("chat", num_requests=32), 1000, tokenizer=llm.get_tokenizer())
    runner, rows = llm.llm_engine.runner, []
    real = runner.sample

    def sample(logits, batch):
        if logits is not None:
            rows.append(logits.float().cpu())
        return real(logits, batch)

    runner.sample = sample
    params = [SamplingParams(**SAMPLING, seed=r.seed, max_tokens=-(-num_rows // len(reqs)), ignore_eos=True)
              for r in reqs]
    llm.generate([r.prompt for r in reqs], params, use_tqdm=False)
    return torch.cat(rows)[:num_rows]


def fit_vocab(logits: torch.Tensor, vocab: int, seed: int = 0) -> torch.Tensor:
    """Rows of logits resized to vocab: cut to the first ids, or widened with extra tokens
    whose logits are drawn from the row's own lower 95% (a larger vocabulary adds rare
    tokens), the columns then shuffled."""
    if logits.shape[1] >= vocab:
        return logits[:, :vocab].contiguous()
    g = torch.Generator().manual_seed(seed)
    low = logits.sort(dim=1).values[:, :int(0.95 * logits.shape[1])]
    extra = low.gather(1, torch.randint(0, low.shape[1], (len(logits), vocab - logits.shape[1]), generator=g))
    return torch.cat([logits, extra], dim=1)[:, torch.randperm(vocab, generator=g)].contiguous()


def micro_batch(params: dict, num_rows: int, vocab: int, first_id: int, rng: random.Random):
    """One decode step of num_rows sequences (a 200-token prompt, 50 tokens generated)."""
    from nanokv import SamplingParams
    from nanokv.engine.types import ScheduledBatch, ScheduledSeq

    batch = ScheduledBatch()
    for i in range(num_rows):
        seeded = dict(params, seed=first_id + i if params.get("seed") else None)
        tokens = [rng.randrange(vocab) for _ in range(250)]
        batch.seqs.append(ScheduledSeq(first_id + i, tokens[-1:], 249, [], True, SamplingParams(**seeded),
                                       seed=seeded["seed"], num_generated=50, all_token_ids=tokens,
                                       num_prompt_tokens=200))
        batch.num_tokens += 1
    return batch


def micro_sampler(model_dir: str, label: str, device: torch.device, vocabs: list[int], num_rows: int = 256,
                  repeats: int = 3) -> list[dict]:
    """ModelRunner.sample per step (settings to tensors, sampling, tokens to the host) at
    num_rows rows for each mode of MICRO_SAMPLER_MODES, on random normal logits and on the
    model's own (fit_vocab), for each vocabulary size; on the CPU with one thread. The
    modes alternate within a round; each keeps its fastest of `repeats` rounds after a
    warm-up (wall clock, and this thread's CPU time, which other processes on the machine
    disturb less); each step is one token later than the one before (seeds and penalty
    counts move on)."""
    from nanokv import LLM
    from nanokv.testing.tiny import cached_tiny_checkpoint

    real = model_logits(model_dir, device, num_rows)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    rng = random.Random(0)
    names = [name for name, _ in MICRO_SAMPLER_MODES]
    reports = []
    try:
        for vocab in vocabs:
            llm = LLM(cached_tiny_checkpoint("qwen3-tiny", vocab_size=vocab), device=str(device), max_model_len=256,
                      max_num_seqs=num_rows, num_kvcache_blocks=16)
            runner = llm.llm_engine.runner
            kinds = {"random normal": torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(0)),
                     label: fit_vocab(real, vocab)}
            for kind, logits in kinds.items():
                logits = logits.to(device)
                batches = [micro_batch(params, num_rows, vocab, (m + 1) << 20, rng)
                           for m, (_, params) in enumerate(MICRO_SAMPLER_MODES)]
                wall, cpu = [[] for _ in batches], [[] for _ in batches]
                for _ in range(repeats + 1):
                    for i, batch in enumerate(batches):
                        step_logits = logits.clone()  # penalties and masks write into the logits
                        sync(device)
                        start, start_cpu = time.perf_counter(), time.thread_time()
                        runner.sample(step_logits, batch)
                        wall[i].append(time.perf_counter() - start)
                        cpu[i].append(time.thread_time() - start_cpu)
                        for seq in batch.seqs:  # the next step: one more generated token
                            seq.all_token_ids.append(rng.randrange(vocab))
                            seq.num_generated += 1
                best, best_cpu = [min(t[1:]) for t in wall], [min(t[1:]) for t in cpu]
                reports.append(dict(
                    vocab=vocab, logits=kind, rows=num_rows, runs=repeats, threads=torch.get_num_threads(),
                    ms_per_step={n: round(1000 * b, 2) for n, b in zip(names, best)},
                    vs_greedy={n: round(b / best[0], 2) for n, b in zip(names, best)},
                    cpu_ms_per_step={n: round(1000 * b, 2) for n, b in zip(names, best_cpu)},
                    cpu_vs_greedy={n: round(b / best_cpu[0], 2) for n, b in zip(names, best_cpu)},
                    all_ms={n: [round(1000 * x, 1) for x in t[1:]] for n, t in zip(names, wall)}))
            del llm, runner
    finally:
        torch.set_num_threads(threads)
    return reports


def print_micro_sampler(reports: list[dict]) -> None:
    names = [name for name, _ in MICRO_SAMPLER_MODES]
    added, before = [], {}
    for name, params in MICRO_SAMPLER_MODES[1:]:
        new = {k: v for k, v in params.items() if before.get(k) != v}
        added.append(f"{name}: " + ", ".join(f"{k} {'per request' if v is True else v}" for k, v in new.items()))
        before = params
    first = reports[0]
    print(f"sampler: ModelRunner.sample per step at {first['rows']} rows (200-token prompts, 50+ tokens "
          f"generated), {first['threads']} thread(s), fastest of {first['runs']} rounds, wall ms (x greedy) "
          f"and CPU ms (x greedy); each mode adds to the one before ({'; '.join(added)})\n")
    print("| vocab | logits | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for r in reports:
        cells = [f"{r['ms_per_step'][n]:.1f} ({r['vs_greedy'][n]:.2f}x), {r['cpu_ms_per_step'][n]:.1f} "
                 f"({r['cpu_vs_greedy'][n]:.2f}x)" for n in names]
        print(f"| {r['vocab']:,} | {r['logits']} | " + " | ".join(cells) + " |")


# ---- the sections -------------------------------------------------------------------------

def micro_host_time_section(args, model_dir: str, device: torch.device, quiet: bool) -> dict:
    return micro_host_time(device, quiet=quiet)


def micro_sampler_section(args, model_dir: str, device: torch.device, quiet: bool) -> list[dict]:
    vocabs = [int(v) for v in args.micro_vocabs.split(",") if v]
    reports = micro_sampler(model_dir, args.label, device, vocabs, repeats=args.micro_repeats)
    if not quiet:
        print_micro_sampler(reports)
    return reports


def micro_structured_section(args, model_dir: str, device: torch.device, quiet: bool) -> dict:
    from benchmarks.structured import micro_structured, print_micro_structured

    report = micro_structured(model_dir, device, repeats=args.micro_repeats)
    if not quiet:
        print_micro_structured(report)
    return report


# --micro's sections in the order it runs them: each measures, prints its own table unless
# quiet, and returns what --json prints under its name
MICRO_SECTIONS = {"host_time": micro_host_time_section, "sampler": micro_sampler_section,
                  "structured": micro_structured_section}


def run_micro(args, model_dir: str, device: torch.device) -> None:
    """--micro: every section of MICRO_SECTIONS, one after the other (or one JSON object)."""
    results = {}
    names = [n for n in args.micro_sections.split(",") if n]
    for i, name in enumerate(names):
        section = MICRO_SECTIONS[name]
        if i and not args.json:
            print()
        results[name] = section(args, model_dir, device, quiet=args.json)
    if args.json:
        print(json.dumps(results, indent=2, default=str))
