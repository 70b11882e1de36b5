"""The llama.cpp batch-decode driver's scheduling (benchmarks/peers/llamacpp_batch.py),
against a fake backend: what llama.cpp is asked to decode, not how fast it is."""

from __future__ import annotations

import random

import torch

from benchmarks.peers.llamacpp_batch import generate, schedule, Sequence
from benchmarks.roofline import gemm_shapes, measured_gemm_rate, model_dims


class FakeLlama:
    """Records every batch; a sequence's next token is a function of what it was fed, so
    a token fed twice, skipped or fed at the wrong position changes the outputs."""

    def __init__(self, n_batch: int):
        self.n_batch, self.fed, self.batches, self.released = n_batch, {}, [], []

    def new_sampler(self, seed):
        return {"seed": seed}

    def decode(self, rows):
        assert 0 < len(rows) <= self.n_batch
        self.batches.append(rows)
        self.last = {}
        for i, (token, position, seq, logits) in enumerate(rows):
            fed = self.fed.setdefault(seq, [])
            assert position == len(fed), (seq, position, len(fed))
            fed.append(token)
            if logits:
                self.last[i] = seq

    def sample(self, sampler, row):
        seq = self.last[row]
        return (sum(self.fed[seq]) * 31 + len(self.fed[seq])) % 1000

    def release(self, seq, sampler):
        self.released.append(seq)
        del self.fed[seq]


def reference(prompt, max_tokens):
    fed, out = list(prompt), []
    for _ in range(max_tokens):
        out.append((sum(fed) * 31 + len(fed)) % 1000)
        fed.append(out[-1])
    return out


def test_every_request_gets_its_tokens_within_the_batch_and_slot_limits():
    rng = random.Random(0)
    requests = [dict(prompt=[rng.randrange(1000) for _ in range(rng.randint(1, 300))],
                     max_tokens=rng.randint(1, 20), seed=i) for i in range(40)]
    fake = FakeLlama(n_batch=128)
    outputs = generate(fake, requests, slots=8, n_batch=128)
    assert outputs == [reference(r["prompt"], r["max_tokens"]) for r in requests]
    assert len(fake.released) == 40 and not fake.fed  # every sequence freed once, its KV dropped
    assert all(len({seq for _, _, seq, _ in rows}) <= 8 for rows in fake.batches)
    assert all(0 <= seq < 8 for rows in fake.batches for _, _, seq, _ in rows)


def test_decodes_go_first_and_a_long_prompt_is_chunked():
    active = {0: Sequence(0, list(range(10)), 5), 1: Sequence(1, [7], 5, position=3), 2: Sequence(2, [9], 5, position=8)}
    rows = schedule(active, n_batch=6)
    assert [(t, p, s) for t, p, s, _ in rows] == [(7, 3, 1), (9, 8, 2), (0, 0, 0), (1, 1, 0), (2, 2, 0), (3, 3, 0)]
    assert [row for row in rows if row[3]] == [(7, 3, 1, True), (9, 8, 2, True)]  # the prompt is not all in yet
    assert active[0].row == -1 and active[0].pending == list(range(4, 10)) and active[0].position == 4
    rows = schedule({0: active[0]}, n_batch=6)
    assert rows[-1] == (9, 9, 0, True) and active[0].row == 5


def test_the_roofline_rate_is_at_least_each_gemm_it_measures(monkeypatch):
    """The floor's rate is the best over torch and nanokv's kernels at the model's shapes:
    never below what torch's matmul gets on any of them."""
    import types

    cfg = types.SimpleNamespace(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=16, intermediate_size=96, vocab_size=256)
    dims = model_dims(cfg)
    assert gemm_shapes(dims) == [(64, 128), (64, 64), (64, 192), (96, 64), (64, 256)]
    rates = []
    import benchmarks.roofline as roofline

    real = roofline._rate
    monkeypatch.setattr(roofline, "_rate",
                        lambda fn, flops, device, seconds=0.3: rates.append(real(fn, flops, device, 0.01)) or rates[-1])
    best = measured_gemm_rate(dims, torch.float32, torch.device("cpu"), rows=(8, 32))
    assert best == max(rates) and len(rates) in (10, 20)  # 5 shapes x 2 row counts, torch (and the kernels)
