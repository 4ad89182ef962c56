"""What micro-batching does to a loss: batch dims, combined outputs, and batch statistics.

[Note: micro-batch semantics]
A pipelined step computes its loss once per micro-batch and combines the results, which equals
`jax.jit` on the whole batch when the loss is a mean (or, with `loss_reduction="sum"`, a sum)
of per-example terms. The step is traced at the whole batch and per micro-batch
(`frontend._trace`), and comparing the two traces tells, for a value of the loss, whether it
has a batch dim (its size differs by the factor m in one dim), and so what micro-batching does
to it:
- A value with a batch dim is per example: each micro-batch computes its own rows
  (aux outputs of this kind are concatenated in batch order).
- A value that depends on the batch without a batch dim is a *batch statistic* (a sum over the
  rows, a token count, BatchNorm's mean): each micro-batch computes it over its own rows. The
  loss may reduce per-example terms into such a statistic and scale it by constants, which
  micro-batching preserves (the step averages or sums the micro-batches' values). Any other use
  (dividing by a token count, normalising activations by a batch mean, a maximum over the rows,
  values that mix examples, such as a (B, B) similarity matrix) gives a different number than
  `jax.jit`, and `check_statistics` says so in a `MicroBatchWarning` naming the line and the fix.
- A value that does not depend on the batch (an RNG counter) is the same in every micro-batch.
The comparison pairs the two traces' equations in order, skipping shape-only equations that one
trace has and the other not (broadcasting a size-1 micro-batch needs none); where the traces
part ways for good (shape-dependent Python), it stops, and values past that point are not
checked.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import jax

from jaxreshard._jax_compat import source_location
from jaxreshard.frontend._jaxprs import dependents, inline_all, is_var
from jaxreshard.frontend._source import user_location

# Equations that only move or reshape data: present in one trace and not the other when a
# size-1 micro-batch needs no broadcast.
_SHAPE_ONLY = ("broadcast_in_dim", "reshape", "squeeze", "expand_dims", "convert_element_type",
               "copy", "copy_p")  # fmt: skip
# Equations through which a batch statistic stays a linear part of the loss's own reduction.
_LINEAR = ("add", "add_any", "sub", "neg", "convert_element_type", "reduce_sum", "copy",
           "copy_p", "squeeze", "reshape", "broadcast_in_dim", "expand_dims", "transpose",
           "reduce_precision", "stage_boundary")  # fmt: skip
# Reductions of per-example values into a statistic that micro-batching preserves.
_SUMS = ("reduce_sum", "dot_general", "add_any")
# Operations along a dim whose result at one row depends on the other rows.
_SCANS = ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort", "rev")

CONCAT, REDUCE, ONE = "concat", "reduce", "one"


class MicroBatchWarning(UserWarning):
    """The pipelined step computes a different number than `jax.jit` would on the whole batch
    (see [Note: micro-batch semantics]); the message names the line and the fix."""


def batch_dim(full: Sequence[int], micro: Sequence[int], num_micro_batches: int) -> int | None:
    """The dim along which `micro` is a micro-batch of `full` (None: the same shape). Raises
    `ValueError` when the shapes differ otherwise."""
    full, micro = tuple(full), tuple(micro)
    if full == micro:
        return None
    dims = [d for d, (a, b) in enumerate(zip(full, micro)) if a != b]
    if (
        len(full) != len(micro)
        or len(dims) != 1
        or full[dims[0]] != num_micro_batches * micro[dims[0]]
    ):
        raise ValueError(
            f"shape {micro} per micro-batch and {full} for the whole batch: not one dim "
            f"{num_micro_batches} (num_micro_batches) times smaller"
        )
    return dims[0]


def squeezed_row(full: Sequence[int], micro: Sequence[int], num_micro_batches: int) -> bool:
    """Whether `micro` is `full` without its batch dim, as with micro-batches of one row: JAX
    drops such a size-1 dim where the whole batch keeps it (`jnp.matmul` squeezes size-1 batch
    dims before its `dot_general` and adds them back after), so the two traces pair a value of
    one row, squeezed, with the whole batch's."""
    full, micro = tuple(full), tuple(micro)
    return len(full) == len(micro) + 1 and any(
        full[d] == num_micro_batches and full[:d] + full[d + 1 :] == micro for d in range(len(full))
    )


@dataclasses.dataclass(frozen=True)
class Combine:
    """How the micro-batches' values of one output make the step's value: `concat` along `dim`
    (per example), `reduce` like the loss (a batch statistic), or `one` (the same in every
    micro-batch)."""

    how: str
    dim: int = 0


