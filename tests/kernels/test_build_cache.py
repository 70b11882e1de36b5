"""The kernel cache (nanokv/kernels/build.py, ffi.py): an entry is trusted only when its
library's bytes match its manifest, a damaged one is built again, the loaded bytes are the
checked ones, builders of one entry take turns, and an unwritable cache builds into a
private folder.

The kernels are compiled for real once per module (the default variant); each test gets a copy
of that entry and a compiler wrapper that logs each compile and writes the module's build
(a one-entry ccache), so a rebuild costs a copy and the tests can count them. Whatever
may crash on a damaged library (SIGBUS, SIGSEGV) runs in a subprocess."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from nanokv import LLM, SamplingParams
from nanokv.kernels import build

pytestmark = pytest.mark.skipif(not build.can_build(), reason="no C compiler: CPU kernels not built")

STARTED = "started"  # the folder concurrent builders mark themselves in before building


@dataclass(frozen=True)
class Healthy:
    name: str  # nanokv_cpu_<key>
    library: bytes
    manifest: bytes
    cc: str  # the real compiler


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> Healthy:
    root = tmp_path_factory.mktemp("healthy")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOKV_CACHE_DIR", str(root))
        mp.delenv("NANOKV_CPU_WIDTH", raising=False)
        built = build.build()
    name = built.path.stem
    return Healthy(name, built.data, (built.path.parent / f"{name}.json").read_bytes(), build.compiler())


@dataclass(frozen=True)
class Cache:
    root: Path
    library: Path
    manifest: Path
    log: Path
    started: Path

    def compiles(self) -> int:
        """Builds run: the link steps (each build also runs the compiler on each .c file, -c)."""
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return sum(" -c " not in f" {line} " for line in lines)


@pytest.fixture
def cache(healthy, tmp_path, monkeypatch) -> Cache:
    """A cache root holding a copy of the module's entry, NANOKV_CACHE_DIR and CC set (the
    variables reach the subprocesses too)."""
    root = tmp_path / "root"
    (root / "kernels").mkdir(parents=True)
    library, manifest = root / "kernels" / f"{healthy.name}.so", root / "kernels" / f"{healthy.name}.json"
    library.write_bytes(healthy.library)
    manifest.write_bytes(healthy.manifest)
    log, started, prebuilt = tmp_path / "cc.log", tmp_path / STARTED, tmp_path / "prebuilt.so"
    prebuilt.write_bytes(healthy.library)
    started.mkdir()
    cc = tmp_path / "cc"
    # --version from the real compiler (the same key); a compile logged, then the module's
    # build written to -o once as many builders as $NK_BUILDERS have marked themselves
    # (bounded: 60 s), so concurrent builders really overlap
    cc.write_text(f"""#!/bin/sh
