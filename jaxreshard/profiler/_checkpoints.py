"""`jaxreshard profile ... --checkpoint DIR [--checkpoint-every N] [--resume]`: a profiled run
that saves its training state and picks up where a previous run (in any layout) stopped.

[Note: run checkpoints]
Checkpoints go to `DIR/step_<n>` (n: training steps done, warm-up included), with metadata
naming the model, preset, seed and batch size and the step. Saves are asynchronous
(`save_checkpoint(wait=False)`): the next step runs while the files are written; a save waits
for the previous one first, and the last `KEEP` checkpoints are kept. `--resume` restores the
newest complete one into this run's layout (`train_step.placement`), whatever layout wrote it,
and the synthetic data stream goes on from its step (the batches are a function of the seed and
the step). The steps a resumed run performs are its warm-up and timed steps, as in any run.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import jaxreshard as jr
from jaxreshard.checkpoint._format import STEP_NAME, latest_step, step_dir
from jaxreshard.models._user import same_model

KEEP = 2


class RunCheckpoints:
    """A profile run's checkpoints (see [Note: run checkpoints])."""

    def __init__(self, root: str | Path, every: int | None, pc: Any):
        self.root = Path(root).expanduser().absolute()
        self.every = every
        self.identity = {
            "model": pc.model,
            "preset": pc.preset,
            "seed": pc.run.seed,
            "batch_size": pc.run.batch_size,
        }
        self._pending: Any = None
        self.saved: list[dict[str, Any]] = []
        self.resumed_from: int | None = None
        self.restore_seconds = 0.0

    def resume(self, session: Any) -> int | None:
        """Restore the newest checkpoint into `session`'s layout; the step it was at."""
        found = latest_step(self.root)
        if found is None:
            return None
        step, path = found
        info = jr.checkpoint_metadata(path)
        saved = {k: info.get(k) for k in self.identity}

        def differs(k: str) -> bool:  # (a model file by any path to it is the same model)
            if k == "model" and isinstance(saved[k], str):
                return not same_model(saved[k], self.identity[k])
            return saved[k] != self.identity[k]

        if any(differs(k) for k in self.identity):
            diff = ", ".join(
                f"{k} {saved[k]!r} (this run: {self.identity[k]!r})"
                for k in self.identity
                if differs(k)
            )
            raise ValueError(
                f"--resume: the checkpoint {path} is of another run: {diff}; resume with the "
                "same model, preset, seed and batch size, or give another --checkpoint folder"
            )
        start = time.perf_counter()
        session.restore(path, int(info["step"]))
        self.restore_seconds = time.perf_counter() - start
        self.resumed_from = step
        return step

    def after_step(self, session: Any) -> None:
        """Save if this step is due (every `every` steps)."""
        if self.every and session.steps_done % self.every == 0:
            self.save(session)

    def save(self, session: Any) -> None:
        step = session.steps_done
        if self.saved and self.saved[-1]["step"] == step:
            return
        self.wait()
        start = time.perf_counter()
        path = step_dir(self.root, step)
        self._pending = jr.save_checkpoint(
            path,
            (session.params, session.opt),
            metadata={**self.identity, "step": step},
            overwrite=True,
            wait=False,
        )
        self.saved.append(
            {"step": step, "path": str(path), "blocking_s": time.perf_counter() - start}
        )

    def wait(self) -> None:
        """Let the save in flight finish, then drop checkpoints past the newest `KEEP`."""
        if self._pending is None:
            return
        self._pending.wait()
        self.saved[-1]["seconds"] = self._pending.seconds
        self._pending = None
        done = sorted(
            (int(m.group(1)), p)
            for p in self.root.iterdir()
            if (m := STEP_NAME.fullmatch(p.name)) and (p / "jaxreshard.json").is_file()
        )
        for _, path in done[:-KEEP]:
            shutil.rmtree(path, ignore_errors=True)

    def finish(self, session: Any) -> dict[str, Any]:
        """Save the final state (if not saved at this step) and wait; the JSON record."""
        self.save(session)
        self.wait()
        return {
            "root": str(self.root),
            "every": self.every,
            "resumed_from_step": self.resumed_from,
            "restore_seconds": self.restore_seconds,
            "saved": self.saved,
        }