def combine_rules(
    micro: Any,
    full_avals: Sequence[Any],
    outputs: Sequence[int],
    seeds: Sequence[Any],
    num_micro_batches: int,
    names: Sequence[str],
) -> list[Combine]:
    """The `Combine` of each output position in `outputs` of the micro-batch jaxpr `micro`
    (closed), given the whole batch's avals of those outputs and the micro jaxpr's inputs that
    differ per micro-batch (`seeds`). `names` name the outputs for errors."""
    depends = dependents(micro.jaxpr, seeds)
    out = []
    for position, full, name in zip(outputs, full_avals, names):
        v = micro.jaxpr.outvars[position]
        try:
            dim = batch_dim(full.shape, v.aval.shape, num_micro_batches)
        except ValueError as e:
            raise ValueError(f"{name}: {e}; return it with the batch dim, or reduced") from None
        if dim is not None:
            out.append(Combine(CONCAT, dim))
        elif is_var(v) and v in depends:
            out.append(Combine(REDUCE))
        else:
            out.append(Combine(ONE))
    return out


def check_integer_statistics(
    rules: Sequence[Combine], avals: Sequence[Any], names: Sequence[str], reduction: str
) -> None:
    """An integer batch statistic (a count) cannot be averaged; say what to do instead."""
    for rule, aval, name in zip(rules, avals, names):
        if (
            rule.how == REDUCE
            and reduction == "mean"
            and not jax.numpy.issubdtype(aval.dtype, jax.numpy.inexact)
        ):
            raise ValueError(
                f"{name} ({aval.str_short()}) is an integer computed from the micro-batch; with "
                "loss_reduction='mean' the step averages the micro-batches' values, which an "
                "integer cannot hold exactly. Return a float mean instead (e.g. "
                "jnp.mean(correct.astype(jnp.float32))), or the per-example values (which are "
                "concatenated), or use loss_reduction='sum'"
            )


# -- batch statistics --------------------------------------------------------------------------


def _align(micro: Any, full: Any) -> dict[Any, Any]:
    """Micro var -> whole-batch var, pairing the two traces' equations in order (see
    [Note: micro-batch semantics])."""
    to_full: dict[Any, Any] = dict(zip(micro.invars, full.invars))
    to_micro: dict[Any, Any] = {f: m for m, f in to_full.items()}
    i = j = 0
    a, b = micro.eqns, full.eqns
    while i < len(a) and j < len(b):
        x, y = a[i], b[j]
        if (
            x.primitive is y.primitive
            and len(x.invars) == len(y.invars)
            and len(x.outvars) == len(y.outvars)
        ):
            for u, w in zip(x.outvars, y.outvars):
                to_full[u], to_micro[w] = w, u
            i, j = i + 1, j + 1
        elif y.primitive.name in _SHAPE_ONLY and is_var(y.invars[0]):
            if y.invars[0] in to_micro:
                to_micro[y.outvars[0]] = to_micro[y.invars[0]]
            j += 1
        elif x.primitive.name in _SHAPE_ONLY and is_var(x.invars[0]):
            if x.invars[0] in to_full:
                to_full[x.outvars[0]] = to_full[x.invars[0]]
            i += 1
        else:
            break
    return to_full


def _where(eqn: Any) -> str:
    """The user's line that made `eqn` (not jaxreshard's: a `jr.scan` piece's equation is made
    in `frontend/_scan.py`), else its innermost frame."""
    return user_location(eqn) or source_location(eqn)


@dataclasses.dataclass(frozen=True)
class Finding:
    """A use of the micro-batch's rows that `jax.jit` on the whole batch would not make."""

    what: str
    eqn: Any
    statistic: Any  # the statistic's producing equation, or None

    def message(self, reduction: str) -> str:
        where = _where(self.eqn)
        made = _where(self.statistic) if self.statistic is not None else None
        combines = "averages" if reduction == "mean" else "sums"
        if self.what == "divides":
            return (
                f"at {where} the loss divides by a value computed from the micro-batch's rows at "
                f"{made} (a count of tokens or examples, say): each micro-batch's value is "
                f"divided by its own count and the step {combines} them, which differs from "
                "jax.jit on the whole batch. Fix: compute the count from "
                "the whole batch before jr.value_and_grad (n = jnp.sum(batch['mask'])), divide by "
                "it inside the loss (jnp.sum(losses * mask) / n), and set "
                "PipelineConfig(loss_reduction='sum')"
            )
        if self.what == "mixes":
            return (
                f"the step computes a value across examples at {where} (its shape grows with the "
                "batch in more than one dim, or it reorders or accumulates along the batch dim): "
                "each micro-batch sees only its own rows, unlike jax.jit on the whole batch (e.g. "
                "in-batch negatives of a contrastive loss). Compute it outside the pipelined "
                "loss, or per example"
            )
        if self.what == "reduces":
            return (
                f"the loss reduces over the batch with `{self.eqn.primitive.name}` at {where}: "
                f"the step {combines} the micro-batches' values, which equals jax.jit only for "
                "sums and means. Use a sum or mean over the examples"
            )
        return (
            f"the step uses a statistic of the micro-batch's rows (computed at {made}, e.g. a "
            f"BatchNorm mean or a count) non-linearly at {where}: each micro-batch uses its own "
            "statistic, unlike jax.jit on the whole batch. Compute such statistics from the "
            "whole batch before jr.value_and_grad and pass them into the loss (with "
            "loss_reduction='sum' if the loss divides by one), or normalise per example "
            "(LayerNorm instead of BatchNorm)"
        )


