"""Structured outputs' costs: `--workload structured` (the same requests with and without a
10-field JSON schema, output tokens/s of each) with the first-request compile time of a
20-property schema, and `--micro`'s `structured` section (per step at 256 rows: building the
mask rows from grammar matchers, applying them in the sampler, next to the sampler without)."""

from __future__ import annotations

import json
import time

import torch

from benchmarks.measure import sync
from benchmarks.workloads import SAMPLING, chat_prompt, make_workload

_FIELDS = [("name", {"type": "string", "maxLength": 40}), ("age", {"type": "integer"}),
           ("email", {"type": "string", "maxLength": 40}), ("city", {"type": "string", "maxLength": 30}),
           ("active", {"type": "boolean"}), ("score", {"type": "number"}),
           ("tags", {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}),
           ("level", {"enum": ["bronze", "silver", "gold"]}), ("id", {"type": "integer"}),
           ("joined", {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"})]


def json_schema(num_fields: int = 10) -> dict:
    """An object schema of num_fields required properties (strings, numbers, booleans, an
    enum, an array, a pattern; past the first ten, more of the same kinds)."""
    props = {}
    for i in range(num_fields):
        name, kind = _FIELDS[i % len(_FIELDS)]
        props[name if i < len(_FIELDS) else f"{name}_{i // len(_FIELDS)}"] = kind
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def _example(schema: dict, i: int) -> str:
    """A JSON text valid against json_schema's schemas (the i-th of a few variants)."""
    values = {"string": f"value {i}", "integer": 40 + i, "boolean": i % 2 == 0, "number": 3.5 + i}
    out = {}
    for name, kind in schema["properties"].items():
        if "enum" in kind:
            out[name] = kind["enum"][i % len(kind["enum"])]
        elif "pattern" in kind:
            out[name] = f"20{10 + i % 10}-0{1 + i % 9}-1{i % 10}"
        elif kind["type"] == "array":
            out[name] = [f"tag{j}" for j in range(i % 4)]
        else:
            out[name] = values[kind["type"]]
    return json.dumps(out, separators=(",", ":"))  # compact, as the grammar writes JSON by default


def compile_times(model_dir: str, num_fields: int = 20) -> dict:
    """Milliseconds of a fresh engine's first structured request: llguidance's tokenizer for
    the model (once per engine), then the schema's compile (validated and cached at the
    request) and its first matcher and mask (the first step)."""
    from transformers import AutoConfig, AutoTokenizer

    from nanokv.grammar import GrammarCompiler
    from nanokv.sampling_params import StructuredOutputsParams

    hf = AutoTokenizer.from_pretrained(model_dir)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    compiler = GrammarCompiler(hf, vocab, [hf.eos_token_id])
    t0 = time.perf_counter()
    compiler.tokenizer  # noqa: B018  (built on first use)
    t1 = time.perf_counter()
    grammar = compiler.compile(StructuredOutputsParams(json=json_schema(num_fields)))
    t2 = time.perf_counter()
    compiler.constraint(grammar, None).row([0], 1)
    t3 = time.perf_counter()
    return dict(properties=num_fields, tokenizer_ms=round(1000 * (t1 - t0), 1),
                compile_ms=round(1000 * (t2 - t1), 1), first_mask_ms=round(1000 * (t3 - t2), 1),
                first_request_ms=round(1000 * (t3 - t1), 1))


def run_structured(name: str, model_dir: str, label: str, spec: dict, device: torch.device, args) -> dict:
    """The workload's requests (chat prompts asking for a JSON record, SAMPLING, a seed each,
    EOS ignored: every request generates its max_tokens, so both runs do the same work) on
    one engine, constrained by a 10-field JSON schema and not, alternating for args.repeats
    rounds; each keeps its fastest. The constrained outputs are checked to parse while the
    schema is unfinished (a row that completes its schema emits EOS to its max_tokens)."""
    from nanokv import LLM, SamplingParams
    from nanokv.sampling_params import StructuredOutputsParams

    schema = json_schema(10)
    llm = LLM(model_dir, device=str(device), max_num_seqs=max(args.max_num_seqs, spec["num_requests"]),
              max_model_len=1024, enforce_eager=args.enforce_eager)
    tokenizer = llm.get_tokenizer()
    reqs = make_workload(dict(spec, chat=True), 0, args.seed, tokenizer)
    ask = ("Reply with one JSON object describing a fictional library member, with these fields: "
           + ", ".join(schema["properties"]) + ".")
    prompts = [chat_prompt(tokenizer, f"{ask} Example {i}.") for i in range(len(reqs))]
    so = StructuredOutputsParams(json=schema)

    def params(constrained: bool):
        return [SamplingParams(**SAMPLING, seed=r.seed, max_tokens=r.max_tokens, ignore_eos=True,
                               structured_outputs=so if constrained else None) for r in reqs]

    llm.generate(prompts[:2], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)  # warm-up
    best = {}
    valid = complete = 0
    for _ in range(args.repeats):
        for constrained in (False, True):
            sync(device)
            start = time.perf_counter()
            outs = llm.generate(prompts, params(constrained), use_tqdm=False)
            sync(device)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            key = "constrained" if constrained else "unconstrained"
            if key not in best or seconds < best[key]["seconds"]:
                best[key] = dict(output_tokens=tokens, seconds=round(seconds, 2), tok_per_s=round(tokens / seconds, 1))
            if constrained:
                valid = sum(_parses(o.outputs[0].text) for o in outs)
                complete = sum(_complete(o.outputs[0].text) for o in outs)
    llm.close()
    ratio = best["constrained"]["tok_per_s"] / best["unconstrained"]["tok_per_s"]
    return dict(workload=name, structured=True, model=label, num_requests=len(reqs), output_lens=list(spec["output"]),
                sampling=SAMPLING, device=str(device), threads=torch.get_num_threads(), runs=args.repeats,
                schema_fields=10, results=best, ratio=round(ratio, 3), constrained_outputs_parsing=valid,
                constrained_outputs_complete=complete,
                compile=compile_times(model_dir, 20))


def _complete(text: str) -> bool:
    """Whether text is a whole JSON object (its schema finished before max_tokens)."""
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _parses(text: str) -> bool:
    """Whether text is a JSON object (a finished output: the schema's text, then EOS tokens
    that decode to nothing) or the start of one cut by max_tokens."""
    text = text.strip()
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return text.startswith("{")


def print_structured(report: dict) -> None:
    r = report["results"]
    print(f"structured outputs: {report['num_requests']} requests at once, {report['model']}, "
          f"{report['device']} ({report['threads']} threads), sampled {report['sampling']}, EOS ignored, outputs "
          f"{report['output_lens'][0]}-{report['output_lens'][1]} tokens, fastest of {report['runs']} rounds; "
          f"constrained: a {report['schema_fields']}-field JSON schema ({report['constrained_outputs_parsing']}/"
          f"{report['num_requests']} outputs JSON or its start, {report['constrained_outputs_complete']} finished "
          f"before max_tokens)\n")
    print("| requests | output tokens | unconstrained tok/s | constrained tok/s | ratio |")
    print("|---|---|---|---|---|")
    print(f"| {report['num_requests']} | {r['constrained']['output_tokens']} | {r['unconstrained']['tok_per_s']} | "
          f"{r['constrained']['tok_per_s']} | {report['ratio']:.2f} |")
    c = report["compile"]
    print(f"\nfirst request with a {c['properties']}-property schema: {c['first_request_ms']} ms (compile "
          f"{c['compile_ms']} ms + first mask {c['first_mask_ms']} ms); llguidance's tokenizer, once per engine: "
          f"{c['tokenizer_ms']} ms")


# ---- micro: the mask per step ------------------------------------------------------------

def micro_structured(model_dir: str, device: torch.device, num_rows: int = 256, steps: int = 8,
                     repeats: int = 3) -> dict:
    """Per decode step at num_rows rows, each constrained by a 10-field JSON schema and
    generating a valid record token by token: the runner's mask build (build_masks: every
    row's matcher advanced one token, the masks computed into [rows, words]), then the sampler
    (greedy, and sampled at temperature 0.8 / top_p 0.95) with those masks and without, on
    one thread. Fastest of `repeats` rounds of `steps` steps (after a warm-up), per step."""
    from transformers import AutoConfig, AutoTokenizer

    from nanokv.engine.types import ScheduledSeq
    from nanokv.grammar import GrammarCompiler
    from nanokv.layers.sampler import Sampler, SamplingTensors
    from nanokv.runner.model_runner import build_masks
    from nanokv.sampling_params import SamplingParams, StructuredOutputsParams

    hf = AutoTokenizer.from_pretrained(model_dir)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    compiler = GrammarCompiler(hf, vocab, [hf.eos_token_id])
    schema = json_schema(10)
    grammar = compiler.compile(StructuredOutputsParams(json=schema))
    texts = [hf.encode(_example(schema, i), add_special_tokens=False) for i in range(8)]
    prompt = [hf.eos_token_id]
    rows, ends = [], []
    for i in range(num_rows):  # each row at its own point of its record
        text = texts[i % len(texts)]
        start = (i * 7) % max(1, len(text) - (repeats + 1) * steps - 1)
        seq = ScheduledSeq(i, [0], 0, [], True, SamplingParams(temperature=0), constraint=compiler.constraint(grammar, None),
                           all_token_ids=prompt + text[:start], num_prompt_tokens=1)
        rows.append(seq)
        ends.append(text)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        masked = list(range(num_rows))
        build, masks = [], None
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            for _ in range(steps):
                for s, text in zip(rows, ends):  # one more token of its record
                    n = len(s.all_token_ids) - 1
                    if n < len(text):
                        s.all_token_ids.append(text[n])
                masks = build_masks(rows, masked, vocab).to(device)
            build.append((time.perf_counter() - t0) / steps)
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(num_rows, vocab, generator=g, device=device) * 3
        sampler = Sampler()
        results = {}
        for mode, temperature in (("greedy", 0.0), ("sampled", 0.8)):
            for name, with_mask in (("unconstrained", False), ("masked", True)):
                t = SamplingTensors(torch.full((num_rows,), temperature), all_greedy=temperature == 0,
                                    top_p=None if temperature == 0 else torch.full((num_rows,), 0.95),
                                    mask_rows=torch.arange(num_rows, device=device) if with_mask else None,
                                    mask=masks if with_mask else None)
                times = []
                for _ in range(repeats + 1):
                    step_logits = logits.clone()
                    sync(device)
                    t0 = time.perf_counter()
                    sampler(step_logits, t, g)
                    sync(device)
                    times.append(time.perf_counter() - t0)
                results[f"{mode}_{name}_ms"] = round(1000 * min(times[1:]), 2)
    finally:
        torch.set_num_threads(threads)
    # every row walked a record the grammar writes (else its matcher erred and gave EOS-only rows)
    assert not any(s.constraint.matcher.is_error() for s in rows), "a record the grammar does not write"
    allowed = sum(bin(w & 0xFFFFFFFF).count("1") for w in masks.flatten().tolist()) / num_rows
    return dict(section="structured outputs' mask per step", rows=num_rows, vocab=vocab, threads=1,
                schema_fields=10, mean_allowed_tokens=round(allowed, 1), build_ms=round(1000 * min(build[1:]), 2),
                **results)


def print_micro_structured(r: dict) -> None:
    print(f"structured outputs' mask per step: {r['rows']} rows, vocab {r['vocab']:,}, each row a "
          f"{r['schema_fields']}-field JSON schema's matcher one token further every step (on average "
          f"{r['mean_allowed_tokens']} tokens allowed), {r['threads']} thread, fastest of the rounds, ms\n")
    print("| build rows | greedy | greedy + mask | sampled | sampled + mask |")
    print("|---|---|---|---|---|")
    print(f"| {r['build_ms']:.2f} | {r['greedy_unconstrained_ms']:.2f} | {r['greedy_masked_ms']:.2f} | "
          f"{r['sampled_unconstrained_ms']:.2f} | {r['sampled_masked_ms']:.2f} |")