case " $* " in *" --version "*) exec {healthy.cc} "$@";; esac
echo "$*" >> {log}
echo $$ >> {tmp_path / "pids"}
i=0
while [ "$(ls {started} | wc -l)" -lt "${{NK_BUILDERS:-0}}" ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
prev=
for a; do [ "$prev" = -o ] && out=$a; prev=$a; done
cp {prebuilt} "$out"
""")
    cc.chmod(0o755)
    monkeypatch.setenv("NANOKV_CACHE_DIR", str(root))
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.delenv("NANOKV_CPU_WIDTH", raising=False)
    monkeypatch.delenv("NANOKV_CPU_KERNELS", raising=False)
    return Cache(root, library, manifest, log, started)


def assert_entry_is_healthy(cache: Cache, healthy: Healthy) -> None:
    assert cache.library.read_bytes() == healthy.library
    assert json.loads(cache.manifest.read_text()) == json.loads(healthy.manifest)


def run_python(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


KERNELS_WORK = """
import torch
from nanokv import kernels
assert kernels.available()
x, w = torch.randn(5, 64), torch.randn(64)
want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
torch.testing.assert_close(kernels.rmsnorm(x, w, 1e-6), want, rtol=1e-5, atol=1e-5)
weight = torch.randn(48, 64)
torch.testing.assert_close(kernels.linear(x, kernels.pack_weight(weight)), x @ weight.T, rtol=1e-4, atol=1e-4)
print("kernels work")
"""


def test_a_healthy_entry_is_used_as_is(cache, healthy):
    built = build.build()
    assert (built.path, built.data, cache.compiles()) == (cache.library, healthy.library, 0)


def greedy(llm) -> list[list[int]]:
    prompts = [[(7 * i + j) % 500 + 4 for j in range(n)] for i, n in enumerate([3, 20])]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_a_truncated_library_is_built_again_and_the_llm_runs(cache, healthy, model_dir):
    """A library cut short (a crash before it reached the disk) used to kill every later
    LLM() with SIGBUS: now it is found, built again, and the kernels give the tokens a
    healthy cache gives."""
    cache.library.write_bytes(healthy.library[: len(healthy.library) // 3])
    code = (
        "import json, torch\n"
        "from nanokv import LLM, SamplingParams\n"
        "torch.set_num_threads(1)\n"
        f"llm = LLM({model_dir!r}, max_model_len=128)\n"
        "assert llm.llm_engine.runner.kernels.cpu\n"
        "prompts = [[(7 * i + j) % 500 + 4 for j in range(n)] for i, n in enumerate([3, 20])]\n"
        "outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)\n"
        "print(json.dumps([o.outputs[0].token_ids for o in outs]))\n"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "does not match its manifest; building it again" in out.stderr
    assert cache.compiles() == 1
    assert_entry_is_healthy(cache, healthy)
    tokens = json.loads(out.stdout.strip().splitlines()[-1])
    llm = LLM(model_dir, max_model_len=128)  # this process's kernels, from its own cache
    assert llm.llm_engine.runner.kernels.cpu
    assert tokens == greedy(llm)


@pytest.mark.parametrize("offsets", [(4096,), (1000, 50000, 200000)], ids=["one-byte", "three-bytes"])
def test_changed_bytes_are_found_and_built_again(cache, healthy, caplog, offsets):
    data = bytearray(healthy.library)
    for at in offsets:
        data[at % len(data)] ^= 0x5A
    cache.library.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="nanokv"):
        built = build.build()
    assert built.data == healthy.library and cache.compiles() == 1
    assert_entry_is_healthy(cache, healthy)
    assert f"{cache.library} does not match its manifest" in caplog.text
    assert build.build().data == healthy.library and cache.compiles() == 1  # the rebuilt entry is trusted


@pytest.mark.parametrize("damage", ["missing", "empty", "not-json", "cut-short", "other-hash", "other-size",
                                    "a-folder"])
def test_a_missing_or_damaged_manifest_is_built_again(cache, healthy, damage, caplog):
    manifest = json.loads(healthy.manifest)
    if damage == "missing":
        cache.manifest.unlink()
    elif damage == "empty":
        cache.manifest.write_text("")
    elif damage == "not-json":
        cache.manifest.write_bytes(b"\x00\xff" * 40)
    elif damage == "cut-short":
        cache.manifest.write_bytes(healthy.manifest[:-5])
    elif damage == "other-hash":
        cache.manifest.write_text(json.dumps(dict(manifest, sha256="0" * 64)))
    elif damage == "other-size":
        cache.manifest.write_text(json.dumps(dict(manifest, size=manifest["size"] + 1)))
    else:
        cache.manifest.unlink()
        cache.manifest.mkdir()
    with caplog.at_level(logging.WARNING, logger="nanokv"):
        built = build.build()
    assert built.data == healthy.library and cache.compiles() == 1
    assert str(cache.library) in caplog.text and "building it again" in caplog.text
    if damage == "a-folder":  # not nanokv's to remove: this process commits to its private folder
        assert cache.manifest.is_dir() and built.path.parent == build._private
        assert "cannot write to the cache" in caplog.text
        cache.manifest.rmdir()
        cache.manifest.write_bytes(built.path.with_suffix(".json").read_bytes())
    assert_entry_is_healthy(cache, healthy)


def test_another_entry_s_files_copied_over_are_built_again(cache, healthy, caplog):
    """Another variant's library and its own manifest copied over this entry's agree with
    each other but are not this entry: the manifest names its entry."""
    other = cache.root / "other"
    other.mkdir()
    data = bytearray(healthy.library)
    data[len(data) // 2] ^= 0x5A  # another build's bytes
    build._commit(other, "nanokv_cpu_0123456789abcdef", bytes(data))
    shutil.copy(other / "nanokv_cpu_0123456789abcdef.so", cache.library)
    shutil.copy(other / "nanokv_cpu_0123456789abcdef.json", cache.manifest)
    with caplog.at_level(logging.WARNING, logger="nanokv"):
        built = build.build()
    assert built.data == healthy.library and cache.compiles() == 1
    assert f"{cache.library} does not match its manifest" in caplog.text
    assert_entry_is_healthy(cache, healthy)


@pytest.mark.parametrize("part", ["library", "manifest"])
def test_a_symlink_to_a_device_is_not_read(cache, healthy, part):
    """The library (or its manifest) a symlink to /dev/zero: the check read it until memory
    ran out (a MemoryError, so the torch path); now only a regular file is read, at most
    MAX_LIBRARY_BYTES of it, and the entry is built again. In a child under a 2 GB address
    space limit, so that the old behaviour fails fast."""
    target = cache.library if part == "library" else cache.manifest
    target.unlink()
    target.symlink_to("/dev/zero")
    code = (
        "import hashlib, resource\n"
        "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
        "from nanokv.kernels import build\n"
        "print(hashlib.sha256(build.build().data).hexdigest())\n"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == hashlib.sha256(healthy.library).hexdigest()
    assert "not a regular file" in out.stderr and "building it again" in out.stderr
    assert cache.compiles() == 1
    assert_entry_is_healthy(cache, healthy)  # the symlink replaced by the entry (by rename)


def _freeze(folder: Path) -> None:
    """No new files in folder, even for root (chattr +i), or skip."""
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0:
        return
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return
    pytest.skip("cannot make a folder refuse new files here (no chattr +i, and root ignores permissions)")


def _thaw(folder: Path) -> None:
    subprocess.run(["chattr", "-i", str(folder)], capture_output=True)
    folder.chmod(0o755)


def test_a_folder_that_takes_no_new_files_builds_into_a_private_folder(cache, healthy, caplog, monkeypatch):
    """The lock file exists (an earlier build) but the kernels folder takes no new file
    (an immutable folder, or one the user cannot write): the compile's temporary folder
    cannot be made there. That was an error, so the torch path; now the private folder."""
    monkeypatch.setattr(build, "_private", None)  # this test's own (another test's may hold the entry)
    cache.library.unlink()
    cache.manifest.unlink()
    (cache.library.parent / f"{healthy.name}.lock").touch()
    _freeze(cache.library.parent)
    try:
        with caplog.at_level(logging.WARNING, logger="nanokv"):
            built = build.build()
    finally:
        _thaw(cache.library.parent)
    assert built.data == healthy.library and built.path.parent == build._private
    assert "cannot write to the cache" in caplog.text and cache.compiles() == 1
    assert not cache.library.exists()


@pytest.mark.parametrize("blocked", ["root", "kernels"])
def test_an_unwritable_cache_builds_into_a_private_folder(cache, healthy, blocked):
    """A cache root (or its kernels folder) that is a file: mkdir fails even for root, as
    on a read-only mount. The kernels are built in a private temporary folder, used (not
    the torch path), said once, and the folder is gone at exit; the file is untouched."""
    shutil.rmtree(cache.root)
    if blocked == "root":
        cache.root.write_text("not a folder")
        file = cache.root
    else:
        cache.root.mkdir()
        file = cache.root / "kernels"
        file.write_text("not a folder")
    code = KERNELS_WORK + (
        "from nanokv.kernels import build, ffi\n"
        "ffi.load.cache_clear()\n"
        "assert ffi.load() is not None\n"  # from the private folder's entry, not a second build
        "print(build._private)\n"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-2] == "kernels work"
    private = Path(lines[-1])
    assert private.name.startswith("nanokv-kernels-") and not private.exists()
    assert out.stderr.count("cannot write to the cache") == 1 and str(private) in out.stderr
    assert "using the torch path" not in out.stderr
    assert cache.compiles() == 1 and file.read_text() == "not a folder"


def test_the_loaded_bytes_are_the_checked_ones(cache, healthy):
    """The library is loaded from a copy of the bytes that were checked: a cache file cut
    to nothing after the load does not reach the process (a library mapped from the file
    would fault: SIGBUS)."""
    code = (
        "from nanokv.kernels import ffi\n"
        "assert ffi.lib() is not None\n"
        f"open({str(cache.library)!r}, 'r+b').truncate(0)\n"
    ) + KERNELS_WORK
    out = run_python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "kernels work"
    assert cache.compiles() == 0 and cache.library.stat().st_size == 0


def test_concurrent_builders_compile_once_and_load_the_same_bytes(cache, healthy, monkeypatch):
    """torchrun ranks starting on an empty cache: one compiles, the others wait for it and
    take its entry (the wrapper compiler holds the first build until every builder has
    started)."""
    builders = 3
    cache.library.unlink()
    cache.manifest.unlink()
    monkeypatch.setenv("NK_BUILDERS", str(builders))
    code = (
        "import hashlib, sys\n"
        "from pathlib import Path\n"
        "from nanokv.kernels import build\n"
        f"Path({str(cache.started)!r}, sys.argv[1]).touch()\n"
        "built = build.build()\n"
        "data = Path(built).read_bytes() if isinstance(built, Path) else built.data\n"
        "print(hashlib.sha256(data).hexdigest())\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(builders)]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        outs.append(stdout.split()[-1])
    assert cache.compiles() == 1
    assert outs == [json.loads(healthy.manifest)["sha256"]] * builders
    assert_entry_is_healthy(cache, healthy)


def test_every_source_and_header_is_in_the_key_and_the_build(cache, healthy, tmp_path, monkeypatch):
    """The kernels are csrc's .c files, each compiled on its own and linked into one
    library, and the headers they include: a change to any one file (a header included
    only, too) is a new cache key and a new build, and the build compiles every .c file."""
    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC, csrc)
    monkeypatch.setattr(build, "CSRC", csrc)
    files = build.sources()
    assert {p.suffix for p in files} == {".c", ".h"} and len(files) == len(list(csrc.iterdir()))
    assert build.build().path == cache.library and cache.compiles() == 0  # the same bytes: the same entry
    names = {cache.library.name}
    for i, path in enumerate(files, 1):
        path.write_bytes(path.read_bytes() + b"\n")
        built = build.build()
        assert cache.compiles() == i and built.path.name not in names, path.name
        names.add(built.path.name)
    sources = [str(p) for p in files if p.suffix == ".c"]
    lines = cache.log.read_text().splitlines()
    compiled = [a for line in lines for a in line.split() if a.endswith(".c")]
    assert sorted(compiled) == sorted(sources * len(files))  # each build compiled each .c file once
    links = [line.split() for line in lines if " -c " not in f" {line} "]
    assert len(links) == len(files)
    for link in links:  # all the objects, in the sources' order
        assert [Path(a).stem for a in link if a.endswith(".o")] == [Path(c).stem for c in sources]


def test_the_parallel_build_is_the_one_call_build(healthy, tmp_path):
    """Each .c file compiled on its own (two at a time), then linked: the very library one
    `cc <flags> *.c` call builds, byte for byte (what the kernels compute is unchanged)."""
    variant = build.flags()
    sources = [str(p) for p in build.sources() if p.suffix == ".c"]
    serial = tmp_path / "serial.so"
    subprocess.run([healthy.cc, *variant, *sources, "-o", str(serial), "-lm"], check=True, timeout=600)
    (tmp_path / "work").mkdir()
    parallel = build._compile(healthy.cc, variant, tmp_path / "work", tmp_path / "parallel.so", jobs=2)
    assert parallel == serial.read_bytes() == healthy.library


def test_a_build_begun_in_the_background_is_waited_for(cache, healthy, monkeypatch):
    """start_build (the engine config calls it on the CPU) compiles while the model loads;
    the kernels' build() then takes that library instead of compiling again."""
    cache.library.unlink()
    cache.manifest.unlink()
    monkeypatch.setenv("NK_BUILDERS", "1")  # the compiler waits until the test says it started
    build.start_build()
    build.start_build()  # begun already: nothing more
    deadline = time.monotonic() + 60
    while cache.log.exists() is False and time.monotonic() < deadline:  # the background compiler runs
        time.sleep(0.05)
    assert cache.log.exists()
    (cache.started / "test").touch()
    built = build.build()
    assert built.data == healthy.library and cache.compiles() == 1
    assert build.build().path == cache.library and cache.compiles() == 1  # the committed entry, as before


def test_the_engine_config_begins_the_build_on_the_cpu(cache, healthy, model_dir, monkeypatch):
    from nanokv.engine.arg_utils import EngineArgs

    cache.library.unlink()
    cache.manifest.unlink()
    EngineArgs(model=model_dir, device="cpu", max_model_len=128).create_engine_config()
    deadline = time.monotonic() + 30
    while cache.log.exists() is False and time.monotonic() < deadline:  # compiling, before any build() call
        time.sleep(0.05)
    assert cache.log.exists()
    assert build.build().data == healthy.library and cache.compiles() == 1
    EngineArgs(model=model_dir, device="cpu", max_model_len=128).create_engine_config()  # a cache hit now
    assert build.build().data == healthy.library and cache.compiles() == 1


def test_a_process_exiting_mid_build_stops_its_compilers(cache, tmp_path, monkeypatch):
    """A background build still compiling when the process exits (a config made, no engine):
    its compilers are stopped, none is left running."""
    cache.library.unlink()
    cache.manifest.unlink()
    monkeypatch.setenv("NK_BUILDERS", "99")  # never reached: the compiler would wait its 60 s
    code = (
        "import time\n"
        "from pathlib import Path\n"
        "from nanokv.kernels import build\n"
        "build.start_build()\n"
        f"log = Path({str(cache.log)!r})\n"
        "deadline = time.monotonic() + 60\n"
        "while not log.exists() and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "assert log.exists()\n"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    pids = [int(line) for line in (tmp_path / "pids").read_text().split()]
    assert pids
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def test_a_forked_child_builds_for_itself(cache, healthy, monkeypatch):
    """A process forked while a background build runs has no build thread: its build()
    finds the entry (or compiles) instead of waiting for a thread that is not there."""
    from concurrent.futures import Future

    monkeypatch.setattr(build, "BUILD_TIMEOUT_S", 5)  # waiting for the missing thread: a TimeoutError
    monkeypatch.setitem(build._started, build._started_key(None, False), Future())  # never finishes
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 when it got the library
        code = 1
        try:
            code = 0 if build.build().data == healthy.library else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and cache.compiles() == 0
