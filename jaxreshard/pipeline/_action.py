"""Actions: one unit of a stage's work, printable as `2F0` and parsable back."""

from __future__ import annotations

import dataclasses
import re

FORWARD = "F"
BACKWARD = "B"  # the whole backward, or only the input-gradient part when split
WEIGHT = "W"  # the weight-gradient part of a split backward
APPLY = "A"  # the stage's apply-gradient (optimizer) step, once per training step
KINDS = (FORWARD, BACKWARD, WEIGHT, APPLY)

_PATTERN = re.compile(r"^([0-9]+)([FBW])([0-9]+)$|^([0-9]+)A$")
_MAX_DIGITS = 9  # as `_limits.MAX_INDEX_DIGITS`; an int of thousands of digits is slow to make


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class Action:
    """(stage_index, kind, microbatch_index); `A` has no micro-batch (index -1)."""

    stage_index: int
    kind: str
    microbatch_index: int = -1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Action kind {self.kind!r} is not one of {KINDS}")
        if self.stage_index < 0:
            raise ValueError(f"Action {self!r}: stage_index must be >= 0")
        if (self.kind == APPLY) != (self.microbatch_index == -1):
            raise ValueError(
                f"Action {self.stage_index}{self.kind}{self.microbatch_index}: F/B/W need a "
                "micro-batch index >= 0; A (apply gradients) takes none"
            )
        if self.kind != APPLY and self.microbatch_index < 0:
            raise ValueError(f"Action {self!r}: microbatch_index must be >= 0")

    @property
    def mb(self) -> int:
        return self.microbatch_index

    def __str__(self) -> str:
        if self.kind == APPLY:
            return f"{self.stage_index}A"
        return f"{self.stage_index}{self.kind}{self.microbatch_index}"

    def __repr__(self) -> str:
        return str(self)

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse `2F0`, `0B3`, `1W2` or `3A`."""
        match = _PATTERN.match(text.strip()) if isinstance(text, str) else None
        if match and max(len(g) for g in match.groups() if g) > _MAX_DIGITS:
            raise ValueError(
                f"cannot parse action {text[:40]!r}: an index of more than {_MAX_DIGITS} digits "
                "(a schedule holds a few million actions at most)"
            )
        if not match:
            raise ValueError(
                f"cannot parse action {str(text)[:40]!r}: expected STAGE KIND MB like '2F0' "
                "(kinds F, B, W) or STAGE 'A' like '3A'"
            )
        if match.group(4) is not None:
            return cls(int(match.group(4)), APPLY)
        return cls(int(match.group(1)), match.group(2), int(match.group(3)))
