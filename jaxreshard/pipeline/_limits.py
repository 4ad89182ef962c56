"""How large a schedule may be: counts are checked against these before anything is allocated.

[Note: schedule size limits]
A schedule of p ranks, n chunks and m micro-batches has n * m * k actions (k = 2, or 3 with
the backward split), and reading, checking and simulating it costs about `BYTES_PER_ACTION`
of memory and `SECONDS_PER_ACTION` of time per action (measured on CPython 3.11 by
`benchmarks/schedule_scale.py --memory`: a 100,000-action schedule peaks at 160-190 MB through
CSV import, check, simulation and JSON; each step takes 1-3 s, ~10 s in all; a command on
500,000 actions took 31 s and 0.9 GB; 200,000 with JSON, CSV and trace outputs peaked at 1.8 GB).
`MAX_ACTIONS` (~1.8 GB, about 20 s) refuses a count
such as `--micro-batches 10**9`, or a CSV cell `99999999F0` whose stage implies 2e8 actions,
before a list of that length exists; the message
gives the estimate and the limit. Costs are per chunk, so `MAX_CHUNKS` bounds them on their
own. The limits are module constants: a caller that means it may raise them.
"""

from __future__ import annotations

from jaxreshard._files import human_bytes

MAX_ACTIONS = 200_000
MAX_CHUNKS = 100_000
BYTES_PER_ACTION = 9_000  # peak, through import, check, simulation and JSON, CSV and trace
SECONDS_PER_ACTION = 1e-4  # reading, checking, simulating and writing JSON once each
MAX_INDEX_DIGITS = 9  # a stage or micro-batch index in a CSV cell or an action string
MAX_CSV_BYTES = 16 * 2**20  # ~6 bytes a cell: MAX_ACTIONS fit with room
MAX_JSON_BYTES = 128 * 2**20  # ~250 bytes an action with its transfer: MAX_ACTIONS fit


def estimate(num_actions: int) -> str:
    """`2e+08 actions (~400 GB, ~6 h to read, check and simulate)`."""
    seconds = num_actions * SECONDS_PER_ACTION
    when = f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"
    if seconds >= 7200:
        when = f"{seconds / 3600:.0f} h" if seconds < 3e7 else f"{seconds / 3.15e7:.3g} years"
    count = f"{num_actions:,}" if num_actions < 10**9 else f"{num_actions:.3g}"
    return (
        f"{count} actions (~{human_bytes(num_actions * BYTES_PER_ACTION)}, ~{when} to "
        "read, check and simulate)"
    )


def action_limit_message(num_chunks: int, num_micro_batches: int, kinds: int) -> str:
    """`3 chunks x 1,000 micro-batches x 2 kinds = <estimate>; at most ...` for a refusal."""
    total = num_chunks * num_micro_batches * kinds
    return (
        f"{num_chunks:,} chunks x {num_micro_batches:,} micro-batches x {kinds} kinds = "
        f"{estimate(total)}; at most {MAX_ACTIONS:,} actions "
        f"(~{human_bytes(MAX_ACTIONS * BYTES_PER_ACTION)}) and {MAX_CHUNKS:,} chunks "
        "(jaxreshard.pipeline._limits.MAX_ACTIONS, MAX_CHUNKS)"
    )


def too_large(num_chunks: int, num_micro_batches: int, kinds: int) -> bool:
    return num_chunks > MAX_CHUNKS or num_chunks * num_micro_batches * kinds > MAX_ACTIONS


def check_counts(
    what: str, num_chunks: int, num_micro_batches: int, kinds: int, fix: str = ""
) -> None:
    """Refuse n * m * k actions past `MAX_ACTIONS`, or n past `MAX_CHUNKS` (see [Note: schedule
    size limits])."""
    if too_large(num_chunks, num_micro_batches, kinds):
        raise ValueError(
            f"{what} would make a schedule of "
            f"{action_limit_message(num_chunks, num_micro_batches, kinds)}"
            + (f"; {fix}" if fix else "")
        )
