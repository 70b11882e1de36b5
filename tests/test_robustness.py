"""Nothing lost, nothing wedged: bad values stop at add_request with a ValueError naming
the field, a request that fails inside a step fails alone, every consumer gets exactly
its own outputs, Ctrl-C at any point leaves the engine clean, and bad checkpoints are
refused at load naming the file."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import threading
import time

import numpy as np
import pytest

from nanokv import LLM, SamplingParams
from nanokv.engine.block_manager import BlockManager

from .conftest import hf_greedy, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = random_prompts([5, 17, 30, 2, 11], 1024, seed=31)


def greedy_ids(llm, prompts=PROMPTS, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_clean(engine):
    assert not engine.has_unfinished() and not engine._requests
    kv = engine.kv_stats()
    assert kv.used_blocks == 0 and kv.free_blocks == kv.num_blocks


@pytest.fixture(scope="module")
def reference(llm):
    return greedy_ids(llm)


# ---- values that passed validation and crashed the sampler ---------------------------

# (SamplingParams kwargs, the field the message must name); vocab is 1024, max_logprobs 20
SAMPLER_BOUNDS = [
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=5000), "logprobs"),
    (dict(top_k=2**63), "top_k"),
    (dict(top_k=1025), "top_k"),
    (dict(stop_token_ids=[1024], min_tokens=2), "stop_token_ids"),
    (dict(stop_token_ids=[10**9]), "stop_token_ids"),
    (dict(seed=2**64), "seed"),
    (dict(temperature=float("inf"), min_tokens=1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(n=2**40), "n"),
]


@pytest.mark.parametrize("kwargs, field", SAMPLER_BOUNDS)
def test_sampler_bounds_raise_value_error_through_llm_and_add_request(llm, reference, kwargs, field):
    def make():
        return SamplingParams(max_tokens=4, **kwargs)

    with pytest.raises(ValueError, match=field):
        llm.generate(PROMPTS[0], make(), use_tqdm=False)
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=field):
        engine.add_request(PROMPTS[0], make())
    assert_clean(engine)
    assert greedy_ids(llm) == reference  # the engine goes on serving


def test_eos_ids_outside_the_vocab_are_dropped(model_dir, tmp_path, caplog):
    bad = tmp_path / "bad-eos"
    shutil.copytree(model_dir, bad)
    path = bad / "generation_config.json"
    config = json.loads(path.read_text())
    config["eos_token_id"] = [0, 3, 5000]
    path.write_text(json.dumps(config))
    llm = LLM(str(bad), max_model_len=128)
    assert set(llm.llm_engine.config.eos_token_ids) == {0, 3}
    assert "5000" in caplog.text
    # min_tokens bans the EOS ids for the first tokens: an id outside the vocab crashed here
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.7, seed=1, max_tokens=6, min_tokens=3),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 3


# ---- a request that fails inside a step fails alone ----------------------------------

POISON_SEED = 666


@pytest.fixture
def poisoned(llm, monkeypatch):
    """Make the runner raise whenever a step holds a sampling row with the poison seed:
    a request that passed validation but breaks the step it is in."""
    runner = llm.llm_engine.runner
    real = runner._sampling_tensors

    def sampling_tensors(rows, vocab, *step):
        if any(s.seed == POISON_SEED for s in rows):
            raise IndexError("poisoned row")
        return real(rows, vocab, *step)

    monkeypatch.setattr(runner, "_sampling_tensors", sampling_tensors)
    return llm


def test_a_failing_request_fails_alone_in_the_step_api(poisoned, reference):
    engine = poisoned.llm_engine
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS[:2]]
    bad = engine.add_request(PROMPTS[2], SamplingParams(seed=POISON_SEED, max_tokens=8))
    ids += [engine.add_request(p, GREEDY) for p in PROMPTS[3:]]
    outputs = {}
    for _ in range(100):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            outputs[out.request_id] = out
    assert set(outputs) == set(ids) | {bad}
    assert [outputs[i].outputs[0].token_ids for i in ids] == reference[:2] + reference[3:]
    assert all(outputs[i].error is None for i in ids)
    failed = outputs[bad]
    assert failed.finished and "poisoned row" in failed.error
    assert failed.outputs[0].finish_reason == "error"
    assert_clean(engine)


def test_a_failing_request_fails_alone_in_generate(poisoned, reference):
    params = [GREEDY] * len(PROMPTS)
    params[1] = SamplingParams(seed=POISON_SEED, max_tokens=8, n=2)
    outs = poisoned.generate(PROMPTS, params, use_tqdm=False)
    assert [o.error is not None for o in outs] == [False, True, False, False, False]
    assert [o.outputs[0].token_ids for i, o in enumerate(outs) if i != 1] == reference[:1] + reference[2:]
    assert [c.finish_reason for c in outs[1].outputs] == ["error", "error"]
    assert_clean(poisoned.llm_engine)


# ---- prompts that are not text, and the error types of every surface ----------------

def test_invalid_text_is_a_value_error(llm):
    with pytest.raises(ValueError, match="surrogate"):
        llm.generate("\ud800", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="surrogate"):
        llm.generate({"prompt": "ok \udfff"}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="surrogate"):
        llm.chat([{"role": "user", "content": "hi \ud800"}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="surrogate"):
        llm.llm_engine.add_request("\ud83d", GREEDY)
    assert_clean(llm.llm_engine)


@pytest.mark.parametrize("call, match", [
    (lambda llm: llm.chat({"role": "user", "content": "Hi"}), "list"),
    (lambda llm: llm.chat("Hello"), "chat"),
    (lambda llm: llm.chat([]), "list"),
    (lambda llm: llm.chat([{"content": "no role"}]), "role"),
    (lambda llm: llm.chat([{"role": "user", "content": 5}]), "content"),
    (lambda llm: llm.generate(None), "prompts"),
    (lambda llm: llm.generate(5), "prompts"),
    (lambda llm: llm.generate(["hi"], {"temperature": 0}), "SamplingParams"),
    (lambda llm: llm.generate(["hi"], "greedy"), "SamplingParams"),
    (lambda llm: llm.generate([[5, 2.0, 7]]), "ints"),
    (lambda llm: llm.generate([[5, True]]), "ints"),
    (lambda llm: llm.generate({"prompt_token_ids": "abc"}), "prompt_token_ids"),
    (lambda llm: llm.generate([[5, 99999]]), "vocabulary"),
    (lambda llm: llm.generate([[5, -1]]), "vocabulary"),
    (lambda llm: llm.generate([object()]), "prompt"),
    (lambda llm: llm.stream("hi", SamplingParams(n=2)), "n=2"),
])
def test_user_errors_are_value_errors_naming_the_fix(llm, call, match):
    with pytest.raises(ValueError, match=match):
        result = call(llm)
        if hasattr(result, "__next__"):
            next(result)
    assert_clean(llm.llm_engine)


@pytest.mark.parametrize("kwargs, match", [
    (dict(stop=5), "stop"), (dict(stop=[""]), "stop"), (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(stop_token_ids=[1.5]), "stop_token_ids"), (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(top_p=0), r"top_p must be in \(0, 1\]"), (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"),
])
def test_sampling_params_errors_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_numpy_token_ids_and_seed_none_work(model_dir, llm, reference):
    assert greedy_ids(llm, [np.array(PROMPTS[0])]) == reference[:1]
    assert greedy_ids(llm, [[np.int64(t) for t in PROMPTS[1]]]) == reference[1:2]
    unseeded = LLM(model_dir, seed=None, max_model_len=128)  # vLLM allows it: not reproducible
    assert greedy_ids(unseeded) == reference


# ---- silent wrong output -------------------------------------------------------------

def test_tiny_temperatures_are_greedy(llm, reference):
    for t in (1e-39, 1e-6, 5e-324):
        params = SamplingParams(temperature=t, max_tokens=8, ignore_eos=True, min_tokens=2)
        assert greedy_ids(llm, params=params) == reference


@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "gelu", "relu"])
@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["cpu-kernels", "torch"])
def test_hidden_act_is_honoured(checkpoint, monkeypatch, act, cpu_kernels):
    if not cpu_kernels:
        monkeypatch.setenv("NANOKV_CPU_KERNELS", "0")
    model_dir = checkpoint("llama3-tiny", hidden_act=act)
    prompts = random_prompts([3, 20, 9], 1024, seed=4)
    expected = hf_greedy(model_dir, prompts, [8] * 3, [])
    llm = LLM(model_dir, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert [(o.outputs[0].token_ids, "length") for o in llm.generate(prompts, params, use_tqdm=False)] == expected


def test_unknown_hidden_act_is_refused(checkpoint, tmp_path):
    bad = tmp_path / "bad-act"
    shutil.copytree(checkpoint("llama3-tiny"), bad)
    config = json.loads((bad / "config.json").read_text())
    config["hidden_act"] = "swiglu_typo"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="hidden_act.*swiglu_typo.*gelu"):
        LLM(str(bad))


# ---- one owner per request's outputs --------------------------------------------------

def test_generate_keeps_outputs_of_requests_added_through_the_engine(llm, reference):
    engine = llm.llm_engine
    own = engine.add_request(PROMPTS[0], GREEDY)
    assert greedy_ids(llm, PROMPTS[1:]) == reference[1:]
    outputs = []
    for _ in range(50):
        outputs += engine.step()
        if not engine.has_unfinished():
            break
    assert [(o.request_id, o.outputs[0].token_ids) for o in outputs] == [(own, reference[0])]
    assert_clean(engine)


def test_two_streams_iterated_together_and_generate_inside_a_stream(llm, reference):
    tok = llm.get_tokenizer()
    texts = [tok.decode(ids) for ids in reference]
    streams = [llm.stream(PROMPTS[0], GREEDY), llm.stream(PROMPTS[1], GREEDY)]
    pieces: list[list[str]] = [[], []]
    live = [0, 1]
    while live:  # one piece from each in turn
        for i in list(live):
            piece = next(streams[i], None)
            if piece is None:
                live.remove(i)
            else:
                pieces[i].append(piece)
    assert ["".join(p) for p in pieces] == texts[:2]

    got = []
    for i, piece in enumerate(llm.stream(PROMPTS[2], GREEDY)):
        got.append(piece)
        if i == 0:  # a whole generate() inside the stream loop
            assert greedy_ids(llm, PROMPTS[3:]) == reference[3:]
    assert "".join(got) == texts[2]
    assert_clean(llm.llm_engine)


def test_an_abandoned_stream_frees_its_request(llm):
    stream = llm.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    next(stream)
    stream.close()
    assert_clean(llm.llm_engine)


# ---- Ctrl-C at any point ----------------------------------------------------------------

def test_interrupt_inside_admission_leaves_the_engine_clean(llm, reference, monkeypatch):
    """A KeyboardInterrupt raised between taking a request off the queue and admitting it
    (here from allocate, on its k-th call: the five admissions), or while the decode step
    grows its block tables (append_blocks), must not leave it half queued."""
    for name, k in (("allocate", 1), ("allocate", 2), ("allocate", 3), ("allocate", 5), ("append_blocks", 1)):
        real = getattr(BlockManager, name)
        calls = []

        def interrupted(self, *args, real=real, k=k, **kwargs):
            calls.append(1)
            if len(calls) == k:
                raise KeyboardInterrupt
            return real(self, *args, **kwargs)

        monkeypatch.setattr(BlockManager, name, interrupted)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        monkeypatch.setattr(BlockManager, name, real)
        assert_clean(llm.llm_engine)
    assert greedy_ids(llm) == reference


def test_random_sigints_during_generate_leave_the_engine_clean(model_dir):
    """A few dozen real SIGINTs at random moments of a busy generate (small token budget:
    admission every step); the engine is clean after each and then still exact."""
    # Python's own SIGINT handler, whatever an earlier test in the process left installed
    # (in the full suite, run after the others, no SIGINT became a KeyboardInterrupt)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _random_sigints(model_dir)
    finally:
        signal.signal(signal.SIGINT, previous)


def _random_sigints(model_dir):
    llm = LLM(model_dir, max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4)
    prompts = random_prompts([3, 9, 14, 5, 7, 12, 2, 6] * 3, 1024, seed=8)
    expected = greedy_ids(llm, prompts)
    rng = random.Random(0)
    start = time.monotonic()
    interrupted = 0
    main = threading.main_thread().ident
    for _ in range(30):
        if time.monotonic() - start > 60:
            break
        timer = threading.Timer(rng.uniform(0.0, 0.05), signal.pthread_kill, (main, signal.SIGINT))
        timer.start()
        try:
            llm.generate(prompts, GREEDY, use_tqdm=False)
            time.sleep(0.1)  # a late signal lands here, not in the next round
        except KeyboardInterrupt:
            interrupted += 1
        finally:
            timer.join()
        assert_clean(llm.llm_engine)
    assert interrupted >= 5
    assert greedy_ids(llm, prompts) == expected


# ---- checkpoints refused at load, naming the file --------------------------------------

def test_missing_tokenizer_files_are_refused(model_dir, tmp_path):
    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(os.path.join(model_dir, name), bare / name)
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(str(bare))


def test_truncated_shard_and_bad_generation_config_name_the_file(model_dir, tmp_path):
    torn = tmp_path / "torn"
    shutil.copytree(model_dir, torn)
    weights = torn / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(str(torn))
    bad = tmp_path / "bad-gen"
    shutil.copytree(model_dir, bad)
    (bad / "generation_config.json").write_text('{"eos_token_id": [0, 3')
    with pytest.raises(ValueError, match="generation_config.json"):
        LLM(str(bad))
