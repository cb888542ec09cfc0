"""The one thing pyproject.toml cannot say on every setuptools a device has: the optional C
extension ``vllm_draft_offload._fastread`` (fast_io.py says what it is for).

``optional=True``: without a C compiler or Python's headers the build warns and the install
goes on, and fast_io falls back to its Python loop (``fast_io.NATIVE`` says which one runs).
"""

from __future__ import annotations

import sys
import sysconfig

from setuptools import Extension, setup

XXHASH = "vllm_draft_offload/_vendor/xxhash"


def _x86() -> bool:
    """xxHash's runtime dispatcher (AVX2/AVX-512 picked at run time, built with baseline
    flags, as python-xxhash builds it) exists for x86 only."""
    platform = sysconfig.get_platform().lower()
    return any(arch in platform for arch in ("x86_64", "amd64", "i686", "i386"))


sources = ["vllm_draft_offload/_fastread.c"]
macros: list[tuple[str, str | None]] = []
if _x86():
    sources.append(f"{XXHASH}/xxh_x86dispatch.c")
    macros.append(("FASTREAD_X86_DISPATCH", "1"))

setup(
    ext_modules=[
        Extension(
            "vllm_draft_offload._fastread",
            sources=sources,
            include_dirs=[XXHASH],
            define_macros=macros,
            depends=[f"{XXHASH}/xxhash.h", f"{XXHASH}/xxh_x86dispatch.h"],
            # -O3: xxHash's own recommendation for XXH3; hidden symbols: the dispatcher's
            # functions stay out of the process's symbol table (PyInit is exported anyway).
            extra_compile_args=[] if sys.platform == "win32" else ["-O3", "-fvisibility=hidden"],
            optional=True,
        )
    ],
)
