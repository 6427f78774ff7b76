"""Tricks that exist only for speed, in one place outside the domain core.

Each keeps a figure of ``bench/`` within its goal; remove one only with that benchmark beside it.

- ``untrack``: CPython's ``PyObject_GC_UnTrack`` for objects that can be in no reference cycle
  (``core.surface.SurfaceNode``). A tracked resident node lengthens every full collection of the
  cyclic collector, a pause of the event loop of about 0.1 ms per thousand objects
  (``bench/bench_restore.py`` prints the tracked objects per node and the calls next door).
- ``in_steps``: runs work written as steps (``core.steps``: a generator that yields where the
  loop may run other calls) on the event loop, letting other calls run every ``STEP_S`` and
  waiting while they are ready (``let_others_run``), so a large batch's checks, admission,
  pricing and snapshot never hold the loop for long (``bench/bench_batches.py``: a pressure
  check's p99 beside 1,000-event appends), nor do the replies of ``GetSurface`` and
  ``BuildRequest`` (``service.requests``, sent as made: ``api.replies``;
  ``bench/bench_neighbours.py``: another session's calls beside large reads).
- ``free_in_steps``: frees a committed large batch's lists in steps, in the background (freeing
  a million-entry list at once is one long pause).
"""

from __future__ import annotations

import asyncio
import ctypes
import time
from collections.abc import Callable, Generator
from typing import Any, TypeVar

T = TypeVar("T")

# No step of work run ``in_steps`` holds the event loop longer than this.
STEP_S = 0.0002
# A large batch's work is background work: after each step it waits while other callbacks are
# ready (a pressure check's next turn, a reply to send), for at most this many loop turns and
# this long, so that a flood of small calls slows it down (it keeps a fifth of the loop) but
# never stops it: a restore's caller waits for it too.
YIELD_TURNS = 32
YIELD_S = 4 * STEP_S


def _untracker() -> Callable[[object], None]:
    """CPython's ``PyObject_GC_UnTrack`` (a no-op where the interpreter has none)."""
    try:
        return ctypes.PYFUNCTYPE(None, ctypes.py_object)(("PyObject_GC_UnTrack", ctypes.pythonapi))
    except (AttributeError, OSError):
        return lambda _: None


#: Takes an object out of the cyclic collector's sight: only for one that can be in no cycle.
untrack = _untracker()


async def in_steps(steps: Generator[None, None, T]) -> T:
    """Run ``steps`` to its end on the event loop, letting other calls run whenever it has held
    the loop for ``STEP_S`` (``let_others_run``); its value. Cancelled, it closes ``steps``
    (which may roll back)."""
    deadline = time.perf_counter() + STEP_S
    try:
        while True:
            try:
                next(steps)
            except StopIteration as done:
                result: T = done.value
                return result
            if time.perf_counter() >= deadline:
                await let_others_run()
                deadline = time.perf_counter() + STEP_S
    finally:
        steps.close()


async def let_others_run() -> None:
    """Yield the loop, then go on waiting while other callbacks are ready, for at most
    ``YIELD_TURNS`` turns and ``YIELD_S``. A call next door needs several loop turns (its
    request, its handler, its reply): without the wait, each of them would come after one more
    step of this work."""
    await asyncio.sleep(0)
    # ``_ready`` is asyncio's own queue of runnable callbacks; another loop may not have one.
    ready = getattr(asyncio.get_running_loop(), "_ready", None)
    if ready is None:
        return
    until = time.perf_counter() + YIELD_S
    for _ in range(YIELD_TURNS):
        if not ready or time.perf_counter() >= until:
            return
        await asyncio.sleep(0)


# Entries of a committed batch's lists freed between pauses, and the tasks freeing them (asyncio
# keeps only weak references to tasks).
FREE_STEP = 64
_freeing: set[asyncio.Future[None]] = set()


def free_in_steps(held: list[list[Any]]) -> None:
    """Free ``held`` (``AdmittedBatch.release``) in steps on the loop, in the background."""
    task = asyncio.ensure_future(in_steps(_emptied(held)))
    _freeing.add(task)
    task.add_done_callback(_freeing.discard)


def _emptied(held: list[list[Any]]) -> Generator[None, None, None]:
    for items in held:
        while items:
            del items[-FREE_STEP:]
            yield
