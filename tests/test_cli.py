"""`nanokv generate` / `nanokv merge`: JSONL in and out, equal to LLM.generate, resume
after a kill or a torn line, bad lines in the errors file, ids checked before work
starts, and a 2-process torchrun run equal to a 1-process one. Nothing lost, nothing
wedged: files nanokv did not write are never changed, piped input, an input rewritten
mid-run, one run per output (a lock), ranks die with a killed torchrun agent, engine
failures are one line and exit 2, a request that fails alone is an error record."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from nanokv import LLM, SamplingParams
from nanokv.entrypoints.cli import main
from nanokv.entrypoints.cli.inputs import scan_ids
from nanokv.entrypoints.cli.locks import FileLock
from nanokv.entrypoints.cli.records import errors_path, part_path
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
                 {"max_tokens": 5, "ignore_eos": True}, {"logit_bias": {"77": 100}},
                 {"allowed_token_ids": [11, 200, 301], "bad_words": ["x"], "ignore_eos": True}]
    rows = [{"id": i, "prompt": TEXTS[i % len(TEXTS)], "sampling_params": o} for i, o in enumerate(overrides)]
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
    assert records[4]["token_ids"] == [77] * 8 and set(records[5]["token_ids"]) <= {11, 200, 301}


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


# ---- nothing lost, nothing wedged -------------------------------------------------------

def one_line(err: str) -> str:
    """stderr of a refused run: exactly one line, no traceback."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_output_that_is_the_input_is_refused_before_the_model_loads(tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", mixed_rows())
    before = (tmp_path / "in.jsonl").read_bytes()
    os.link(inp, tmp_path / "link.jsonl")
    os.link(inp, tmp_path / "x.errors.jsonl")
    no_model = str(tmp_path / "no-model")  # a check after the model load would report the model instead
    # the same name; a hard link; the input given as the errors file of the output
    for given, out in ((inp, inp), (inp, tmp_path / "link.jsonl"), (tmp_path / "x.errors.jsonl", tmp_path / "x.jsonl")):
        assert generate(no_model, given, out, *GREEDY) == 2
        assert "which the run would write to" in one_line(capsys.readouterr().err)
        assert (tmp_path / "in.jsonl").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "link.jsonl", "x.errors.jsonl"]  # no lock file left


FOREIGN = {
    "unrelated JSONL": b'{"a": 1}\n{"b": 2}\n',
    "prompts, last line without newline": b'{"id": "q1", "prompt": "x"}\n{"id": "q2", "prompt": "y"}',
    "one prompt line without newline": b'{"id": "q1", "prompt": "x"}',
    "error records": b'{"id": "q1", "line": 1, "error": "bad"}\n',
}


@pytest.mark.parametrize("content", FOREIGN.values(), ids=FOREIGN.keys())
def test_a_file_nanokv_did_not_write_is_never_changed(tmp_path, capsys, content):
    inp = write_jsonl(tmp_path / "in.jsonl", mixed_rows())
    out = tmp_path / "out.jsonl"
    no_model = str(tmp_path / "no-model")
    out.write_bytes(content)
    assert generate(no_model, inp, out, *GREEDY) == 2
    assert "nanokv did not write this file" in one_line(capsys.readouterr().err)
    assert out.read_bytes() == content
    assert main(["merge", "--output", str(out), "--world-size", "2"]) == 2
    assert out.read_bytes() == content
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "out.jsonl"]


