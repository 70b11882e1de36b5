"""The one switch between the C kernels and torch (nanokv/layers/custom_op.py): decided
once per model at build, nothing compiled before, every layer with a C path on the same
side of it, and a fallback to torch when the kernels do not build."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nanokv import LLM, SamplingParams, kernels
from nanokv.layers.custom_op import CustomOp

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="no C compiler: CPU kernels not built")


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return out


@needs_kernels
@pytest.mark.slow
def test_building_a_config_loads_nothing(model_dir, tmp_path):
    """EngineArgs.create_engine_config picks the cpu backend by looking for a compiler, and
    only begins the kernels' build in the background (a first start compiles while the
    config and tokenizer load): no library is loaded until the kernels are asked for, and
    the process asking for them gets the one library."""
    cache = tmp_path / "cache"
    code = (
        "from nanokv import kernels\n"
        "from nanokv.engine.arg_utils import EngineArgs\n"
        f"config = EngineArgs(model={model_dir!r}).create_engine_config()\n"
        "print(config.attention_backend, kernels.ffi.load.cache_info().currsize)\n"
    )
    out = run_python(code, NANOKV_CACHE_DIR=str(cache))
    assert out.stdout.split() == ["cpu", "0"]
    run_python("from nanokv import kernels\nassert kernels.available()\n", NANOKV_CACHE_DIR=str(cache))
    assert len(list(cache.rglob("*.so"))) == 1


@pytest.mark.parametrize("on", [True, False], ids=["cpu-kernels", "torch"])
def test_every_layer_follows_the_one_choice(model_dir, monkeypatch, on):
    if on and not kernels.available():
        pytest.skip("no C compiler: CPU kernels not built")
    if not on:
        monkeypatch.setenv("NANOKV_CPU_KERNELS", "0")
    llm = LLM(model_dir, max_model_len=128)
    runner = llm.llm_engine.runner
    choice = runner.kernels
    assert (choice.cpu, choice.fused_layers, choice.attention_backend) == ((True, True, "cpu") if on else
                                                                           (False, False, "torch"))
    assert llm.llm_engine.config.attention_backend == runner.backend.name == choice.attention_backend
    ops = [m for m in runner.model.modules() if isinstance(m, CustomOp)]
    assert {type(m).__name__ for m in ops} == {"RMSNorm", "PackedLinear", "GateUpLinear", "RowParallelLinear",
                                               "LMHead", "DecoderAttention", "MLP", "DecoderModel",
                                               "VocabParallelEmbedding"}
    tied = runner.model.lm_head.tied
    for m in ops:
        assert m.cpu_kernels == on, type(m).__name__
        c_path = on and (tied or type(m).__name__ != "VocabParallelEmbedding")  # it reads a tied head's rows
        assert (m.forward.__func__ is type(m).forward_native) != c_path, type(m).__name__  # bound once, at build
        if hasattr(m, "packed"):
            assert (m.packed is not None) == on, type(m).__name__
    assert (runner.model.model.fused_layers is not None) == on


@needs_kernels
@pytest.mark.slow
def test_kernels_that_do_not_build_fall_back_to_torch(model_dir, monkeypatch, tmp_path):
    """A compiler that is found but fails: auto still resolves to the cpu backend (nothing
    compiled then); building the model falls back to torch, warns, and gives the tokens
    the torch path gives."""
    prompts = [[(5 * i + j) % 900 + 4 for j in range(n)] for i, n in enumerate([3, 17, 40])]
    code = (
        "import json\n"
        "from nanokv import LLM, SamplingParams\n"
        f"llm = LLM({model_dir!r}, max_model_len=128)\n"
        "runner = llm.llm_engine.runner\n"
        "outs = llm.generate(" + repr(prompts) + ", SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)\n"
        "print(json.dumps([llm.llm_engine.config.attention_backend, runner.backend.name, runner.kernels.cpu,\n"
        "                  runner.model.lm_head.packed is None, [o.outputs[0].token_ids for o in outs]]))\n"
    )
    out = run_python(code, CC="/bin/false", NANOKV_CACHE_DIR=str(tmp_path))
    assert "CPU kernels unavailable, using the torch path" in out.stderr
    configured, backend, cpu, unpacked, tokens = json.loads(out.stdout.strip().splitlines()[-1])
    assert (configured, backend, cpu, unpacked) == ("cpu", "torch", False, True)
    monkeypatch.setenv("NANOKV_CPU_KERNELS", "0")
    torch_llm = LLM(model_dir, max_model_len=128)
    expected = torch_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    assert tokens == [o.outputs[0].token_ids for o in expected]


@pytest.mark.parametrize("env", [dict(CC="/nonexistent/cc"), dict(NANOKV_CPU_KERNELS="0")],
                         ids=["no-compiler", "switched-off"])
def test_an_explicit_cpu_backend_that_cannot_build_is_refused(model_dir, monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"C compiler.*attention_backend='torch'"):
        LLM(model_dir, attention_backend="cpu")
