"""A few resharding strategies on one profile config, side by side, and where the step goes.

`jaxreshard profile MODEL --compare-resharding` runs all eight strategies; this runs the ones
given (default: `send_recv`, the point-to-point baseline, and `auto`, ours) with the same
interleaving (`profiler.compare`: every variant compiled, then steps in turn, so the machine's
noise hits all alike) and prints, per variant, the median step, the simulator's prediction
from the run's own action times, the median time of one boundary transfer (send to arrival)
and each stage's per-step optimizer time (`apply`: its once-a-step gradient sum included)
and time blocked in receives. It answers "is the boundary where the step goes?": a strategy
can move a boundary tensor faster and leave the step as it was.

    jaxreshard cluster up --hosts 4 --devices-per-host 2 --nic-gbps 0.01 --name bs
    python benchmarks/boundary_strategies.py utransformer \
        --config examples/configs/utransformer_comm_multihost_data.toml \
        --address HEAD --steps 8 --out OUT.json [--stage-mesh-shape '[[4,1],[2,2]]']
    jaxreshard cluster down --name bs
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="gpt, utransformer, or a model of your own (a .py file)")
    parser.add_argument("--config", required=True, help="a profile config (TOML)")
    parser.add_argument("--address", help="the Ray cluster to join (HOST:PORT)")
    parser.add_argument("--stage-mesh-shape", help="override the config's, as JSON: [[4,1],[2,2]]")
    parser.add_argument("--strategies", nargs="+", default=["send_recv", "auto"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", help="write the comparison (jaxreshard-compare JSON)")
    args = parser.parse_args()

    from jaxreshard import profiler
    from jaxreshard.profiler import load_profile_config

    run = {"steps": args.steps, **({"address": args.address} if args.address else {})}
    overrides: dict = {"run": run}
    if args.stage_mesh_shape:
        overrides["pipeline"] = {"stage_mesh_shape": json.loads(args.stage_mesh_shape)}
    pc = load_profile_config(args.model, args.config, overrides)
    variants = [(name, {"resharding": name}) for name in args.strategies]
    rows = profiler.compare(pc, variants, bound=False, progress=False)
    print(
        f"{'strategy':<18}{'step ms':>9}{'predicted':>11}{'meas/pred':>11}{'transfer ms':>13}"
        f"{'apply ms / chunk':>22}{'blocked ms / stage':>22}"
    )

    def ms(value: float | list[float]) -> str:  # (a list whose values are equal is one value)
        return " / ".join(f"{x * 1e3:.0f}" for x in (value if isinstance(value, list) else [value]))

    for row in rows:
        costs = row["measured_costs"]
        print(
            f"{row['label']:<18}{row['step_seconds'] * 1e3:>9.0f}"
            f"{row['predicted_seconds'] * 1e3:>11.0f}{row['measured_over_predicted']:>11.2f}"
            f"{ms(costs['comm']):>13}{ms(costs['apply']):>22}{ms(row['blocked_seconds']):>22}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(profiler.compare_json(pc, "resharding", rows), f, indent=1, default=str)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
