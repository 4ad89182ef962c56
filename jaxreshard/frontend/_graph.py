"""What cutting a step gives: its stages, the values between them, the post-gradient segments
(`StepGraph`, built by `frontend/_split.py`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from jaxreshard.frontend._batch import Combine

PARAM, BATCH, CONST, ACT, LOSS, MB, OUT = "param", "batch", "const", "act", "loss", "mb", "out"


@dataclasses.dataclass(frozen=True)
class Ref:
    """What a stage input or output is: a parameter (`index` into `StepGraph.params`), a batch
    feed (into `StepGraph.feeds`), a per-step constant (into `StepGraph.consts`), the
    micro-batch index, an activation (`index` = activation id), the loss, or an aux/forward
    output (`index` into `StepGraph.results`)."""

    kind: str
    index: int = 0

    def __str__(self) -> str:
        return self.kind if self.kind in (LOSS, MB) else f"{self.kind}{self.index}"


@dataclasses.dataclass(frozen=True)
class Activation:
    """A value of the loss produced by one stage and used by later ones (a boundary tensor)."""

    id: int
    aval: Any
    home: int
    consumers: tuple[int, ...]
    where: str  # the source line that computed it

    @property
    def differentiable(self) -> bool:
        return bool(jax.numpy.issubdtype(self.aval.dtype, jax.numpy.inexact))

    def label(self) -> str:
        return f"act{self.id}:{self.aval.str_short()}"


@dataclasses.dataclass(frozen=True)
class Stage:
    """The forward of one stage: `jaxpr` maps `inputs` to `outputs` (in that order)."""

    index: int
    jaxpr: Any  # ClosedJaxpr
    inputs: tuple[Ref, ...]
    outputs: tuple[Ref, ...]


@dataclasses.dataclass(frozen=True)
class LossSplit:
    stages: tuple[Stage, ...]
    activations: tuple[Activation, ...]
    result_homes: tuple[int, ...] = ()  # per result, the stage that outputs it

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def users(self, kind: str, index: int) -> tuple[int, ...]:
        """The stages whose forward reads `Ref(kind, index)`, in order."""
        return self._users.get(Ref(kind, index), ())

    @functools.cached_property
    def _users(self) -> dict[Ref, tuple[int, ...]]:  # asked per parameter in every step
        users: dict[Ref, list[int]] = {}
        for s in self.stages:
            for ref in dict.fromkeys(s.inputs):
                users.setdefault(ref, []).append(s.index)
        return {ref: tuple(stages) for ref, stages in users.items()}


@dataclasses.dataclass(frozen=True)
class Feed:
    """A per-example input of the loss: an outer variable (a batch leaf, or a value the pre
    part computes from the batch) split into micro-batches along `dim`."""

    var: Any
    dim: int


@dataclasses.dataclass(frozen=True)
class Result:
    """An output of the loss besides the loss (an aux leaf; every output of a forward-only
    step), computed per micro-batch and combined by `combine`."""

    name: str
    aval: Any  # per micro-batch
    combine: Combine


@dataclasses.dataclass(frozen=True)
class Segment:
    """Post-gradient equations that run together on one stage's mesh."""

    stage: int
    jaxpr: Any  # ClosedJaxpr over `inputs` -> `outputs`
    inputs: tuple[Any, ...]  # outer Vars
    outputs: tuple[Any, ...]  # outer Vars


@dataclasses.dataclass(frozen=True)
class StepGraph:
    """A train step cut for the pipeline (see [Note: two traces]).

    Attributes:
        outer: the step traced at the whole batch (its invars are the flattened array args).
        params: for each parameter k, the outer invar index it is (differentiated leaves; in a
            forward-only step, every non-batch argument).
        batch: outer invar indices that are batch leaves.
        loss_inputs: for each input of the loss jaxpr, a `Ref`.
        feeds: the per-example inputs of the loss (`Ref(BATCH, j)`).
        consts: the outer atoms (Vars, or Literals) that feed the loss as per-step constants.
        loss: the loss cut into stages.
        owner: for each parameter k, the stage that keeps it (its first user).
        pre: equations the loss depends on, run once per step on the whole batch before the
            pipeline (a ClosedJaxpr over `pre_inputs` -> `pre_outputs`), or None.
        grad_outputs: the outer Vars of the loss and of one gradient per parameter (empty for
            a forward-only step).
        results: the loss's other outputs, combined over micro-batches.
        result_outputs: the outer Var each result becomes.
        segments: the post-gradient equations in run order.
        placement: stage of each outer Var the post part reads or writes (None: free).
        forward_only: the step has no gradient (see [Note: stage cutting]).
        donated: outer invar indices whose buffers the step may reuse (`parallelize`'s
            `donate_argnums`, as `jax.jit`'s): the post-gradient segment that reads one last
            may overwrite it.
    """

    outer: Any
    params: tuple[int, ...]
    batch: tuple[int, ...]
    loss_inputs: tuple[Ref, ...]
    feeds: tuple[Feed, ...]
    consts: tuple[Any, ...]
    loss: LossSplit
    owner: tuple[int, ...]
    pre: Any
    pre_inputs: tuple[Any, ...]
    pre_outputs: tuple[Any, ...]
    grad_outputs: tuple[Any, ...]
    results: tuple[Result, ...]
    result_outputs: tuple[Any, ...]
    segments: tuple[Segment, ...]
    placement: dict[Any, int | None]
    forward_only: bool = False
    donated: tuple[int, ...] = ()

    @property
    def num_stages(self) -> int:
        return self.loss.num_stages

    @property
    def batch_vars(self) -> tuple[Any, ...]:
        return tuple(self.outer.jaxpr.invars[i] for i in self.batch)

    @property
    def micro_batch_index(self) -> bool:
        """Whether some stage reads the micro-batch index (random draws with a batch dim)."""
        return Ref(MB) in self.loss_inputs


# -- helpers ----------------------------------------------------------------------------------
