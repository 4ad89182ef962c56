"""A host's NCCL issuer: the one thread per step that issues its cross-host transfers in the
pipeline's one order (see [Note: NCCL issue order] in `ray/_nccl_order.py`)."""

from __future__ import annotations

import threading
import time
from typing import Any

from jaxreshard.comm._order import SEND
from jaxreshard.comm._transport import HostWork, run_host_work
from jaxreshard.pipeline._emit import Instruction
from jaxreshard.runtime.engine._events import ARRIVE, Event, PipelineError, transfer_key
from jaxreshard.runtime.ray._nccl_order import Issuer, Key
from jaxreshard.runtime.step._layout import Transfer

_STOPPED = object()  # `_await_value`: the step ended first


class NcclIssuing:
    """`HostChannels`' NCCL issuer (a mixin over the channels' state: `transport`, `layout`,
    `_cond`, `_issuer`, and their `_work`, `_move`, `_data` and `deliver`)."""

    host: int
    layout: Any
    transport: Any
    nccl_recv_window: int
    _cond: threading.Condition
    _issuer: Any

    def _start_issuer(self) -> None:
        missing = [
            (channel, group)
            for channel, group in self._communicators
            if not self.transport.has(group, channel)  # type: ignore[attr-defined]
        ]
        if missing:
            channel, group = missing[0]
            error = PipelineError(
                f"host {self.host}: the NCCL communicator {list(group)} of channel {channel}"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                + " does not exist: it was never created, or an earlier failure aborted it and "
                "it was not created again before this step (the driver creates the "
                "communicators before every step); this is a jaxreshard bug, please report it"
            )
            self.fail(error)
            raise error
        if not self._items:
            return
        issuer = Issuer(self._begun, getattr(self, "epoch", None))
        with self._cond:
            self._issuer = issuer
            self._nccl_works = issuer.works
        issuer.thread = threading.Thread(
            target=self._issue_loop,
            args=(issuer,),
            name=f"jaxreshard-send-nccl-h{self.host}",
            daemon=True,
        )
        issuer.thread.start()

    def _current(self, issuer: Issuer) -> bool:
        return self._failure is None and not self._closed and issuer.step == self._begun

    def _issue_loop(self, issuer: Issuer) -> None:
        self._local.issuer = issuer
        ins: Instruction | None = None
        try:
            for key, role in self._items:
                ins = self._instructions[key]
                transfer = self.layout.transfers[transfer_key(ins)]
                if role == SEND:
                    issuer.at = f"stage {ins.src} to hand over the value of {ins}"
                    value = self._await_value(issuer, key)
                    if value is _STOPPED:
                        return
                    self._move(ins, transfer, value)
                else:
                    issuer.at = f"room for {ins} (receives in flight: {len(issuer.receives)})"
                    if not self._await_room(issuer):
                        return
                    self._issue_receive(issuer, ins, transfer)
                self._reap(issuer)
            issuer.at = "nothing (it issued every transfer)"
        except BaseException as e:
            if self._current(issuer):
                error = PipelineError(
                    f"host {self.host}: issuing the NCCL transfer {ins}: {type(e).__name__}: {e}"
                )
                error.__cause__ = e
                self.fail(error)
        finally:
            with self._cond:
                issuer.done = True
                self._cond.notify_all()

    def _await_value(self, issuer: Issuer, key: Key) -> Any:
        """The value a stage handed over for SEND `key` (`_STOPPED` if the step ends first);
        meanwhile, let go of what finished."""
        while True:
            with self._cond:
                if key in issuer.values:
                    return issuer.values.pop(key)
                if not self._current(issuer):
                    return _STOPPED
                self._cond.wait(self._poll_idle_s if issuer.works else 1.0)
            self._reap(issuer)

    def _await_room(self, issuer: Issuer) -> bool:
        """Wait until fewer than `nccl_recv_window` receives are in flight: not finished on the
        GPUs, or not delivered yet (False if the step ends first)."""
        while len(issuer.receives | issuer.undelivered) >= self.nccl_recv_window:
            if not self._current(issuer):
                return False
            self._reap(issuer)
            if len(issuer.receives | issuer.undelivered) >= self.nccl_recv_window:
                time.sleep(self._poll_window_s)
        return self._current(issuer)

    def _issue_receive(self, issuer: Issuer, ins: Instruction, transfer: Transfer) -> None:
        """Allocate a receive's buffers and issue its broadcasts (now, at its turn); JAX gets
        the result off this thread."""
        work = self._work(ins, transfer)
        data = self._data(work, {}, ins)
        run_host_work(work, data, self.transport, deadline=self._step_deadline(ins), complete=False)
        with self._cond:
            issuer.receives.add(work.work_id)
            issuer.undelivered.add(work.work_id)
        self._issued(work)
        self._receivers.submit(self._hand_over, issuer, work.work_id, ins, transfer, data)

    def _issued(self, work: HostWork) -> None:
        """Keep an issued work until its broadcasts have finished (the issuer's, whose thread
        this is)."""
        issuer = getattr(self._local, "issuer", None)
        if issuer is not None:
            with self._cond:
                issuer.works.append(work)

    def _hand_over(
        self, issuer: Issuer, work_id: str, ins: Instruction, transfer: Transfer, data: Any
    ) -> None:
        """A received value to JAX (its reads wait for the channel's stream) and its RECV."""
        try:
            value = self._assemble(transfer, data)
            if issuer.epoch is not None:  # the executor drops a value of an earlier step
                self._local.epoch = issuer.epoch
            elif not self._current(issuer):
                return
            self.deliver(ins.key, value)
            with self._cond:
                issuer.undelivered.discard(work_id)
            if self.record is not None:
                now = time.perf_counter()
                name = f"{ins.kind}{ins.tensor} s{ins.src}->s{ins.dst}"
                self.record(Event(ins.dst, ARRIVE, ins.mb, now, now, name, dst=ins.dst))
        except BaseException as e:
            if self._current(issuer):
                error = PipelineError(
                    f"{self.where(ins.dst)}: receiving {ins}: {type(e).__name__}: {e}"
                )
                error.__cause__ = e
                self.fail(error)

    def _reap(self, issuer: Issuer) -> None:
        """Let go of the works whose broadcasts have all finished (their buffers go now)."""
        for work in list(issuer.works):
            if self.transport.finished(work):  # type: ignore[attr-defined]
                with self._cond:
                    if work in issuer.works:
                        issuer.works.remove(work)
                    issuer.receives.discard(work.work_id)
