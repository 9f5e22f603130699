"""glibc's malloc while XLA loads a compiled program from the store (`executables._load`).

A load rebuilds the program's HLO module, buffer assignment and thunks from their protos: a great
many small objects made, copied and freed. `perf` on the load of the runner's device-loop program
(realistic chunked, 59,816 HLO instructions, 1.9-2.0 s; 2026-12-07, twenty-ninth session): glibc's
malloc and free 24% of its samples (`malloc_consolidate` and `unlink_chunk` 13%: freed small
chunks wait in fastbins, which every larger request first merges), and the kernel 28%
(page faults 17% as the heap grows, `mprotect` 10%: glibc growing a thread's heap; with the pad
below it left the profile's top entries).
So while any thread loads, fastbins are off (M_MXFAST 0) and the heap's top keeps TOP_PAD of
headroom (M_TOP_PAD); both go back to glibc's defaults once the last load ends. Setting M_TOP_PAD
also stops glibc from moving its mmap threshold (it stays where the process had taken it).
Measured (scratch `loadmx2.py`, `abmalloc.sh`; new processes, alternated):
- that program's load alone: 1.49-1.66 s against 1.99-2.03 s (fastbins off alone 1.66-1.80 s);
- a repeated run of realistic chunked on the device loop, four rounds: warm-up 1.73-1.87 s
  against 2.21-2.57 s (fastbins off alone 1.92-2.03 s), throughput 2,100-2,197 against
  1,912-2,164 tok/s; realistic continuous on the host loop: warm-up 1.03-1.17 s against
  1.08-1.41 s, throughput 2,088-2,354 against 1,751-2,282 tok/s (a slow phase of this VM);
- for a whole process (GLIBC_TUNABLES), compilation gained nothing (first runs 13.8-15.8 s
  against 12.2-16.6 s), so only loads are set.

Nothing changes where the C library is not glibc, or where the user tuned glibc's malloc
(GLIBC_TUNABLES or a MALLOC_*_ variable), whose settings this would override.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from functools import cache

M_MXFAST, M_TOP_PAD = 1, -2  # mallopt's parameters (malloc.h)
DEFAULT_MXFAST = 64 * ctypes.sizeof(ctypes.c_size_t) // 4  # glibc's defaults (mallopt(3))
DEFAULT_TOP_PAD = 128 * 1024
TOP_PAD = 256 << 20

_lock = threading.Lock()
_loads = 0  # loads in progress, over every thread


@cache
def _mallopt():
    """glibc's `mallopt`, or None: another C library, or malloc tuned by the user."""
    if "GLIBC_TUNABLES" in os.environ or any(
        k.startswith("MALLOC_") and k.endswith("_") for k in os.environ
    ):
        return None
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols: the C library its malloc is from
        libc.gnu_get_libc_version  # noqa: B018  (glibc's own: absent from musl and others)
        return libc.mallopt
    except (OSError, AttributeError, TypeError):  # TypeError: Windows takes no None
        return None


def _set(mxfast: int, top_pad: int) -> None:
    mallopt = _mallopt()
    if mallopt is not None:
        mallopt(M_MXFAST, mxfast)
        mallopt(M_TOP_PAD, top_pad)


@contextlib.contextmanager
def loading():
    """glibc's malloc set for loading programs while any thread is inside."""
    global _loads
    with _lock:
        _loads += 1
        if _loads == 1:
            _set(0, TOP_PAD)
    try:
        yield
    finally:
        with _lock:
            _loads -= 1
            if _loads == 0:
                _set(DEFAULT_MXFAST, DEFAULT_TOP_PAD)
