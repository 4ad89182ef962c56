"""Pipelines' lifetime on the Ray runtime (`RayRuntime`'s part that has the hosts drop a
pipeline the driver let go: its threads, executables and buffers there)."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import weakref
from collections.abc import Sequence
from typing import Any


class PipelineDrops:
    """`RayRuntime`'s pipeline drops (a mixin over its `actors`, `_closed`, `_drops`,
    `_dropper` and `_dropper_lock`)."""

    actors: list[Any]
    _closed: bool
    _drops: queue.SimpleQueue[Any]
    _dropper: threading.Thread | None
    _dropper_lock: Any

    def start_dropper(self) -> None:
        """Start the thread that sends the drops of pipelines the driver let go (before the
        first one can be: a finalizer must not start threads)."""
        with self._dropper_lock:
            if self._dropper is None and not self._closed:
                self._dropper = threading.Thread(
                    target=_send_drops,
                    args=(weakref.ref(self), self._drops),
                    name="jaxreshard-drops",
                    daemon=True,
                )
                self._dropper.start()

    def drop_pipeline(
        self, key: str, hosts: Sequence[int], wait_s: float | None = None, watch: Any = None
    ) -> None:
        """Have `hosts` drop pipeline `key` (`HostActor.pipeline_drop`: its threads end, its
        executables and buffers go). Without `wait_s`, return at once: the messages go from the
        drop thread (`start_dropper`), so this is safe in a finalizer; that thread first waits
        for the steps `watch` (the pipeline's `StepWatch`) still watches, then ends it. With
        `wait_s`, send them now and wait at most `wait_s` for the hosts to have dropped it.
        Never raises; nothing to do once the runtime is shut down (the actors are gone with
        their pipelines)."""
        if self._closed:
            if watch is not None:
                watch.close(join_s=None)
            return
        if wait_s is None:
            self._drops.put((key, tuple(hosts), watch))  # (SimpleQueue.put: finalizer-safe)
            return
        refs = _tell_drop(self, key, hosts)
        if not refs:
            return
        try:
            import ray

            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
            for ref in ready:  # an error (a dead actor) is read, so that Ray does not log it
                with contextlib.suppress(Exception):
                    ray.get(ref, timeout=0)
        except Exception:  # Ray is going down
            logging.getLogger(__name__).debug("waiting for the drop of %s failed", key)


def _tell_drop(runtime: Any, key: str, hosts: Sequence[int]) -> list[Any]:
    """Send pipeline `key`'s drop to `hosts`; the calls' references (none that cannot go)."""
    refs = []
    for h in hosts:
        try:
            refs.append(runtime.actors[h].pipeline_drop.remote(key))
        except Exception:  # a dead actor, or Ray going down: nothing left to drop there
            logging.getLogger(__name__).debug("could not tell host %d to drop %s", h, key)
    return refs


def _send_drops(runtime_ref: Any, drops: queue.SimpleQueue[Any]) -> None:
    """The drop thread: send each dropped pipeline's drop to its hosts, without waiting for
    them; ends when the runtime shuts down (or is dropped)."""
    while True:
        item = drops.get()
        if item is None:
            return
        key, hosts, watch = item
        if watch is not None:  # its steps in flight finish first (each has its deadline)
            watch.drain(None)
            watch.close(join_s=None)
        runtime = runtime_ref()
        if runtime is None or runtime._closed:
            return
        refs = _tell_drop(runtime, key, hosts)
        del runtime, refs, watch, item
