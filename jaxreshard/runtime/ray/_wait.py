"""Waiting for host actors: deadlines, progress, failures, and the errors that name them.

`HostWaits._wait` is the one way `RayRuntime` waits for its host actors' calls: with a deadline
from the start of the wait, or one that moves with the hosts' progress (see [Note: progress
deadline] in `ray/_pipeline.py`); a host whose call fails or whose actor dies is named at once,
and the others are told to stop (`_abort`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

PROBE_EVERY_S = 1.0  # how often a wait with a progress deadline asks the busy hosts


class RuntimeBroken(RuntimeError):
    """A host actor died (`host`, where known), or hosts of a stage that spans hosts may be
    stuck in its collectives; the runtime must be shut down and started again."""

    host: int | None = None


class HostWaits:
    """`RayRuntime`'s waits (a mixin over its `actors`, `infos`, `timeout_s`)."""

    actors: list[Any]
    infos: list[dict[str, Any]]
    timeout_s: float
    _to_free: dict[int, list[tuple[str, Any]]]
    _broken: str | None
    _communicators: set[tuple[str, tuple[int, ...]]]

    flush_frees: Callable[[], None]  # (RayRuntime.flush_frees)

    def _wait(
        self,
        calls: dict[int, Any],
        what: str,
        timeout_s: float | None = None,
        *,
        work_id: str | None = None,
        progress: Callable[[int], Any] | None = None,
    ) -> dict[int, Any]:
        """Wait for every host's call; raise at once, naming the host, if one fails or dies.

        Without `progress`, the wait ends `timeout_s` (default: the runtime's) after it starts.
        With it (`progress(h)` calls host h for a report `(count, last, idle_s)` of what its
        part has done so far), it ends only when no host still busy has made progress for
        `timeout_s`: a long, healthy call never times out (see [Note: progress deadline]).
        """
        if self._to_free:
            self.flush_frees()
        import ray

        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        deadline = start + timeout_s
        pending = {ref: h for h, ref in calls.items()}
        results: dict[int, Any] = {}
        probes: dict[Any, int] = {}  # progress calls in flight -> host
        reports: dict[int, tuple[int, str, float]] = {}  # host -> its last report
        asked = start
        while pending:
            now = time.monotonic()
            if progress is not None:
                if now - asked >= PROBE_EVERY_S:
                    asked = now
                    busy = set(pending.values()) - set(probes.values())
                    probes.update({progress(h): h for h in sorted(busy)})
                if probes:
                    answered, _ = ray.wait(list(probes), num_returns=len(probes), timeout=0)
                    for ref in answered:
                        h = probes.pop(ref)
                        try:
                            report = ray.get(ref, timeout=PROBE_EVERY_S)  # ready: at once
                        except Exception:  # a dead or failed host: its own call says so
                            continue
                        if report[0] != reports.get(h, (0,))[0]:
                            deadline = now + timeout_s  # it made progress
                        reports[h] = report
            left = deadline - now
            if left <= 0:
                busy_hosts = sorted(pending.values())
                self._abort(work_id, f"{what} timed out")
                if progress is None:
                    raise TimeoutError(
                        f"{what} did not finish within {timeout_s:g} s; hosts "
                        f"{self._named_hosts(busy_hosts)} are still busy (raise "
                        "init(timeout_s=...) for bigger arrays)"
                    )
                states = [self._progress_of(h, reports.get(h), now - start) for h in busy_hosts]
                raise TimeoutError(
                    f"{what} made no progress for {timeout_s:g} s (after {now - start:.0f} s in "
                    f"all): {'; '.join(states)} (a hung device, or a host callback that never "
                    "returns?); raise PipelineConfig.timeout_s if one action legitimately takes "
                    "longer"
                )
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(left, PROBE_EVERY_S))
            for ref in ready:
                h = pending.pop(ref)
                try:
                    results[h] = ray.get(ref, timeout=max(1.0, left))  # ready: at once
                except ray.exceptions.GetTimeoutError:  # (never, for a ready result)
                    self._abort(work_id, f"{what} timed out")
                    raise TimeoutError(
                        f"{what}: host {h} ({self._hostname(h)}) finished, but its result did "
                        f"not reach the driver within {max(1.0, left):.0f} s"
                    ) from None
                except ray.exceptions.RayActorError as e:
                    self._broken = f"host actor {h} died during {what}"
                    self._abort(work_id, self._broken)
                    broken = RuntimeBroken(
                        f"host actor {h} ({self._hostname(h)}) died during {what}: "
                        f"{_first_line(e)}. Call jaxreshard.shutdown() and jaxreshard.init() again."
                    )
                    broken.host = h
                    raise broken from None
                except ray.exceptions.RayTaskError as e:
                    self._abort(work_id, f"host {h} failed during {what}")
                    raise _named(e, h, what) from None
        return results

    def _named_hosts(self, hosts: Sequence[int]) -> str:
        return ", ".join(f"{h} ({self._hostname(h)})" for h in hosts)

    def _progress_of(self, h: int, report: tuple[int, str, float] | None, waited: float) -> str:
        """A busy host's last progress report, for a timeout's message."""
        where = f"host {h} ({self._hostname(h)})"
        if report is None:
            return f"{where} answered no progress probe in {waited:.0f} s"
        count, last, idle = report
        if not count:
            return f"{where} finished nothing of it yet"
        return f"{where} last finished {last} {idle:.0f} s before its last report"

    def _abort(self, work_id: str | None, reason: str) -> None:
        if work_id is None:
            return
        # An abort ends every NCCL communicator on every host: they are made anew on next use.
        self._communicators.clear()
        for h, actor in enumerate(self.actors):
            try:
                actor.abort.remote(work_id, reason)
            except Exception:  # the dead one cannot be told
                logging.getLogger(__name__).debug("could not abort host %d", h)

    def _hostname(self, h: int) -> str:
        return self.infos[h].get("hostname", "?") if h < len(getattr(self, "infos", [])) else "?"


def _named(e: Any, h: int, what: str) -> BaseException:
    """A host's error as the driver raises it: its own type where possible, naming the host
    (once) and what the driver was doing."""
    cause = e.cause if isinstance(e.cause, Exception) else RuntimeError(str(e))
    text = str(cause)
    prefix = f"host {h}: "
    message = (text if text.startswith(prefix) else prefix + text) + f" (during {what})"
    try:
        return type(cause)(message)
    except Exception:  # an exception type that cannot be made from a message
        return RuntimeError(f"{type(cause).__name__}: {message}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
