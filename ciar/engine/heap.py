"""The engine process's Python heap: its start-up frozen out of the cyclic collector's reach, its collections counted.

    heap.freeze()        # once the engine is built: one full collection, then gc.freeze(); pauses timed from here
    heap.stats()         # {"frozen": objects, "collections": [gen0, gen1, gen2], "pauses": [...],
                         #  "pause_total_ms": [...], "pause_max_ms": [...]}  (per generation)
    heap.keep_freed_memory()  # the C allocator keeps the blocks it frees for the next tensors (glibc's mallopt)

Python's cyclic collector stops the thread that triggers it while it walks a generation. Its oldest generation holds
everything that survived start-up: torch's and Ray's modules, the world, the engine's tables (some 390,000 objects in
an engine core with the shipped world), and a full collection walks them all, 110-170 ms on the CPU this was measured
on. It comes every so often, in the middle of whatever step allocated the last object: a stall of several steps at a
GPU's pace, in the replies' p99. Freezing the heap once the engine is built (vLLM's workers do it after their warm-up)
moves those objects to a generation the collector never walks (a full collection after it: under a millisecond
there); the objects the engine makes while serving are collected as before. Reference counting still frees what the
frozen objects stop using; only reference cycles among them are kept. The serving processes call `freeze` (the
Verifier replica after building its engine, the engine core's process after building its verifier, the Ingress and
the simulated phones once built); a library user's process is left as it is.

The C heap under torch's host tensors: glibc's malloc hands a freed block of more than its threshold back to the
kernel (`munmap`, or trimming the heap's top), so the next tensor of that size faults its pages in again, one by one.
An engine on a CPU makes and frees the same large tensors every step (the judge's [rows, vocabulary] logits and
probabilities: 5 MiB at 80 rows of LlamaGen's 16,384 codes, 42 MiB at 640), and paid for it: guidance over those 80
rows took 1.5-7 ms where the arithmetic takes 0.4-0.8 ms (2026-11-29f). `keep_freed_memory` has the allocator take
every block from its heaps, no block mapped apart (`mallopt`: at most 0 mappings), and keep up to 1 GiB of free
space at a heap's top: a freed block serves the next tensor. Raising only the mmap threshold stops at glibc's
largest, 32 MiB, which 128 sessions' tensors pass: a round there took 178.5 ms against 116.2 (2026-11-29f). (vLLM's
CPU backend recommends tcmalloc, which keeps freed memory too.) The engine's processes call it once their engine is
built (the Verifier replica, the engine core), so that start-up's large temporary host tensors (a checkpoint read
before it moves to the accelerator) went back to the kernel as before; the price is that a serving process keeps its
peak host memory. (glibc still maps a block apart where a heap cannot grow: a thread's heap past 64 MiB, the main
heap when the kernel refuses it.)
"""

from __future__ import annotations

import ctypes
import gc
import logging
import threading
import time

__all__ = ["freeze", "keep_freed_memory", "stats", "unfreeze"]

logger = logging.getLogger(__name__)
# Reentrant: `stats` allocates while holding it, an allocation can start a collection on that same thread, and the
# collection's end calls `_on_gc`, which takes it again (a plain Lock hung that thread for good, and with it the
# process's collector, which counts itself as collecting until the callback returns).
_lock = threading.RLock()
_pauses = {"count": [0, 0, 0], "total_ms": [0.0, 0.0, 0.0], "max_ms": [0.0, 0.0, 0.0]}
_started: dict[int, float] = {}  # thread id -> when its collection started
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters
TRIM_THRESHOLD = 1 << 30  # free space kept at a heap's top


def _on_gc(phase: str, info: dict) -> None:
    """gc.callbacks: time each collection (it runs on the thread that triggered it)."""
    me = threading.get_ident()
    if phase == "start":
        _started[me] = time.perf_counter()
        return
    t0 = _started.pop(me, None)
    if t0 is None:
        return
    ms, g = 1e3 * (time.perf_counter() - t0), min(int(info.get("generation", 2)), 2)
    with _lock:
        _pauses["count"][g] += 1
        _pauses["total_ms"][g] += ms
        _pauses["max_ms"][g] = max(_pauses["max_ms"][g], ms)


def freeze(log=logger.info) -> int:
    """One full collection, then every object alive moved out of the collector's reach (`gc.freeze`); collections
    timed from now on (`stats`). Idempotent: a second call freezes what has been made since. -> objects frozen."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    full_ms = 1e3 * (time.perf_counter() - t0)
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)
    n = gc.get_freeze_count()
    log("heap frozen: %d objects out of the collector's reach (a full collection over them took %.0f ms)", n, full_ms)
    return n


def unfreeze() -> None:
    """`freeze` undone: the frozen objects back in the oldest generation, collections no longer timed (a process
    that froze for a while only: a benchmark's section, a test)."""
    gc.unfreeze()
    if _on_gc in gc.callbacks:
        gc.callbacks.remove(_on_gc)


def stats() -> dict:
    """This process's collector: objects frozen, collections per generation (since the interpreter started), and
    since `freeze` the pauses per generation (count, total and longest, milliseconds)."""
    with _lock:
        pauses = {"pauses": list(_pauses["count"]), "pause_total_ms": [round(x, 3) for x in _pauses["total_ms"]],
                  "pause_max_ms": [round(x, 3) for x in _pauses["max_ms"]]}
    return {"frozen": gc.get_freeze_count(), "collections": [s["collections"] for s in gc.get_stats()], **pauses}


def keep_freed_memory(log=logger.info) -> bool:
    """Ask the C allocator (glibc's malloc) to keep the blocks it frees: every block from its heaps rather than a
    mapping of its own, and up to 1 GiB free at a heap's top kept rather than returned (see the module docstring).
    -> whether the allocator took both settings (False where the C library is not glibc: macOS, musl)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    log("host allocator: freed blocks kept (no block mapped apart, %d MiB kept at a heap's top): %s",
        TRIM_THRESHOLD >> 20, "yes" if ok else "not taken")
    return ok
