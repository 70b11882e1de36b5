"""`nanokv generate` / `nanokv merge`: JSONL in and out, equal to LLM.generate, resume
after a kill or a torn line, bad lines in the errors file, ids checked before work
starts, and a 2-process torchrun run equal to a 1-process one."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from nanokv import LLM, SamplingParams
from nanokv.cli import errors_path, main, part_path, scan_ids
from nanokv.llm import render_chat
from nanokv.llm_engine import LLMEngine

from .conftest import random_prompts

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = ["Beautiful is better than ugly.", "Explicit is better than implicit.", "Simple is better",
         "Flat is better than nested.", "Sparse", "Readability counts.", "Errors should never pass",
         "In the face of ambiguity, refuse the temptation to guess.", "Now is better than never.",
         "Namespaces are one honking great idea"]
CHATS = [[{"role": "user", "content": "Hello there"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]]
TOKEN_PROMPTS = random_prompts([5, 17, 2], 1024, seed=7)
GREEDY = ["--temperature", "0", "--max-tokens", "8", "--no-progress"]


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir)


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def by_id(path) -> dict:
    records = read_jsonl(path)
    result = {r["id"]: r for r in records}
    assert len(result) == len(records), "an id appears twice"
    return result


def generate(model_dir, inp, out, *flags) -> int:
    return main(["generate", "--model", model_dir, "--input", str(inp), "--output", str(out), *flags])


def mixed_rows():
    rows = [{"id": f"text-{i}", "prompt": t} for i, t in enumerate(TEXTS)]
    rows += [{"id": f"chat-{i}", "messages": m} for i, m in enumerate(CHATS)]
    rows += [{"id": 100 + i, "prompt_token_ids": p} for i, p in enumerate(TOKEN_PROMPTS)]
    return rows


def reference(llm, rows, params):
    """What LLM.generate gives for the rows' prompts, keyed by id."""
    prompts = [render_chat(llm.get_tokenizer(), r["messages"]) if "messages" in r
               else r.get("prompt", r.get("prompt_token_ids")) for r in rows]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return {r["id"]: o for r, o in zip(rows, outs)}


def assert_matches(records, expected):
    assert set(records) == set(expected)
    for rid, out in expected.items():
        rec, c = records[rid], out.outputs[0]
        assert (rec["text"], rec["token_ids"], rec["finish_reason"], rec["stop_reason"]) == \
            (c.text, c.token_ids, c.finish_reason, c.stop_reason), rid
        assert rec["num_prompt_tokens"] == len(out.prompt_token_ids)
        assert rec["num_completion_tokens"] == len(c.token_ids)


# ---- one process, in-process main() -----------------------------------------------------

def test_greedy_output_equals_llm_generate_and_window_bounds_requests(model_dir, llm, tmp_path, monkeypatch):
    rows = mixed_rows()
    inp = write_jsonl(tmp_path / "in.jsonl", rows[:5] + [""] + rows[5:])  # a blank line is skipped
    in_flight = []
    add = LLMEngine.add_request

    def counting_add(self, *a, **kw):
        in_flight.append(len(self._requests) + 1)
        return add(self, *a, **kw)

    monkeypatch.setattr(LLMEngine, "add_request", counting_add)
    out = tmp_path / "out.jsonl"
    assert generate(model_dir, inp, out, *GREEDY, "--window", "3", "--max-num-seqs", "2") == 0
    assert max(in_flight) == 3 and len(in_flight) == len(rows)
    assert not os.path.exists(errors_path(str(out)))
    records = by_id(out)
    assert_matches(records, reference(llm, rows, SamplingParams(temperature=0, max_tokens=8)))
    assert records["text-0"]["line"] == 1 and records["text-5"]["line"] == 7  # after the blank line
    assert set(records["text-0"]) == {"id", "line", "text", "token_ids", "finish_reason", "stop_reason",
                                      "num_prompt_tokens", "num_completion_tokens"}