def find_statistics(
    micro: Any,
    full: Any,
    batch_inputs: Sequence[int],
    roots: Sequence[int],
    num_micro_batches: int,
) -> list[Finding]:
    """Uses of batch statistics that make the micro-batched loss differ from the whole batch's
    (see [Note: micro-batch semantics]). `micro` and `full` are the two traces of the loss
    (closed); `batch_inputs` the positions of their inputs that are split into micro-batches;
    `roots` the output positions the step combines by the loss's reduction (the loss and its
    reduced aux outputs)."""
    a, b = inline_all(micro).jaxpr, inline_all(full).jaxpr
    to_full = _align(a, b)
    producer = {o: eqn for eqn in a.eqns for o in eqn.outvars}

    def shapes(v: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        w = to_full.get(v)
        return None if w is None else (tuple(v.aval.shape), tuple(w.aval.shape))

    def batched(v: Any) -> bool:
        s = shapes(v)
        return s is not None and s[0] != s[1]

    seeds = [a.invars[i] for i in batch_inputs]
    seeds += [o for eqn in a.eqns if eqn.primitive.name in ("random_bits", "random_split")
              for o in eqn.outvars if batched(o)]  # fmt: skip
    depends = dependents(a, seeds)
    stats = {v for v in depends if is_var(v) and (s := shapes(v)) is not None and s[0] == s[1]}
    findings: list[Finding] = []
    for eqn in a.eqns:  # values that mix examples
        for v in eqn.outvars:
            s = shapes(v)
            if s is None or s[0] == s[1]:
                continue
            try:
                batch_dim(s[1], s[0], num_micro_batches)
            except ValueError:
                if not squeezed_row(s[1], s[0], num_micro_batches):
                    findings.append(Finding("mixes", eqn, None))
                    break
        if eqn.primitive.name in _SCANS and any(is_var(v) and batched(v) for v in eqn.invars):
            axes = eqn.params.get("axis", eqn.params.get("dimension", eqn.params.get("dimensions")))
            axes = axes if isinstance(axes, tuple) else (axes,)
            x = next(v for v in eqn.invars if is_var(v) and batched(v))
            try:
                d = batch_dim(*reversed(shapes(x)), num_micro_batches)  # type: ignore[misc]
            except ValueError:  # (a one-row micro-batch's squeezed batch dim: not along it)
                d = None
            if d in axes:
                findings.append(Finding("mixes", eqn, None))
    # The loss's own reduction: statistics that reach the combined outputs linearly.
    allowed = {a.outvars[i] for i in roots if is_var(a.outvars[i]) and a.outvars[i] in stats}
    chain: set[int] = set()
    for eqn in reversed(a.eqns):
        if not any(o in allowed for o in eqn.outvars):
            continue
        chain.add(id(eqn))
        ins = [v for v in eqn.invars if is_var(v) and v in stats]
        name = eqn.primitive.name
        if name in _LINEAR or (name == "mul" and len(ins) == 1):  # scaled by a constant
            allowed.update(ins)
        elif name == "div" and eqn.invars[0] in ins and eqn.invars[1] not in ins:
            allowed.add(eqn.invars[0])
        elif name == "div" and eqn.invars[1] in ins:
            findings.append(Finding("divides", eqn, producer.get(eqn.invars[1])))
        elif ins:
            findings.append(Finding("uses", eqn, producer.get(ins[0])))
        if not ins and name not in _SUMS and any(is_var(v) and batched(v) for v in eqn.invars):
            findings.append(Finding("reduces", eqn, None))
    for eqn in a.eqns:  # statistics used outside the loss's reduction
        if id(eqn) in chain:
            continue
        ins = [v for v in eqn.invars if is_var(v) and v in stats]
        if ins and any(batched(o) for o in eqn.outvars):  # it feeds per-example values
            findings.append(Finding("uses", eqn, producer.get(ins[0])))
    unique: dict[tuple[str, int], Finding] = {}
    for f in findings:
        unique.setdefault((f.what, id(f.eqn)), f)
    return list(unique.values())


def warn_statistics(findings: Sequence[Finding], reduction: str) -> None:
    # (once per message: the pieces of a split jr.scan repeat their body's equations)
    messages = list(dict.fromkeys(f.message(reduction) for f in findings))
    for message in messages[:3]:
        warnings.warn(message, MicroBatchWarning, stacklevel=4)
    if len(messages) > 3:
        warnings.warn(
            f"... and {len(messages) - 3} more uses of micro-batch statistics",
            MicroBatchWarning,
            stacklevel=4,
        )
