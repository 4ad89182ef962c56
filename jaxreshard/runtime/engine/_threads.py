"""The runtime's worker threads: daemons that hold no array while idle, joined on close.

[Note: threads at exit]
A thread that is inside a JAX call while the interpreter finalizes aborts the whole process
(`terminate called after throwing an instance of ''`): when the call returns, the thread asks for
the GIL back, CPython ends a thread that does so during finalization (`pthread_exit`), and that
forced unwind through jaxlib's C++ frames reaches a `noexcept` destructor. Dropping the last
reference to a `jax.Array` is such a call (its buffers are freed without the GIL), so a sender
thread that kept the last value it moved in a local, woken at exit to end, aborted a process
that had run every step correctly (network emulation, where every transfer has a sender thread:
about half the runs on two cores). And a thread stuck in a call that never returns (a hung device
or host callback, after a failed step) keeps the process from exiting at all if it is not a
daemon: `concurrent.futures` joins its pools' workers at exit.

A thread blocked in `jax.block_until_ready` is inside JAX all along, and wakes in it every so
often to look for signals: if its computation never ends (a host callback that raised in one
device of an SPMD stage leaves the others in a collective for good), it aborts the process at
exit however the rest ends.

So the runtime's threads are daemons (`DaemonPool`, the channels' sender threads), drop every
array before they wait for more work, and `close` joins them within a deadline.
`runtime._api` registers an exit hook when the first pipeline is built, after JAX's own (exit
hooks run last-registered first), that closes every local pipeline while JAX is still whole.
Sender threads wait for a value by polling (`wait_ready`: outside JAX between polls, and they
give up when their step has failed or their pipeline closes): a stage that raised in a host
callback on one device of a two-device mesh left a sender blocked for good, and the process
aborted at exit after the step's error. `Completion`'s wait, the last of every local step,
blocks instead (a poll's pause would add to every step); when it gives up on a hung step, JAX's
own exit hook waits for that computation too (`jax.effects_barrier`, or XLA's collective
timeout), so the process is held there, not aborted by our thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import jax

# How long `close` waits for idle threads to end (they take microseconds; a stuck one never).
JOIN_S = 2.0
# `wait_ready`'s polls: the first pause, and the longest (a wait overshoots by at most this).
POLL_FIRST_S, POLL_MAX_S = 20e-6, 200e-6


def wait_ready(tree: Any, stop: Callable[[], bool] | None = None) -> bool:
    """Wait until every JAX array of `tree` has been computed, polling with growing pauses
    (see [Note: threads at exit]); False if `stop()` turned true first. Raises the error of a
    computation that failed.

    Unlike `jax.block_until_ready`, the waiting thread is outside JAX between polls, and the
    wait can be given up."""
    arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    pause = POLL_FIRST_S
    for x in arrays:
        while not (x.is_deleted() or _is_ready(x)):
            if stop is not None and stop():
                return False
            time.sleep(pause)
            pause = min(pause * 1.5, POLL_MAX_S)
    jax.block_until_ready([x for x in arrays if not x.is_deleted()])  # at once, or raises
    return True


def _is_ready(x: Any) -> bool:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return x.is_ready()


class DaemonPool:
    """`num_workers` daemon threads that run submitted calls, like a `ThreadPoolExecutor` whose
    workers never keep the interpreter from exiting (see [Note: threads at exit]).

    Args:
        num_workers: how many threads (started at once).
        name: their name's prefix.
    """

    def __init__(self, num_workers: int, name: str):
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self.threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(num_workers)
        ]
        for thread in self.threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run `fn(*args)` on a worker; its `Future` has the result or the exception."""
        if self._closed:
            raise RuntimeError("this pool was shut down")
        future: Future[Any] = Future()
        self._queue.put((future, fn, args))
        return future

    def shutdown(self, join_s: float | None = JOIN_S) -> None:
        """Cancel the calls not started, end the workers, and wait at most `join_s` for those
        not stuck in a call (None: do not wait). Idempotent."""
        if not self._closed:
            self._closed = True
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
            for _ in self.threads:
                self._queue.put(None)
        if join_s is not None:
            join_all(self.threads, join_s)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            _run(*item)
            del item  # idle, hold nothing (see [Note: threads at exit])


def _run(future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args)
    except BaseException as e:
        future.set_exception(e)
    else:
        future.set_result(result)


def join_all(threads: Iterable[threading.Thread], join_s: float) -> list[threading.Thread]:
    """Join `threads` (not the calling one) within `join_s` in all; return those still alive."""
    deadline = time.monotonic() + join_s
    alive = []
    for thread in threads:
        if thread is threading.current_thread():
            continue
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            alive.append(thread)
    return alive
