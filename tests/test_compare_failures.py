"""A comparison (and `--auto`'s finalists) with a variant that fails: dropped with its error
where the caller asks for that, the others measured; otherwise the comparison fails."""

import pytest

from jaxreshard import profiler
from jaxreshard.profiler import load_profile_config
from jaxreshard.profiler._auto_report import DATA_PARALLEL, summary_lines
from jaxreshard.profiler._run import StepRecord, is_fatal, run_steps
from jaxreshard.runtime.ray._wait import RuntimeBroken

OOM = "RESOURCE_EXHAUSTED: out of memory while allocating 3.1 GiB"


class FakeSession:
    """What `run_steps` uses of a `Session`; its plain steps fail from the `fail_at`-th on,
    its timed ones from the `timed_fail_at`-th."""

    def __init__(self, label, fail_at=None, error=RuntimeError, timed_fail_at=None):
        self.label, self.fail_at, self.error = label, fail_at, error
        self.timed_fail_at = timed_fail_at
        self.compile_seconds = 0.0
        self.timed = self.plain = 0

    def step(self, signal_only=False):
        self.timed += 1
        if self.timed_fail_at is not None and self.timed >= self.timed_fail_at:
            raise self.error(OOM)
        return StepRecord(0.01, 1.0, [])

    def plain_step(self, *, timed=True):
        self.plain += 1
        if self.fail_at is not None and self.plain >= self.fail_at:
            raise self.error(OOM)
        return StepRecord(0.01, 1.0, [])


def test_a_session_that_fails_is_handed_over_and_the_others_run_every_step():
    ok, bad = FakeSession("ok"), FakeSession("bad", fail_at=3)
    dropped = []
    run_steps([bad, ok], 4, plain_steps=4, on_failure=lambda s, e: dropped.append((s.label, e)))
    assert [label for label, _ in dropped] == ["bad"]
    error = dropped[0][1]
    assert "a plain step" in str(error) and "out of memory" in str(error)
    assert (ok.timed, ok.plain) == (4, 5)  # (the first plain step compiles, untimed)
    assert (bad.timed, bad.plain) == (2, 3)  # (stepped no more once it failed)


def test_a_failing_timed_step_is_dropped_too_and_only_finished_sessions_are_returned():
    ok, bad = FakeSession("ok"), FakeSession("bad", timed_fail_at=2)
    dropped, counted = [], []
    live = run_steps([ok, bad], 3, on_step=lambda s, r: counted.append(s.label),
                     on_failure=lambda s, e: dropped.append(s))  # fmt: skip
    assert live == [ok] and dropped == [bad]
    assert counted == ["ok", "bad", "ok", "ok"]  # (a failed step is not counted)


def test_a_failing_step_callback_or_a_bug_of_ours_is_raised_not_dropped():
    def broken_bar(session, record):
        raise KeyError("progress")

    with pytest.raises(KeyError):
        run_steps([FakeSession("ok")], 1, on_step=broken_bar, on_failure=pytest.fail)
    with pytest.raises(TypeError):
        run_steps([FakeSession("bug", timed_fail_at=1, error=TypeError)], 1,
                  on_failure=pytest.fail)  # fmt: skip


def test_without_a_handler_a_failing_plain_step_fails_the_run_and_names_the_way_out():
    with pytest.raises(RuntimeError, match=r"a plain step .* out of memory.*--plain-steps 0"):
        run_steps([FakeSession("ok"), FakeSession("bad", fail_at=2)], 2, plain_steps=2)


def test_a_broken_runtime_is_raised_even_with_a_handler():
    dropped = []
    with pytest.raises(RuntimeBroken):
        run_steps([FakeSession("dead", fail_at=1, error=RuntimeBroken)], 1, plain_steps=1,
                  on_failure=lambda s, e: dropped.append(s))  # fmt: skip
    assert not dropped
    wrapped = RuntimeError("step failed")
    wrapped.__cause__ = RuntimeBroken("host 2 died")
    assert is_fatal(wrapped) and not is_fatal(RuntimeError(OOM))

    class Wrapping(FakeSession):
        def step(self, signal_only=False):
            raise wrapped

    with pytest.raises(RuntimeError, match="step failed"):
        run_steps([Wrapping("dead")], 1, on_failure=lambda s, e: dropped.append(s))
    assert not dropped


def test_a_comparison_drops_the_variants_that_fail_and_measures_the_rest(monkeypatch):
    pc = load_profile_config(
        "gpt",
        None,
        {"model": {"layers": 2}, "run": {"steps": 1, "plain_steps": 1, "batch_size": 8},
         "pipeline": {"num_micro_batches": 2}},
    )  # fmt: skip
    warm_up, plain_step = profiler.Session.warm_up, profiler.Session.plain_step

    def failing_warm_up(self):
        if self.label == "no compile":
            raise RuntimeError(f"compiling: {OOM}")
        return warm_up(self)

    def failing_plain_step(self, *, timed=True):
        if self.label == "no plain step":
            raise RuntimeError(OOM)
        return plain_step(self, timed=timed)

    monkeypatch.setattr(profiler.Session, "warm_up", failing_warm_up)
    monkeypatch.setattr(profiler.Session, "plain_step", failing_plain_step)
    variants = [
        ("no compile", {"schedule": "1f1b"}),
        ("1f1b", {"schedule": "1f1b"}),
        ("no plain step", {"schedule": "1f1b"}),
    ]
    failed = []
    rows = profiler.compare(pc, variants, bound=False, progress=False, failed=failed)
    assert [r["label"] for r in rows] == ["1f1b"]
    assert rows[0]["plain_step_seconds"] > 0 and rows[0]["speedup"] == 1.0
    assert rows[0]["speedup_over"] == "1f1b"  # (the first variant failed: said, not implied)
    assert [f["label"] for f in failed] == ["no compile", "no plain step"]
    assert all("out of memory" in f["error"] for f in failed)
    assert "a plain step" in failed[1]["error"]
    # Without the list, the first failure fails the comparison; no variants is an error.
    with pytest.raises(RuntimeError, match="out of memory"):
        profiler.compare(pc, variants[:1], bound=False, progress=False)
    with pytest.raises(ValueError, match="variants is empty"):
        profiler.compare(pc, [], bound=False, progress=False)


def test_the_search_summary_lists_the_dropped_finalists():
    row = {"label": "1f1b, 4 micro-batches", "search_predicted_seconds": 0.1,
           "estimated_peak_bytes": 1 << 20, "step_seconds": 0.12,
           "plain_step_seconds": 0.1}  # fmt: skip
    record = {
        "measured": [row],
        "failed": [{"label": DATA_PARALLEL, "error": f"a plain step failed: {OOM}"}],
        "ranked_by": "plain_step_seconds",
        "winner": row["label"],
        "speedup_over_data_parallel": None,
    }
    text = "\n".join(summary_lines(record))
    assert f"{DATA_PARALLEL}" in text and "failed, not ranked: a plain step failed" in text
    assert "no data-parallel baseline: it failed" in text
    assert "calibrated at" not in text and "extrapolated" not in text
    # A finalist measured once as a calibration point says at what; one predicted outside
    # its calibrations says so.
    row.update(calibration_step_seconds=0.125, search_extrapolated=True)
    text = "\n".join(summary_lines(record))
    assert "(extrapolated past its calibrations; calibrated at 125.0 ms)" in text
