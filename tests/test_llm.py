"""The LLM API: input forms, output fields, and user errors that raise ValueError and
leave the engine usable."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from nanokv import LLM, RequestOutput, SamplingParams
from nanokv.testing.tiny import GENERATION_EOS_TOKEN_IDS

from .conftest import hf_greedy, random_prompts


GREEDY = SamplingParams(temperature=0, max_tokens=8)


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


# ---- input forms and outputs ----------------------------------------------------------

def test_prompt_forms_and_output_fields(llm):
    tok = llm.get_tokenizer()
    text = "Beautiful is better than ugly."
    ids = tok(text).input_ids
    single = llm.generate(text, GREEDY, use_tqdm=False)
    assert len(single) == 1 and isinstance(single[0], RequestOutput)
    out = single[0]
    assert out.prompt == text and out.prompt_token_ids == ids and out.finished
    (completion,) = out.outputs
    assert completion.index == 0 and completion.finish_reason in ("stop", "length")
    assert completion.text == tok.decode(completion.token_ids, skip_special_tokens=True)
    assert isinstance(out.request_id, str)

    as_ids = llm.generate(ids, GREEDY, use_tqdm=False)  # one prompt as token ids
    assert len(as_ids) == 1 and as_ids[0].prompt is None
    assert as_ids[0].outputs[0].token_ids == completion.token_ids

    many = llm.generate([text, ids, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in many] == [completion.token_ids] * 3
    assert llm.generate([], GREEDY, use_tqdm=False) == []


def test_outputs_in_input_order_with_per_prompt_params(llm):
    prompts = random_prompts([40, 3, 25, 1, 9], 1024, seed=11)
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (2, 9, 4, 7, 1)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    for o, p in zip(outs, params):
        assert len(o.outputs[0].token_ids) <= p.max_tokens
        if o.outputs[0].finish_reason == "length":
            assert len(o.outputs[0].token_ids) == p.max_tokens


def test_eos_ids_are_the_union_of_config_and_generation_config(llm):
    assert set(llm.llm_engine.config.eos_token_ids) == set(GENERATION_EOS_TOKEN_IDS)


def test_max_tokens_is_clamped_to_max_model_len(model_dir):
    small = LLM(model_dir, max_model_len=32)
    (prompt,) = random_prompts([28], 1024, seed=5)
    out = small.generate(prompt, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    unbounded = small.generate(prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
    assert len(unbounded.token_ids) == 4 and unbounded.finish_reason == "length"


def test_sampling_is_seeded_and_valid(model_dir):
    prompts = random_prompts([5, 12], 1024, seed=2)
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    runs = [[o.outputs[0].token_ids for o in LLM(model_dir, seed=3).generate(prompts, params, use_tqdm=False)]
            for _ in range(2)]
    assert runs[0] == runs[1]
    other = [o.outputs[0].token_ids for o in LLM(model_dir, seed=4).generate(prompts, params, use_tqdm=False)]
    greedy = [o.outputs[0].token_ids for o in LLM(model_dir, seed=3).generate(
        prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)]
    assert other != runs[0] and greedy != runs[0]  # the seed and the temperature both matter


def test_progress_bar_reports_throughput(llm, capsys):
    llm.generate(random_prompts([30, 4], 1024), GREEDY, use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "tok/s" in err


# ---- user errors: ValueError, nothing half-done, engine still usable --------------------

@pytest.mark.parametrize("kwargs", [
    dict(temperature=-0.5), dict(temperature=float("nan")), dict(max_tokens=0),
    dict(max_tokens=2.5), dict(stop_token_ids=[-1]),
])
def test_bad_sampling_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def assert_usable(llm):
    bm = llm.llm_engine.block_manager
    assert not llm.llm_engine.has_unfinished() and bm.num_free_blocks == bm.num_blocks
    out = llm.generate([1, 2, 3], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1


@pytest.mark.parametrize("bad, match", [
    (list(range(4, 600)), "max_model_len"),  # 596 tokens > max_model_len 512
    (list(range(4, 516)), "max_model_len"),  # exactly max_model_len: no room to generate
    ([], "empty"),
    ("", "empty"),
    ([5, 6, 5000], "vocabulary"),
    ([5, -1], "vocabulary"),
    (3.5, "prompt"),
])
def test_bad_prompt_in_a_batch_raises_before_any_work(llm, bad, match):
    before = llm.llm_engine.runner.kv_cache.clone()
    with pytest.raises(ValueError, match=match):
        llm.generate([[5, 6, 7], bad], GREEDY, use_tqdm=False)
    assert (llm.llm_engine.runner.kv_cache == before).all()  # nothing ran
    assert_usable(llm)


def test_sampling_params_list_length_must_match(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[5], [6]], [GREEDY], use_tqdm=False)
    assert_usable(llm)


def test_add_request_rejects_bad_input_and_keeps_serving(llm):
    engine = llm.llm_engine
    good = engine.add_request([5, 6, 7, 8], GREEDY)
    with pytest.raises(ValueError):
        engine.add_request([9999999], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1], GREEDY, request_id=good)
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    assert [o.request_id for o in finished] == [good]


def test_abort(llm):
    engine = llm.llm_engine
    rid = engine.add_request(list(range(4, 100)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort(rid)
    assert not engine.has_unfinished()
    assert_usable(llm)


def test_close_frees_the_kv_pool_at_once(model_dir):
    """The engine holds reference cycles, so `del llm` leaves its pool to the garbage
    collector; close() frees it now (the default CPU pool is 4 GiB) and refuses later work."""
    import gc
    import weakref

    gc.disable()  # nothing but close() may free it here
    try:
        llm = LLM(model_dir, max_model_len=256, kv_cache_memory_bytes=8 << 20)
        out = llm.generate(["Hello"], GREEDY, use_tqdm=False)
        pool = weakref.ref(llm.llm_engine.runner.kv_cache)
        llm.close()
        assert pool() is None
        with pytest.raises(RuntimeError, match="this LLM is closed"):
            llm.generate(["Hello"], GREEDY, use_tqdm=False)
        assert LLM(model_dir, max_model_len=256, kv_cache_memory_bytes=8 << 20).generate(
            ["Hello"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == out[0].outputs[0].token_ids
    finally:
        gc.enable()


def test_pool_too_small_for_max_model_len(model_dir):
    with pytest.raises(ValueError, match="num_kvcache_blocks"):
        LLM(model_dir, max_model_len=512, num_kvcache_blocks=10)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        LLM(model_dir, max_model_len=512, kv_cache_memory_bytes=1000)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_model_len=10**6), "max_position_embeddings"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(kvcache_block_size=0), "kvcache_block_size"),
    (dict(dtype="float8"), "dtype"),
    (dict(device="tpu"), "device"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
])
def test_bad_engine_arguments(model_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(model_dir, **kwargs)


def test_unknown_architecture(model_dir, tmp_path):
    d = copy_checkpoint(model_dir, tmp_path / "m")
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["MambaForCausalLM"]
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        LLM(d)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))


def test_directory_without_weights(model_dir, tmp_path):
    d = copy_checkpoint(model_dir, tmp_path / "m")
    for name in os.listdir(d):
        if name.endswith(".safetensors"):
            os.remove(os.path.join(d, name))
    with pytest.raises(ValueError, match="safetensors"):
        LLM(d)


def test_missing_and_unexpected_tensors_are_named(model_dir, tmp_path):
    src = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(src)
    missing_dir = copy_checkpoint(model_dir, tmp_path / "missing")
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.weight"},
              os.path.join(missing_dir, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        LLM(missing_dir)
    extra_dir = copy_checkpoint(model_dir, tmp_path / "extra")
    save_file({**tensors, "model.layers.0.mlp.extra_proj.weight": tensors["model.norm.weight"].clone()},
              os.path.join(extra_dir, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected.*extra_proj"):
        LLM(extra_dir)
    wrong_dir = copy_checkpoint(model_dir, tmp_path / "wrong")
    save_file({**tensors, "model.norm.weight": tensors["model.norm.weight"][:10]},
              os.path.join(wrong_dir, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape"):
        LLM(wrong_dir)


# ---- checkpoint variants beyond the three test shapes -----------------------------------

@pytest.mark.parametrize("shape, overrides", [
    ("llama3-tiny", dict(num_key_value_heads=1, tie_word_embeddings=True)),  # MQA, tied
    ("qwen3-tiny", dict(num_attention_heads=8, num_key_value_heads=8, head_dim=16,
                        tie_word_embeddings=False)),  # MHA, small head_dim, untied
    ("qwen2-tiny", dict(rope_theta=1000.0, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    ("llama3-tiny", dict(max_shard_size="60KB")),  # sharded with an index file
    # head_dim 12: no C attention kernel (needs a multiple of 8), torch attention instead
    ("qwen3-tiny", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=12)),
    ("llama3-tiny", dict(attention_bias=True, mlp_bias=True)),  # biases through the GEMM kernel
])
def test_checkpoint_variants_equal_hf(checkpoint, shape, overrides):
    d = checkpoint(shape, **overrides)
    if "max_shard_size" in overrides:
        assert os.path.isfile(os.path.join(d, "model.safetensors.index.json"))
    prompts = random_prompts([1, 17, 40, 90], 1024, seed=4)
    max_tokens = [12, 6, 9, 14]
    expected = hf_greedy(d, prompts, max_tokens, GENERATION_EOS_TOKEN_IDS)
    outs = LLM(d, kvcache_block_size=8).generate(
        prompts, [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens], use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs] == expected
