"""A step's grammar masks built together (nanokv.grammar.fill_masks: matchers advanced, then
their masks on llguidance's thread pool) and begun on a thread while the model runs
(runner._start_masks): the same words as each row's own row(), the same outputs as
building them after the forward. On the tiny checkpoint's tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nanokv import LLM, SamplingParams
from nanokv.constraints import TokenConstraint
from nanokv.grammar import GrammarCompiler, fill_masks
from nanokv.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_fill_masks_gives_each_rows_own_words(model_dir, tokenizer):
    """Rows of several kinds side by side, step after step: grammar rows at different points
    of their output (advanced several tokens at once, rolled back when the output shrinks),
    a grammar ANDed with allowed_token_ids, one whose AND leaves nothing (EOS only), a
    finished one (EOS only) and a plain TokenConstraint: fill_masks writes, row by row, the
    words a twin constraint's row() gives for the same tokens."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    eos = tokenizer.eos_token_id
    compiler = GrammarCompiler(tokenizer, vocab, [eos])
    grammar = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    record = tokenizer.encode(json.dumps({"name": "Al", "age": 7, "ok": True}), add_special_tokens=False)
    digits = tokenizer.encode("0123456789", add_special_tokens=False)

    def make():
        return [compiler.constraint(grammar, None), compiler.constraint(grammar, None),
                compiler.constraint(grammar, TokenConstraint(vocab, allowed=record + digits + [eos])),
                compiler.constraint(grammar, TokenConstraint(vocab, allowed=digits)),  # nothing left: EOS
                compiler.constraint(grammar, None), TokenConstraint(vocab, bad_ids=[[record[0]]])]

    batched, own = make(), make()
    prompt = [eos, eos]
    words = (vocab + 31) // 32
    eos_only = None
    for step, lengths in enumerate([(0, 3, 0, 0, len(record), 0), (1, 5, 2, 0, len(record), 1),
                                    (4, 2, 3, 1, len(record), 2), (len(record), 4, 5, 1, len(record), 3)]):
        tokens = [prompt + record[:n] for n in lengths]
        out = np.full((len(tokens), words), -1, dtype=np.int32)
        fill_masks([(c, t, len(prompt)) for c, t in zip(batched, tokens)], out)
        for k, (c, t) in enumerate(zip(own, tokens)):
            assert out[k].view(np.uint32).tolist() == list(c.row(t, len(prompt))), (step, k)
        eos_only = [1 << (eos % 32) if w == eos // 32 else 0 for w in range(words)]
        assert out[3].view(np.uint32).tolist() == eos_only  # the AND left nothing
    assert out[4].view(np.uint32).tolist() == eos_only  # the record is complete: EOS only
    assert len({tuple(r) for r in out[:3].tolist()}) == 3  # three different points of the grammar


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, max_model_len=512, kv_cache_memory_bytes=64 << 20)


def test_masks_begun_during_the_forward_give_the_same_outputs(llm, monkeypatch):
    """Structured requests (greedy, seeded with n = 2, one with allowed_token_ids too, beside
    an unconstrained one) give the same tokens whether the masks are built on a thread
    while the model runs or after the forward; the thread did build them."""
    import nanokv.runner.model_runner as model_runner

    spec = StructuredOutputsParams(json=SCHEMA)
    params = [SamplingParams(temperature=0, max_tokens=24, structured_outputs=spec),
              SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=24, structured_outputs=spec),
              SamplingParams(temperature=0, max_tokens=24, allowed_token_ids=list(range(300)) + [2],
                             structured_outputs=StructuredOutputsParams(json_object=True)),
              SamplingParams(temperature=0.8, seed=1, max_tokens=24)]
    prompts = ["A person:", "Someone else:", "An object:", "Free text:"]
    built = []
    real = model_runner._MasksAhead.__init__

    def counting(self, *args):
        built.append(1)
        real(self, *args)

    monkeypatch.setattr(model_runner._MasksAhead, "__init__", counting)
    outs = {}
    for ahead in (False, True):
        monkeypatch.setattr(model_runner, "MASKS_AHEAD", ahead)
        built.clear()
        outs[ahead] = [[list(c.token_ids) for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert bool(built) == ahead
    assert outs[True] == outs[False]
    assert all(t for o in outs[True] for t in o)