def test_per_line_sampling_params_override_the_flags(model_dir, llm, tmp_path):
    overrides = [{"max_tokens": 3}, {"n": 2, "logprobs": 2}, {"stop_token_ids": [17], "min_tokens": 1},
                 {"max_tokens": 5, "ignore_eos": True}]
    rows = [{"id": i, "prompt": TEXTS[i], "sampling_params": o} for i, o in enumerate(overrides)]
    rows.append({"id": "plain", "prompt": TEXTS[5]})
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    assert generate(model_dir, inp, out, *GREEDY) == 0
    records = by_id(out)
    for row in rows:
        params = SamplingParams(**{"temperature": 0, "max_tokens": 8, **row.get("sampling_params", {})})
        expected = llm.generate(row["prompt"], params, use_tqdm=False)[0]
        rec = records[row["id"]]
        if params.n == 1:
            assert_matches({row["id"]: rec}, {row["id"]: expected})
            continue
        assert [o["index"] for o in rec["outputs"]] == [0, 1]
        for got, c in zip(rec["outputs"], expected.outputs):
            assert (got["text"], got["token_ids"]) == (c.text, c.token_ids)
            assert got["cumulative_logprob"] == pytest.approx(c.cumulative_logprob, abs=1e-4)
            # batch composition moves logprobs in the last float bits
            assert [[(e["token_id"], pytest.approx(e["logprob"], abs=1e-4), e["rank"], e["decoded_token"])
                     for e in entry] for entry in got["logprobs"]] == \
                [[(tid, lp.logprob, lp.rank, lp.decoded_token) for tid, lp in entry.items()] for entry in c.logprobs]
    assert len(records[0]["token_ids"]) == 3 and len(records[3]["token_ids"]) == 5


def test_bad_lines_go_to_the_errors_file_and_good_lines_succeed(model_dir, tmp_path, capsys):
    long_prompt = " ".join(["word"] * 40)
    rows = [{"id": "ok-1", "prompt": TEXTS[0]},
            '{"id": "torn", "prompt": "no end',  # invalid JSON: the id is unknown
            {"id": "empty", "prompt": ""},
            {"id": "long", "prompt": long_prompt},
            {"id": "temp", "prompt": TEXTS[1], "sampling_params": {"temperature": -1}},
            {"id": "unknown-key", "prompt": TEXTS[1], "sampling_params": {"beam_width": 4}},
            {"id": "two-forms", "prompt": "a", "prompt_token_ids": [5]},
            {"id": "vocab", "prompt_token_ids": [5, 99999]},
            {"id": "bad-messages", "messages": "hi"},
            "[1, 2, 3]",  # JSON, but no object
            {"id": "ok-2", "prompt_token_ids": TOKEN_PROMPTS[0]}]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    flags = [*GREEDY, "--max-model-len", "32"]
    assert generate(model_dir, inp, out, *flags) == 3
    assert set(by_id(out)) == {"ok-1", "ok-2"}
    errors = read_jsonl(tmp_path / "out.errors.jsonl")
    assert [(e["id"], e["line"]) for e in errors] == [
        (None, 2), ("empty", 3), ("long", 4), ("temp", 5), ("unknown-key", 6), ("two-forms", 7),
        ("vocab", 8), ("bad-messages", 9), (None, 10)]
    reasons = {e["line"]: e["error"] for e in errors}
    assert "invalid JSON" in reasons[2] and "empty" in reasons[3] and "max_model_len" in reasons[4]
    assert "temperature" in reasons[5] and "beam_width" in reasons[6] and "vocabulary" in reasons[8]
    assert "2 generated, 9 failed" in capsys.readouterr().err

    # resume: recorded errors are not retried, nothing is redone
    before = (out.read_bytes(), (tmp_path / "out.errors.jsonl").read_bytes())
    assert generate(model_dir, inp, out, *flags) == 3
    assert (out.read_bytes(), (tmp_path / "out.errors.jsonl").read_bytes()) == before
    # --retry-errors with a longer max_model_len: the long prompt now succeeds and leaves the errors file
    assert generate(model_dir, inp, out, *GREEDY, "--retry-errors") == 3
    assert set(by_id(out)) == {"ok-1", "ok-2", "long"}
    assert [e["line"] for e in read_jsonl(tmp_path / "out.errors.jsonl")] == [2, 3, 5, 6, 7, 8, 9, 10]


def test_duplicate_and_missing_ids_are_rejected_before_work_starts(model_dir, tmp_path, capsys):
    rows = [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "a", "prompt": "z"},
            {"prompt": "no id"}, {"id": 1.5, "prompt": "float id"}, {"id": "b", "prompt": "w"}]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    assert generate(model_dir, inp, out, *GREEDY) == 2
    err = capsys.readouterr().err
    assert '"a" on lines 1, 3' in err and '"b" on lines 2, 6' in err and "lines 4" in err and "1.5" in err
    assert not out.exists()

    inp3 = write_jsonl(tmp_path / "in3.jsonl", rows[:4] + [""])
    assert scan_ids(inp3, allow_duplicate_ids=True, id_from_line=True)[:4] == ["a", "b", "a#2", 4]
    inp2 = write_jsonl(tmp_path / "in2.jsonl", rows[:4] + [{"id": "a#2", "prompt": "clash"}])
    with pytest.raises(ValueError, match='"a#2" on lines 3, 5'):
        scan_ids(inp2, allow_duplicate_ids=True, id_from_line=True)
    assert generate(model_dir, inp3, out, *GREEDY, "--allow-duplicate-ids", "--id-from-line") == 0
    assert set(by_id(out)) == {"a", "b", "a#2", 4}


