"""`nanokv chat` and `nanokv complete`: driven through a pseudo-terminal as a user would
(the streamed answer equals LLM.chat's, the conversation is kept across turns, /reset
clears it, Ctrl-C stops an answer and returns to the prompt, /exit and Ctrl-D leave),
with -q, with piped stdin, and against a running server (--url)."""

from __future__ import annotations

import codecs
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from nanokv import LLM, SamplingParams
from nanokv.entrypoints.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_MODEL_LEN = 512
ENGINE = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(16 << 20)]
GREEDY = ["--temperature", "0", "--max-tokens", "12"]
TIMEOUT_S = 120.0  # the longest any one expected output may take on a loaded machine
_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]|\r")  # readline's terminal codes, the tty's \r


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=16 << 20)


def _env() -> dict:
    env = dict(os.environ, TERM="dumb", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def clean(text: str) -> str:
    return _ESCAPES.sub("", text)


class Terminal:
    """`python -m nanokv ARGS` on a pseudo-terminal: type lines, read what it prints."""

    def __init__(self, *args: str):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: its stdin, stdout and stderr are the terminal
            try:
                os.execve(sys.executable, [sys.executable, "-m", "nanokv", *args], _env())
            finally:
                os._exit(127)
        self.seen = ""  # everything printed so far, cleaned
        self._text = ""  # everything printed so far, as printed
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")  # keeps a character split between reads
        self.status: int | None = None

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def _read(self, deadline: float) -> None:
        """Read what is there (waiting at most until deadline) into self.seen."""
        ready, _, _ = select.select([self.fd], [], [], max(0.0, min(deadline - time.monotonic(), 1.0)))
        if not ready:
            return
        try:
            chunk = os.read(self.fd, 4096)
        except OSError:  # EIO: the child closed the terminal
            chunk = b""
        if not chunk:
            raise AssertionError(f"the program ended; the terminal shows:\n{self.seen}")
        self._text += self._decoder.decode(chunk)
        self.seen = clean(self._text)  # all of it: an escape code split between two reads is still removed

    def expect(self, text: str, after: int = 0, timeout: float = TIMEOUT_S) -> int:
        """Read until `text` appears at or after position `after`; its end position."""
        deadline = time.monotonic() + timeout
        while (at := self.seen.find(text, after)) < 0:
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} did not appear within {timeout}s; the terminal shows:\n{self.seen}")
            self._read(deadline)
        return at + len(text)

    def expect_more(self, than: int, timeout: float = TIMEOUT_S) -> None:
        """Read until more than `than` characters were printed."""
        deadline = time.monotonic() + timeout
        while len(self.seen) <= than:
            if time.monotonic() > deadline:
                raise AssertionError(f"nothing more within {timeout}s; the terminal shows:\n{self.seen}")
            self._read(deadline)

    def interrupt(self) -> str:
        """Press Ctrl-C while the program is held still (SIGSTOP; the tty's SIGINT waits
        until SIGCONT), so a busy machine cannot let the answer run to its end before the
        key lands. Returns what it had printed when it was stopped."""
        os.kill(self.pid, signal.SIGSTOP)
        while select.select([self.fd], [], [], 0.2)[0]:  # what it wrote before it stopped
            self._read(time.monotonic() + 0.2)
        printed = self.seen
        self.type("\x03")
        os.kill(self.pid, signal.SIGCONT)
        return printed

    def wait(self, timeout: float = TIMEOUT_S) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with_pid, status = os.waitpid(self.pid, os.WNOHANG)
            if with_pid:
                self.status = os.waitstatus_to_exitcode(status)
                return self.status
            if select.select([self.fd], [], [], 0.2)[0]:  # keep draining so it never blocks on a full terminal
                try:
                    self._text += self._decoder.decode(os.read(self.fd, 4096))
                except OSError:
                    pass
        raise AssertionError(f"the program did not exit within {timeout}s; the terminal shows:\n{self.seen}")

    def close(self) -> None:
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        os.close(self.fd)


@pytest.fixture
def terminal():
    opened: list[Terminal] = []

    def start(*args: str) -> Terminal:
        opened.append(Terminal(*args))
        return opened[-1]

    yield start
    for t in opened:
        t.close()


def answer(llm, messages, params=None) -> str:
    params = params or SamplingParams(temperature=0, max_tokens=12)
    return clean(llm.chat([messages], params, use_tqdm=False)[0].outputs[0].text)


def test_chat_streams_keeps_the_conversation_resets_and_exits(model_dir, llm, terminal):
    t = terminal("chat", model_dir, *GREEDY, *ENGINE)
    pos = t.expect("> ", t.expect("Chatting with"))
    first = [{"role": "user", "content": "Hello there"}]
    t.type("Hello there\n")
    a1 = answer(llm, first)
    pos = t.expect(a1 + "\n> ", pos)
    second = [*first, {"role": "assistant", "content": a1}, {"role": "user", "content": "Tell me more"}]
    t.type("Tell me more\n")
    a2 = answer(llm, second)
    assert a2 != answer(llm, second[2:]), "pick prompts whose answer depends on the history"
    pos = t.expect(a2 + "\n> ", pos)
    t.type("/reset\n")
    pos = t.expect("(new conversation)\n> ", pos)
    t.type("Tell me more\n")
    pos = t.expect(answer(llm, second[2:]) + "\n> ", pos)
    t.type("/exit\n")
    assert t.wait() == 0


