"""Tricks that exist only for speed, in one place outside the domain core.

Each keeps a figure of ``bench/`` within its goal; remove one only with that benchmark beside it.

- ``untrack``: CPython's ``PyObject_GC_UnTrack`` for objects that can be in no reference cycle
  (``core.surface.SurfaceNode``). A tracked resident node lengthens every full collection of the
  cyclic collector, a pause of the event loop of about 0.1 ms per thousand objects
  (``bench/bench_restore.py`` prints the tracked objects per node and the calls next door).
- ``in_steps``: runs work written as steps (``core.steps``: a generator that yields where the
  loop may run other calls) on the event loop, letting other calls run every ``STEP_S`` and
  waiting while they are ready (``let_others_run``) (a turn of the loop is skipped when it
  would run nothing else: ``_alone``), so a large batch's checks, admission, pricing and
  snapshot never hold the loop for long (``bench/bench_batches.py``: a pressure
  check's p99 beside 1,000-event appends), nor do the replies of ``GetSurface`` and
  ``BuildRequest`` (``service.requests``, sent as made: ``api.replies``;
  ``bench/bench_neighbours.py``: another session's calls beside large reads).
- ``free_in_steps``: frees a committed large batch's lists in steps, in the background (freeing
  a million-entry list at once is one long pause).
"""

from __future__ import annotations

import asyncio
import ctypes
import select
import time
import weakref
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
    the loop for ``STEP_S`` (``let_others_run``) and they have something to run (``_alone``);
    its value. Cancelled, it closes ``steps`` (which may roll back)."""
    loop = asyncio.get_running_loop()
    deadline = time.perf_counter() + STEP_S
    try:
        while True:
            try:
                next(steps)
            except StopIteration as done:
                result: T = done.value
                return result
            if time.perf_counter() >= deadline:
                if not _alone(loop):
                    await let_others_run()
                deadline = time.perf_counter() + STEP_S
    finally:
        steps.close()


# A poll object per loop watching the loop's own selector descriptor (``_alone``).
_pollers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()


def _alone(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether a turn of ``loop`` would run nothing but the caller: no callback ready, no timer
    due, no I/O waiting (its epoll descriptor is readable when any descriptor it watches has an
    event; polling it takes none). A turn costs tens of microseconds of Python (a large batch's
    steps took one every ``STEP_S``, a tenth of their time); this costs one ``poll``. False
    where it cannot be told (a loop without asyncio's queues or an epoll selector)."""
    ready = getattr(loop, "_ready", None)
    scheduled = getattr(loop, "_scheduled", None)
    if ready or ready is None or scheduled is None:
        return False
    if scheduled and scheduled[0].when() <= loop.time():
        return False
    poller = _pollers.get(loop)
    if poller is None:
        poller = _pollers[loop] = _poller_of(loop)
    return poller is not None and not poller.poll(0)


def _poller_of(loop: asyncio.AbstractEventLoop) -> Any:
    """A poll object watching ``loop``'s epoll descriptor for input, or None (no such one)."""
    # ``selectors.EpollSelector`` keeps its ``select.epoll`` as ``_selector``.
    epoll = getattr(getattr(loop, "_selector", None), "_selector", None)
    if not hasattr(select, "epoll") or not isinstance(epoll, select.epoll):
        return None
    poller = select.poll()
    poller.register(epoll.fileno(), select.POLLIN)
    return poller


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
