"""Builds the C kernels in kernels/orca_kernels/csrc on first use and loads them with ctypes.

A C compiler is all it needs (no torch headers, so a build takes about a second). The shared object
is cached under the orca-serve cache directory, keyed by the source, the flags, the compiler and the
CPU's instruction set (it is built with -march=native), so a second start loads it at once. It is
linked against the OpenMP runtime torch already loaded (same soname), so the kernels share torch's
thread pool and thread count instead of starting a second one. With no compiler, or a failed build,
`load` returns None and the caller keeps its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from shared import env

log = logging.getLogger("orca.kernels")

CSRC = Path(__file__).parent / "csrc"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=gnu11", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math")
"""-fno-trapping-math: nothing here enables floating-point traps, and with GCC's default the float-to-int
conversion in the attention kernel's exp kept its softmax loop scalar (values are unchanged: no
reassociation, no fast-math)."""


def _cpu_signature() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return f"{platform.machine()} {flags}"


def _compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


@cache
def load(name: str) -> ctypes.CDLL | None:
    """kernels/orca_kernels/csrc/<name>.c built and loaded, or None where it cannot be built here."""
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler found: the %s CPU kernel falls back to torch (slower)", name)
        return None
    source = (CSRC / f"{name}.c").read_bytes()
    headers = b"".join(path.read_bytes() for path in sorted(CSRC.glob("*.h")))
    key = hashlib.sha256(b"\0".join([source, headers, " ".join(FLAGS).encode(), compiler.encode(),
                                     _cpu_signature().encode()])).hexdigest()[:16]
    target = env.cache_dir() / "kernels" / f"{name}-{key}.so"
    if not target.is_file():
        try:
            _build(compiler, CSRC / f"{name}.c", target)
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            log.warning("building the %s CPU kernel failed, falling back to torch: %s", name, detail)
            return None
    return ctypes.CDLL(str(target))


def _build(compiler: str, source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: several workers may build at once, none sees half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, str(source), "-o", tmp, "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