def test_a_foreign_errors_file_part_or_middle_line_is_never_changed(model_dir, tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", mixed_rows())
    ref = tmp_path / "ref.jsonl"
    assert generate(model_dir, inp, ref, *GREEDY) == 0
    capsys.readouterr()
    records = ref.read_bytes().splitlines(keepends=True)
    out = tmp_path / "out.jsonl"
    no_model = str(tmp_path / "no-model")
    # one foreign line in the middle of an output: every record after it would be lost
    middle = b"".join(records[:3]) + b'{"note": "mine"}\n' + b"".join(records[3:6])
    targets = [(out, middle), (out, b"".join(records[:3]) + b"my note"),  # a last line without newline
               (tmp_path / "out.errors.jsonl", records[0]),  # a result is no error record
               (tmp_path / "out.jsonl.part-00001-of-00002", b"my notes\n")]  # a merge would remove it
    for path, content in targets:
        path.write_bytes(content)
        assert generate(no_model, inp, out, *GREEDY) == 2, path
        assert "nanokv did not write this file" in one_line(capsys.readouterr().err)
        assert main(["merge", "--output", str(out), "--world-size", "2"]) == 2
        assert "nanokv did not write this file" in one_line(capsys.readouterr().err)
        assert path.read_bytes() == content
        os.remove(path)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "ref.jsonl"]


def test_a_file_holding_only_a_torn_line_is_cut_only_after_a_killed_run(model_dir, tmp_path, capsys):
    """Only a trace of a killed run (its lock file) proves such a file is nanokv's."""
    rows = mixed_rows()
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    torn = b'{"id": "text-0", "line": 1, "num_prompt'
    out.write_bytes(torn)
    assert generate(str(tmp_path / "no-model"), inp, out, *GREEDY) == 2
    assert "no complete nanokv record" in one_line(capsys.readouterr().err)
    assert out.read_bytes() == torn
    (tmp_path / "out.jsonl.lock").write_text("nanokv generate pid 1 on elsewhere since 2025-01-01 00:00:00\n")
    assert generate(model_dir, inp, out, *GREEDY) == 0
    assert "torn" in capsys.readouterr().err
    assert set(by_id(out)) == {r["id"] for r in rows}
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "out.jsonl"]  # the trace is gone once repaired