def test_ctrl_c_stops_the_answer_not_the_program_and_ctrl_d_leaves(model_dir, llm, terminal):
    # answers run to max_model_len; --stats marks each answer's end with lines no answer of
    # the random model holds (its text may well hold "\n> ", the prompt)
    t = terminal("chat", model_dir, "--ignore-eos", "--temperature", "0", "--stats", *ENGINE)
    pos = t.expect("> ", t.expect("Chatting with"))
    t.type("Hello there\n")
    pos = t.expect("Hello there\n", pos)
    t.expect_more(pos + 1)  # the answer streams
    before = t.interrupt()[pos:]
    end = t.expect("(stopped)\n", pos)
    full = answer(llm, [{"role": "user", "content": "Hello there"}],
                  SamplingParams(temperature=0, ignore_eos=True, max_tokens=MAX_MODEL_LEN))
    assert full.startswith(before)  # the answer's own pieces, as they came
    assert len(t.seen[pos:end]) < len(full)  # stopped long before its end
    pos = t.expect("\n> ", t.expect("TTFT: ", end))
    t.type("Thanks\n")  # the engine took the abort: the next turn runs to its end
    pos = t.expect("\n> ", t.expect("TTFT: ", t.expect("Thanks\n", pos)))
    t.type("\x04")  # Ctrl-D at the prompt
    assert t.wait() == 0


def test_chat_quick_with_a_system_prompt(model_dir, llm, capsys):
    assert main(["chat", model_dir, "--system-prompt", "Be brief.", "-q", "What is a KV cache?", *GREEDY,
                 *ENGINE]) == 0
    expected = answer(llm, [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "What is a KV cache?"}])
    assert clean(capsys.readouterr().out) == expected + "\n"


def test_complete_quick_and_piped_lines(model_dir, llm, capsys):
    params = SamplingParams(temperature=0, max_tokens=12)
    prompts = ["Beautiful is better than", "Flat is better"]
    expected = [clean(o.outputs[0].text) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert main(["complete", model_dir, "-q", prompts[0], *GREEDY, *ENGINE]) == 0
    assert clean(capsys.readouterr().out) == expected[0] + "\n"
    proc = subprocess.run([sys.executable, "-m", "nanokv", "complete", model_dir, *GREEDY, *ENGINE],
                          input="\n".join(prompts) + "\n", capture_output=True, text=True, env=_env(),
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert clean(proc.stdout) == "".join(e + "\n" for e in expected)


def test_a_prompt_over_max_model_len_is_refused_and_the_chat_goes_on(model_dir, llm, terminal):
    t = terminal("chat", model_dir, *GREEDY, *ENGINE)
    pos = t.expect("> ", t.expect("Chatting with"))
    t.type("word " * MAX_MODEL_LEN + "\n")
    pos = t.expect("max_model_len", pos)
    pos = t.expect("> ", pos)
    t.type("Hello there\n")  # the refused turn is not in the conversation
    t.expect(answer(llm, [{"role": "user", "content": "Hello there"}]) + "\n> ", pos)
    t.type("/exit\n")
    assert t.wait() == 0


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    from .entrypoints.conftest import Server

    running = Server(model_dir, *ENGINE, log_path=str(tmp_path_factory.mktemp("serve") / "server.log")).start()
    yield running
    running.stop()


def test_chat_and_complete_with_url_talk_to_a_running_server(server, llm, capsys):
    url = server.url + "/v1"
    assert main(["chat", "--url", url, "-q", "Hello there", "--stats", *GREEDY]) == 0
    out = clean(capsys.readouterr().out)
    expected = answer(llm, [{"role": "user", "content": "Hello there"}])
    assert out.startswith(expected + "\nTTFT: ") and "(12 tokens in " in out  # the server's usage
    assert main(["complete", "--url", url, "--model-name", server.model, "-q", "Flat is better", *GREEDY]) == 0
    params = SamplingParams(temperature=0, max_tokens=12)
    assert clean(capsys.readouterr().out) == clean(llm.generate("Flat is better", params, use_tqdm=False)[0]
                                                   .outputs[0].text) + "\n"
    assert main(["chat", "--url", url, "--model-name", "no-such-model", "-q", "Hi"]) == 2
    err = capsys.readouterr().err
    assert "HTTP 4" in err and "`no-such-model`" in err  # the server's own message


def test_ctrl_c_stops_a_served_answer(server, llm, terminal):
    t = terminal("chat", "--url", server.url + "/v1", "--ignore-eos", "--temperature", "0")
    pos = t.expect("> ", t.expect("Chatting with " + server.model))
    t.type("Hello there\n")
    pos = t.expect("Hello there\n", pos)
    t.expect_more(pos + 1)
    before = t.interrupt()[pos:]
    end = t.expect("(stopped)\n> ", pos)
    full = answer(llm, [{"role": "user", "content": "Hello there"}],
                  SamplingParams(temperature=0, ignore_eos=True, max_tokens=MAX_MODEL_LEN))
    assert full.startswith(before) and len(t.seen[pos:end]) < len(full)
    t.type("/exit\n")
    assert t.wait() == 0