def test_torn_last_line_is_removed_and_redone(model_dir, llm, tmp_path, capsys):
    rows = mixed_rows()
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    assert generate(model_dir, inp, out, *GREEDY) == 0
    full = out.read_bytes()
    lines = full.splitlines(keepends=True)
    for torn in (lines[-1][:len(lines[-1]) // 2], lines[-1][:-1]):  # half a record; a record without newline
        out.write_bytes(b"".join(lines[:-3]) + torn)
        assert generate(model_dir, inp, out, *GREEDY) == 0
        assert "torn" in capsys.readouterr().err
        assert by_id(out) == {json.loads(line)["id"]: json.loads(line) for line in lines}


def test_sampled_output_does_not_depend_on_batching_or_resume(model_dir, tmp_path):
    """Lines without a seed get one from (--seed, id), so a resumed run samples the same."""
    inp = write_jsonl(tmp_path / "in.jsonl", mixed_rows())
    sampled = ["--temperature", "1.0", "--top-p", "0.9", "--max-tokens", "8", "--no-progress"]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert generate(model_dir, inp, a, *sampled) == 0
    b.write_bytes(b"".join(a.read_bytes().splitlines(keepends=True)[::3]))
    assert generate(model_dir, inp, b, *sampled, "--max-num-seqs", "2", "--window", "2") == 0
    assert by_id(a) == by_id(b)


def test_merge_appends_parts_once_and_removes_them(model_dir, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", mixed_rows() + ['{"bad json'])
    ref = tmp_path / "ref.jsonl"
    assert generate(model_dir, inp, ref, *GREEDY) == 3
    records = ref.read_bytes().splitlines(keepends=True)
    out = tmp_path / "out.jsonl"
    # a merge killed after appending: the output holds some records, the parts still hold them
    out.write_bytes(b"".join(records[:4]))
    for rank in range(2):
        part = b"".join(records[rank::2])
        with open(part_path(str(out), rank, 2), "wb") as f:
            f.write(part + (b'{"id": "text-1", "li' if rank else b""))  # torn tail: skipped
    os.rename(tmp_path / "ref.errors.jsonl", part_path(errors_path(str(out)), 1, 2))
    assert main(["merge", "--output", str(out), "--world-size", "2"]) == 3
    assert by_id(out) == by_id(ref)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "out.errors.jsonl", "out.jsonl", "ref.jsonl"]
    assert [e["line"] for e in read_jsonl(tmp_path / "out.errors.jsonl")] == [len(records) + 1]


# ---- subprocesses: kill and resume, python -m nanokv under torchrun ---------------------

def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("RANK", None), env.pop("WORLD_SIZE", None), env.pop("LOCAL_RANK", None)
    return env


def test_kill_mid_run_and_resume_gives_every_id_once(model_dir, llm, tmp_path):
    rows = [{"id": f"p{i}", "prompt_token_ids": p} for i, p in enumerate(random_prompts([3, 9, 5] * 20, 1024, seed=3))]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    flags = ["--temperature", "0", "--max-tokens", "24", "--ignore-eos", "--max-num-seqs", "1", "--window", "2",
             "--fsync-every", "1", "--no-progress"]
    cmd = [sys.executable, "-m", "nanokv", "generate", "--model", model_dir, "--input", inp, "--output", str(out), *flags]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= 8:
                break
            time.sleep(0.01)
        assert proc.poll() is None, proc.stderr.read().decode()
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    written = out.read_bytes().count(b"\n")
    assert 8 <= written < len(rows)
    assert generate(model_dir, inp, out, *flags) == 0  # the same command again, resumed
    expected = reference(llm, rows, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert_matches(by_id(out), expected)  # by_id: every id exactly once


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_processes_equal_one(model_dir, tmp_path):
    rows = mixed_rows()
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    assert generate(model_dir, inp, one, *GREEDY) == 0
    # a previous run left part of rank 1's shard done: it is kept, not redone
    head = [r for r in read_jsonl(one) if (r["line"] - 1) % 2 == 1][:2]
    write_jsonl(part_path(str(two), 1, 2), head)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "nanokv", "generate", "--model", model_dir,
           "--input", inp, "--output", str(two), *GREEDY]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-8000:]
    assert "rank 1: 5 generated" in proc.stderr and "skipped 2 already done" in proc.stderr
    assert by_id(two) == by_id(one)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "one.jsonl", "two.jsonl"]  # parts merged and removed
