"""Building cpu.c: the compiler, the cache directory and the key a build is cached under.

The shared library is built with the machine's C compiler (`cc -O3 -march=native
-fopenmp`) into a cache directory keyed by the source, the flags, the compiler and the
CPU, the way Triton caches its kernels.
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


def cache_dir() -> Path:
    root = os.environ.get("NANOKV_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "nanokv")
    return Path(root) / "kernels"


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _key(cc: str) -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode(),
                                     _cpu_signature().encode(), platform.machine().encode()]))
    return key.hexdigest()[:16]


def build() -> Path:
    """The shared library's path, compiled first unless the cache holds it."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    target = cache_dir() / f"nanokv_cpu_{_key(cc)}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(out), "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed to build {SOURCE.name}:\n{proc.stderr[-2000:]}")
        os.replace(out, target)  # atomic: concurrent builders (torchrun ranks) agree
    logger.info("built nanokv CPU kernels: %s", target)
    return target