def test_a_lock_file_that_cannot_be_rewritten_keeps_the_trace(model_dir, tmp_path, monkeypatch, capsys):
    """A rerun on a full disk cannot write its holder line into the killed run's lock
    file: the old line must stay, so that a later rerun can still cut the torn line."""
    rows = mixed_rows()
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    torn = b'{"id": "text-0", "line": 1, "num_prompt'
    out.write_bytes(torn)
    trace = b"nanokv generate pid 1 on elsewhere since 2025-01-01 00:00:00\n"
    (tmp_path / "out.jsonl.lock").write_bytes(trace)

    def full(fd, data, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    assert generate(str(tmp_path / "no-model"), inp, out, *GREEDY) == 2
    err = capsys.readouterr().err
    monkeypatch.undo()
    assert (tmp_path / "out.jsonl.lock").read_bytes() == trace and out.read_bytes() == torn
    assert "cannot write the lock file" in one_line(err)
    assert generate(model_dir, inp, out, *GREEDY) == 0
    assert "torn" in capsys.readouterr().err
    assert set(by_id(out)) == {r["id"] for r in rows}


def test_missing_output_directory_is_reported_before_the_model_loads(tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", mixed_rows())
    no_model = str(tmp_path / "no-model")
    assert generate(no_model, inp, tmp_path / "missing" / "out.jsonl", *GREEDY) == 2
    assert "does not exist" in one_line(capsys.readouterr().err)
    assert generate(no_model, inp, tmp_path, *GREEDY) == 2  # --output a directory
    assert "is a directory" in one_line(capsys.readouterr().err)
    assert main(["merge", "--output", str(tmp_path / "missing" / "out.jsonl"), "--world-size", "2"]) == 2
    assert "does not exist" in one_line(capsys.readouterr().err)


def test_a_held_output_is_refused_naming_the_holder(model_dir, tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", mixed_rows())
    out = tmp_path / "out.jsonl"
    lock = FileLock(str(out), "generate")  # as a running generate holds it
    try:
        assert generate(str(tmp_path / "no-model"), inp, out, *GREEDY) == 2
        assert f"in use by nanokv generate pid {os.getpid()}" in one_line(capsys.readouterr().err)
        assert main(["merge", "--output", str(out), "--world-size", "2"]) == 2
        assert "in use by" in one_line(capsys.readouterr().err)
    finally:
        lock.release()
    assert not out.exists() and os.listdir(tmp_path) == ["in.jsonl"]
    assert generate(model_dir, inp, out, *GREEDY) == 0  # released: the run goes ahead


def _pipe_from(data: bytes) -> tuple[int, threading.Thread]:
    r, w = os.pipe()

    def feed():
        with os.fdopen(w, "wb") as f:
            f.write(data)

    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    return r, thread


def test_piped_input_is_read_once_and_resumes(model_dir, llm, tmp_path, monkeypatch, capsys):
    rows = mixed_rows()
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    out = tmp_path / "out.jsonl"
    r, thread = _pipe_from(data)  # like <(...): a path that is a pipe
    try:
        assert generate(model_dir, f"/dev/fd/{r}", out, *GREEDY) == 0
    finally:
        os.close(r)
        thread.join(5)
    assert_matches(by_id(out), reference(llm, rows, SamplingParams(temperature=0, max_tokens=8)))
    out.write_bytes(b"".join(out.read_bytes().splitlines(keepends=True)[:5]))
    r, thread = _pipe_from(data)  # `--input -`, the same lines again: a resume
    with os.fdopen(r, "rb") as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        assert generate(model_dir, "-", out, *GREEDY) == 0
    thread.join(5)
    assert f"{len(rows) - 5} generated, 0 failed; skipped 5 already done" in capsys.readouterr().err
    assert_matches(by_id(out), reference(llm, rows, SamplingParams(temperature=0, max_tokens=8)))
    assert sorted(os.listdir(tmp_path)) == ["out.jsonl"]  # the spool was anonymous


def _rewrite_after_first_step(monkeypatch, path, new_bytes, keep_stamp):
    step = LLMEngine.step
    calls = []

    def rewriting_step(self):
        if not calls:
            st = os.stat(path)
            with open(path, "r+b") as f:  # in place, as an editor or `>` would
                f.truncate(0)
                f.write(new_bytes)
            if keep_stamp:
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        calls.append(1)
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", rewriting_step)


@pytest.mark.parametrize("how", ["lines swapped, same size and mtime", "a line appended"])
def test_an_input_rewritten_during_a_run_stops_it_without_a_wrong_record(model_dir, tmp_path, monkeypatch,
                                                                          capsys, how):
    # padded past the read buffer, so that each line is read from the file when it is parsed
    rows = [{"id": f"p{i}", "prompt_token_ids": p, "pad": "x" * 10000}
            for i, p in enumerate(random_prompts(list(range(3, 13)), 1024, seed=5))]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    original = (tmp_path / "in.jsonl").read_bytes()
    lines = original.splitlines(keepends=True)
    swapped = lines[::-1] if how.startswith("lines") else lines + [b'{"id": "new", "prompt": "x"}\n']
    _rewrite_after_first_step(monkeypatch, inp, b"".join(swapped), keep_stamp=how.startswith("lines"))
    out = tmp_path / "out.jsonl"
    flags = [*GREEDY, "--window", "1", "--max-num-seqs", "1"]
    assert generate(model_dir, inp, out, *flags) == 2
    assert "changed during the run" in one_line(capsys.readouterr().err)
    records = read_jsonl(out)
    assert 1 <= len(records) < len(rows)
    for rec in records:  # every record was made from the line its id names
        assert rec["num_prompt_tokens"] == len(rows[rec["line"] - 1]["prompt_token_ids"]), rec["id"]
        assert rec["id"] == rows[rec["line"] - 1]["id"]


def test_progress_bar_shows_failed_lines_apart(model_dir, tmp_path, capsys):
    rows = [{"id": "a", "prompt": TEXTS[0]}, {"id": "bad", "prompt": ""}, {"id": "b", "prompt": TEXTS[1]}]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    assert generate(model_dir, inp, tmp_path / "out.jsonl", "--temperature", "0", "--max-tokens", "4") == 3
    bar = [part for part in capsys.readouterr().err.split("\r") if "3/3" in part][-1]
    assert "2 generated, 1 failed" in bar and "Generated" not in bar


def test_engine_failure_is_one_line_exit_2_and_resumes(model_dir, llm, tmp_path, monkeypatch, capsys):
    rows = mixed_rows()
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    flags = [*GREEDY, "--max-num-seqs", "2"]
    step = LLMEngine.step
    calls = []

    def dying_step(self):
        calls.append(1)
        if len(calls) > 12:
            raise RuntimeError("tensor-parallel worker 1 died (exit code -9)\nmore detail")
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", dying_step)
    assert generate(model_dir, inp, out, *flags) == 2
    assert "the engine failed: tensor-parallel worker 1 died" in one_line(capsys.readouterr().err)
    assert 0 < len(read_jsonl(out)) < len(rows)  # what finished is kept
    monkeypatch.setattr(LLMEngine, "step", step)

    def closed(self, *a, **kw):
        raise RuntimeError("the engine is closed")

    monkeypatch.setattr("nanokv.llm.LLM.__init__", closed)
    assert generate(model_dir, inp, out, *flags) == 2
    assert "the engine is closed" in one_line(capsys.readouterr().err)
    monkeypatch.undo()
    assert generate(model_dir, inp, out, *flags) == 0
    assert_matches(by_id(out), reference(llm, rows, SamplingParams(temperature=0, max_tokens=8)))


def test_a_request_the_engine_fails_alone_goes_to_the_errors_file(model_dir, tmp_path, monkeypatch):
    """The engine finishes a request that fails inside a step alone, with `error` set."""
    rows = mixed_rows()
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    step = LLMEngine.step

    def failing_step(self):
        results = step(self)
        for r in results:
            if r.request_id == "line-3" and r.finished:
                r.error = "step failed for this request: boom"
                for c in r.outputs:
                    c.finish_reason = "error"
        return results

    monkeypatch.setattr(LLMEngine, "step", failing_step)
    assert generate(model_dir, inp, out, *GREEDY) == 3
    assert set(by_id(out)) == {r["id"] for r in rows} - {rows[2]["id"]}
    assert read_jsonl(errors_path(str(out))) == [{"id": rows[2]["id"], "line": 3,
                                                   "error": "step failed for this request: boom"}]
    assert generate(model_dir, inp, out, *GREEDY) == 3  # resume: not redone
    monkeypatch.undo()
    assert generate(model_dir, inp, out, *GREEDY, "--retry-errors") == 0
    assert set(by_id(out)) == {r["id"] for r in rows} and not os.path.exists(errors_path(str(out)))


BAD_LINES = [
    pytest.param('{"id": "bad", "prompt": "\\ud800"}', id="lone surrogate prompt"),
    pytest.param('{"id": "bad", "messages": [{"role": "user", "content": "\\ud800"}]}', id="lone surrogate message"),
    pytest.param({"id": "bad", "prompt": "x", "sampling_params": {"logprobs": 10**9}}, id="logprobs"),
    pytest.param({"id": "bad", "prompt": "x", "sampling_params": {"top_k": 2**63}}, id="top_k"),
    pytest.param({"id": "bad", "prompt": "x", "sampling_params": {"seed": 2**64}}, id="seed"),
    pytest.param({"id": "bad", "prompt": "x", "sampling_params": {"stop_token_ids": [10**9], "min_tokens": 1}},
                 id="stop_token_ids"),
]


@pytest.mark.parametrize("bad", BAD_LINES)
def test_a_bad_value_in_a_line_is_an_error_record(model_dir, tmp_path, bad):
    rows = [{"id": "ok-1", "prompt": TEXTS[0]}, bad, {"id": "ok-2", "prompt": TEXTS[1]}]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    assert generate(model_dir, inp, out, *GREEDY) == 3
    assert set(by_id(out)) == {"ok-1", "ok-2"}
    assert [(e["id"], e["line"]) for e in read_jsonl(errors_path(str(out)))] == [("bad", 2)]
    before = out.read_bytes()
    assert generate(model_dir, inp, out, *GREEDY) == 3  # resume: nothing redone, no crash
    assert generate(model_dir, inp, out, *GREEDY, "--retry-errors") == 3  # retried: fails alone again
    assert out.read_bytes() == before


# ---- subprocesses: kill and resume, python -m nanokv under torchrun ---------------------

def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("RANK", None), env.pop("WORLD_SIZE", None), env.pop("LOCAL_RANK", None)
    return env


@pytest.mark.slow
def test_kill_mid_run_and_resume_gives_every_id_once(model_dir, llm, tmp_path, capsys):
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
        # a second run on the same output, or a merge into it, is refused while this one runs
        assert generate(str(tmp_path / "no-model"), inp, out, *flags) == 2
        assert f"in use by nanokv generate pid {proc.pid}" in one_line(capsys.readouterr().err)
        assert main(["merge", "--output", str(out), "--world-size", "2"]) == 2
        assert f"in use by nanokv generate pid {proc.pid}" in one_line(capsys.readouterr().err)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    written = out.read_bytes().count(b"\n")
    assert 8 <= written < len(rows)
    assert generate(model_dir, inp, out, *flags) == 0  # the same command again, resumed: the lock died
    expected = reference(llm, rows, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert_matches(by_id(out), expected)  # by_id: every id exactly once
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "out.jsonl"]


# A process whose files may not grow past 40 bytes (RLIMIT_FSIZE, SIGXFSZ ignored: write()
# fails with EFBIG, as it fails with ENOSPC on a full disk), from after `after` returns: for
# generate the model load (which may write caches), for merge the first check of the files.
_FSIZE_CHILD = """
import resource, signal, sys
from nanokv.entrypoints.cli import generate, main, merge
module, name = {"generate": (generate, "_load_llm"), "merge": (merge, "load_keys")}[sys.argv[1]]
real = getattr(module, name)

def limited(*args, **kwargs):
    result = real(*args, **kwargs)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (40, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    return result

setattr(module, name, limited)
sys.exit(main(sys.argv[1:]))
"""


def _with_a_40_byte_file_limit(*argv: str) -> str:
    """Run `nanokv *argv` with that limit; it must fail (exit 2). Returns its stderr."""
    child = subprocess.run([sys.executable, "-c", _FSIZE_CHILD, *argv], env=_env(), capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == 2, child.stderr
    return child.stderr


def _torn(path) -> bool:
    data = path.read_bytes()
    return bool(data) and not data.endswith(b"\n")


@pytest.mark.slow
@pytest.mark.parametrize("first", ["result", "error"])
def test_a_write_that_fails_on_the_first_record_resumes(model_dir, tmp_path, capsys, first):
    """The first record of a new output (or errors file) cut short by a failed write: the
    file holds nothing but a torn line, and the rerun of the same command cuts it and
    resumes (the lock file stays as the trace that nanokv wrote it)."""
    rows = mixed_rows()[:6]
    if first == "error":  # an error record is written before any result
        rows.insert(0, {"id": "empty", "prompt": ""})
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    code = generate(model_dir, inp, ref, *GREEDY)
    assert code == (3 if first == "error" else 0)
    err = _with_a_40_byte_file_limit("generate", "--model", model_dir, "--input", inp, "--output", str(out), *GREEDY)
    torn = tmp_path / ("out.jsonl" if first == "result" else "out.errors.jsonl")
    assert _torn(torn) and len(torn.read_bytes()) == 40  # the first record, cut short
    assert generate(model_dir, inp, out, *GREEDY) == code  # the same command resumes
    assert "torn" in capsys.readouterr().err
    assert "cannot write" in err and "rerun the same command to resume" in err
    assert by_id(out) == by_id(ref)  # every id exactly once, as uninterrupted
    if first == "error":
        assert read_jsonl(tmp_path / "out.errors.jsonl") == read_jsonl(tmp_path / "ref.errors.jsonl")
    assert not (tmp_path / "out.jsonl.lock").exists()  # the trace is gone once repaired

    # a merge into a new output whose first record cannot be written: the rerun merges
    merged = tmp_path / "merged.jsonl"
    records = ref.read_bytes().splitlines(keepends=True)
    for rank in range(2):
        (tmp_path / part_path("merged.jsonl", rank, 2)).write_bytes(b"".join(records[rank::2]))
    _with_a_40_byte_file_limit("merge", "--output", str(merged), "--world-size", "2")
    assert _torn(merged)
    assert main(["merge", "--output", str(merged), "--world-size", "2"]) == 0
    assert "torn" in capsys.readouterr().err
    assert by_id(merged) == by_id(ref)
    assert not (tmp_path / "merged.jsonl.lock").exists()

    # a file a user wrote that looks like a torn first record is still refused, every time
    mine = tmp_path / "mine.jsonl"
    mine.write_bytes(records[0][:40])
    for _ in range(2):
        assert generate(str(tmp_path / "no-model"), inp, mine, *GREEDY) == 2
        assert "nanokv did not write this file" in one_line(capsys.readouterr().err)
        assert mine.read_bytes() == records[0][:40] and not (tmp_path / "mine.jsonl.lock").exists()


# The same limit on the whole process, from its start: the lock file's holder line (58+
# bytes) is the first write it cuts.
_WHOLE_FSIZE_CHILD = """
import resource, signal, sys
from nanokv.entrypoints.cli import main
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_a_write_that_fails_on_the_lock_file_leaves_nothing_that_blocks_the_rerun(model_dir, tmp_path, capsys):
    """A file size limit (or a full disk) that cuts the lock file's holder line: the lock
    file held "n" (1 byte) and every rerun refused it as not nanokv's. Now the run fails
    naming the lock file, leaves no lock file, and the rerun (also limited, then not)
    runs the whole input; a lock file an older nanokv left cut inside "nanokv " is taken."""
    rows = mixed_rows()[:5]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    ref = tmp_path / "ref.jsonl"
    assert generate(model_dir, inp, ref, *GREEDY) == 0
    for limit in (1, 6, 30):
        out = tmp_path / f"out{limit}.jsonl"
        for _ in range(2):
            child = subprocess.run([sys.executable, "-c", _WHOLE_FSIZE_CHILD, str(limit), "generate", "--model",
                                    model_dir, "--input", inp, "--output", str(out), *GREEDY],
                                   env=_env(), capture_output=True, text=True, timeout=300)
            assert child.returncode == 2 and f"cannot write the lock file {out}.lock" in child.stderr, child.stderr
            assert not os.path.exists(f"{out}.lock") and not out.exists()
        assert generate(model_dir, inp, out, *GREEDY) == 0, capsys.readouterr().err
        assert by_id(out) == by_id(ref)
    old = tmp_path / "old.jsonl"
    (tmp_path / "old.jsonl.lock").write_bytes(b"nan")
    assert generate(model_dir, inp, old, *GREEDY) == 0
    assert by_id(old) == by_id(ref) and not (tmp_path / "old.jsonl.lock").exists()
    # but it is no trace of a killed run: a torn-only file beside it is still refused, untouched
    mine = tmp_path / "mine.jsonl"
    mine.write_bytes(b'{"id": "x", "li')
    (tmp_path / "mine.jsonl.lock").write_bytes(b"n")
    assert generate(model_dir, inp, mine, *GREEDY) == 2
    assert "nanokv did not write this file" in capsys.readouterr().err
    assert mine.read_bytes() == b'{"id": "x", "li'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_torchrun_two_processes_equal_one(model_dir, tmp_path):
    rows = mixed_rows()
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    assert generate(model_dir, inp, one, *GREEDY) == 0
    # a previous run left part of rank 1's shard done: it is kept, not redone
    head = [r for r in read_jsonl(one) if (r["line"] - 1) % 2 == 1][:2]

    def torchrun(model):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(_free_port()), "-m", "nanokv", "generate", "--model", model,
               "--input", inp, "--output", str(two), *GREEDY]
        return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)

    # a part rank 1 would append to is not nanokv's: every rank stops before loading the model
    write_jsonl(part_path(str(two), 1, 2), ["my notes"])
    proc = torchrun(str(tmp_path / "no-model"))
    assert proc.returncode != 0
    assert "nanokv did not write this file" in proc.stderr and "another rank failed its checks" in proc.stderr
    assert open(part_path(str(two), 1, 2)).read() == "my notes\n"
    write_jsonl(part_path(str(two), 1, 2), head)
    proc = torchrun(model_dir)
    assert proc.returncode == 0, proc.stderr[-8000:]
    assert "rank 1: 5 generated" in proc.stderr and "skipped 2 already done" in proc.stderr
    assert by_id(two) == by_id(one)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "one.jsonl", "two.jsonl"]  # parts merged and removed


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
    return kids


def _alive(pid: int) -> bool:
    """Whether any thread of pid still runs: a killed process's main thread can be a zombie
    (dead, only not reaped) while its other threads are still exiting, and its files (the
    lock) are closed only when the last one is gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return False
    for task in tasks:
        with contextlib.suppress(FileNotFoundError):
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    return True
    return False


@pytest.mark.slow
def test_a_killed_torchrun_agent_leaves_no_rank_behind_and_resumes(model_dir, llm, tmp_path):
    # long outputs: each rank has seconds of work left when its agent dies
    rows = [{"id": f"p{i}", "prompt_token_ids": p} for i, p in enumerate(random_prompts([3, 9, 5] * 2, 1024, seed=4))]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    flags = ["--temperature", "0", "--max-tokens", "900", "--ignore-eos", "--no-progress"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "nanokv", "generate", "--model", model_dir,
           "--input", inp, "--output", str(out), *flags, "--max-num-seqs", "1", "--window", "1"]
    agent = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks = []
    try:
        deadline = time.monotonic() + 90
        parts = [part_path(str(out), r, 2) for r in range(2)]
        while time.monotonic() < deadline and agent.poll() is None and not all(map(os.path.exists, parts)):
            time.sleep(0.02)  # the parts are opened once the model is loaded
        assert agent.poll() is None
        ranks = _children(agent.pid)
        assert len(ranks) == 2
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(map(_alive, ranks)):
            time.sleep(0.02)
        assert not any(map(_alive, ranks)), "ranks outlived the torchrun agent"
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        for pid in ranks:  # what the old code left behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    # one process resumes from the killed ranks' parts (their locks died with them) and merges them
    assert generate(model_dir, inp, out, *flags) == 0
    expected = reference(llm, rows, SamplingParams(temperature=0, max_tokens=900, ignore_eos=True))
    assert_matches(by_id(out), expected)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "out.jsonl"]


@pytest.mark.slow
def test_a_rank_that_cannot_rendezvous_gives_up_after_the_rendezvous_timeout(tmp_path, monkeypatch, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", mixed_rows())
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(_free_port())}.items():  # nobody listens there
        monkeypatch.setenv(key, value)
    start = time.monotonic()
    assert generate(str(tmp_path / "no-model"), inp, tmp_path / "out.jsonl", *GREEDY, "--rendezvous-timeout", "2") == 2
    assert time.monotonic() - start < 30
    assert "cannot rendezvous with the other ranks within --rendezvous-timeout 2s" in one_line(capsys.readouterr().err)
    assert os.listdir(tmp_path) == ["in.jsonl"]
