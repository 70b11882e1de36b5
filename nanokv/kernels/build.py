"""Building cpu.c: the compiler, the cache directory and the key a build is cached under.

The shared library is built with the machine's C compiler (`cc -O3 -march=native
-fopenmp`) into a cache directory keyed by the source, the flags, the compiler and the
CPU, the way Triton caches its kernels.

Variants (each built and cached on its own): the vector width, 16 floats where the compiler
targets AVX-512 and 8 otherwise unless NANOKV_CPU_WIDTH (or `width`) forces 8 or 16, so
that both widths build and are tested on any x86-64; and `portable`, which leaves out the
int8 kernels' intrinsics (AVX2, VNNI) for their plain-C path, optionally with the VNNI
paths' unsigned-offset arithmetic (tests compare them all).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger("nanokv")

SOURCE = Path(__file__).with_name("cpu.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]


WIDTHS = (8, 16)


def width() -> int | None:
    """NANOKV_CPU_WIDTH: 8 or 16 forces the vector width (floats); unset, empty or 'native':
    the compiler's choice for this CPU. Read on every call."""
    value = os.environ.get("NANOKV_CPU_WIDTH", "").strip()
    if value in ("", "native"):
        return None
    if value not in {str(w) for w in WIDTHS}:
        raise ValueError(f"NANOKV_CPU_WIDTH={value!r}: use 8, 16 or native")
    return int(value)


PORTABLE = {False: [], True: ["-DNK_PORTABLE"], "offset": ["-DNK_PORTABLE", "-DNK_INT8_OFFSET"]}


def flags(width: int | None = None, portable: bool | str = False) -> list[str]:
    """The compiler flags of one variant. portable=True: the int8 kernels' plain-C path;
    "offset": the same with the VNNI paths' arithmetic (activations + 128, column sums off)."""
    if width is not None and width not in WIDTHS:
        raise ValueError(f"vector width {width}: use one of {WIDTHS}")
    extra = [f"-DNK_WIDTH={width}"] if width is not None else []
    return FLAGS + extra + PORTABLE[portable] + ["-Wno-psabi"]


def switched_off() -> bool:
    """NANOKV_CPU_KERNELS=0: the torch path everywhere, nothing built."""
    return os.environ.get("NANOKV_CPU_KERNELS", "1") == "0"


def compiler() -> str | None:
    """$CC, else cc or gcc on PATH; None when there is none (looked up, not run)."""
    cc = os.environ.get("CC")
    return shutil.which(cc) if cc else shutil.which("cc") or shutil.which("gcc")


def can_build() -> bool:
    """Switched on and a compiler at hand: what choosing the kernels may rely on before
    building them. Compiles nothing; ffi.available() is the build itself."""
    return not switched_off() and compiler() is not None


def cache_root() -> Path:
    """nanokv's cache: $NANOKV_CACHE_DIR, else $XDG_CACHE_HOME/nanokv or ~/.cache/nanokv
    (the kernels are built into its `kernels` folder, gguf.py keeps its `gguf` folder)."""
    return Path(os.environ.get("NANOKV_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "nanokv"))


def cache_dir() -> Path:
    return cache_root() / "kernels"


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _key(cc: str, flags: list[str]) -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(flags).encode(), version.encode(),
                                     _cpu_signature().encode(), platform.machine().encode()]))
    return key.hexdigest()[:16]


def build(width: int | None = None, portable: bool | str = False) -> Path:
    """The shared library's path (of one variant: see flags), compiled first unless the
    cache holds it."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    variant = flags(width, portable)
    target = cache_dir() / f"nanokv_cpu_{_key(cc, variant)}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([cc, *variant, str(SOURCE), "-o", str(out), "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed to build {SOURCE.name}:\n{proc.stderr[-2000:]}")
        os.replace(out, target)  # atomic: concurrent builders (torchrun ranks) agree
    logger.info("built nanokv CPU kernels: %s", target)
    return target
