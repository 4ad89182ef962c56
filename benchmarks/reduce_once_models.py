"""Gradients summed once a step against every micro-batch, on the shipped models laid out
tensor-parallel (layouts nobody tuned for this).

- `gpt`: GPT `tiny` with Megatron-style weights (`gpt.param_specs`: vocabulary-parallel
  embedding and logits, column- then row-parallel matmuls), 2 stages on 2 x 2 meshes over
  `data, model`, 1F1B, Adam.
- `utransformer`: the U-Transformer `tiny` with its tensor-parallel weights, 2 stages on (2, 2)
  and (4, 1) meshes, ZB-H1, SGD.
- `nnx`: a GPT built from Flax NNX's own layers (`nnx.Embed`, `nnx.MultiHeadAttention`,
  `nnx.LayerNorm`, `nnx.Linear`; 4 blocks, width 64, 4 heads), its kernels laid out
  Megatron-style (attention split by heads, the MLP column- then row-parallel), 2 stages on
  2 x 2 meshes, 1F1B, Adam.

Each with `PipelineConfig(reduce_gradients="once")` and `"every_micro_batch"`, 4 micro-batches
of 4 rows, local runtime, 8 fake CPU devices. Reported per variant:
- **plan**: how each stage sums its gradients (`layout.reductions`);
- **step**: the steady step, each call waited for; median over `--rounds`, the two variants
  taking turns call by call (this shared machine's noise hits both alike);
- **executables**: each executable's median time with every call waited for before and after
  (serialized: what the device work costs, not how it overlaps);
- **loss**: the first step's loss against `jax.jit` of the whole batch (relative difference).

    python benchmarks/reduce_once_models.py --out benchmarks/results/reduce_once_models.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import time
from typing import ClassVar

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxreshard as jr
from jaxreshard.models import gpt
from jaxreshard.models import utransformer as ut

MODES = ("once", "every_micro_batch")


class NNXGPT:
    """The `nnx` case, shaped as `jaxreshard.models.gpt` is (`PRESETS`, `init_state`,
    `param_specs`, `train_step`, `synthetic_batch`)."""

    PRESETS: ClassVar[dict[str, dict]] = {
        "tiny": dict(vocab=512, dim=64, layers=4, heads=4, seq=64)
    }

    @staticmethod
    def _split(cfg: dict):
        from flax import nnx

        class Block(nnx.Module):
            def __init__(self, *, rngs):
                d = cfg["dim"]
                self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
                self.attn = nnx.MultiHeadAttention(
                    num_heads=cfg["heads"], in_features=d, decode=False, rngs=rngs
                )
                self.up = nnx.Linear(d, 4 * d, rngs=rngs)
                self.down = nnx.Linear(4 * d, d, rngs=rngs)

            def __call__(self, x, mask):
                x = x + self.attn(self.ln1(x), mask=mask)
                return x + self.down(nnx.gelu(self.up(self.ln2(x))))

        class Model(nnx.Module):
            def __init__(self, *, rngs):
                self.embed = nnx.Embed(cfg["vocab"], cfg["dim"], rngs=rngs)
                self.blocks = nnx.List([Block(rngs=rngs) for _ in range(cfg["layers"])])
                self.ln = nnx.LayerNorm(cfg["dim"], rngs=rngs)
                self.head = nnx.Linear(cfg["dim"], cfg["vocab"], rngs=rngs)

            def __call__(self, tokens):
                mask, x = nnx.make_causal_mask(tokens), self.embed(tokens)
                for i, block in enumerate(self.blocks):
                    x = block(jr.stage_boundary(x) if i == len(self.blocks) // 2 else x, mask)
                return self.head(self.ln(x))

        return nnx.split(Model(rngs=nnx.Rngs(0)), nnx.Param)

    @classmethod
    def init_state(cls, cfg: dict, optimizer):
        params = jax.tree.map(np.asarray, cls._split(cfg)[1])
        return params, optimizer.init(params)

    @classmethod
    def param_specs(cls, cfg: dict):
        def spec(path, x):
            names = [str(k.key) for k in path if hasattr(k, "key")]
            layer, kind = (names[-2] if len(names) > 1 else ""), names[-1]
            if layer in ("query", "key", "value"):
                return P(None, "model", None) if kind == "kernel" else P("model", None)
            if layer == "out" and kind == "kernel":
                return P("model", None, None)
            if layer == "up":
                return P(None, "model") if kind == "kernel" else P("model")
            if layer == "down" and kind == "kernel":
                return P("model", None)
            return P()

        return jax.tree_util.tree_map_with_path(spec, cls._split(cfg)[1])

    @classmethod
    def train_step(cls, cfg: dict, num_stages: int, tx):
        from flax import nnx

        graphdef = cls._split(cfg)[0]

        def step(params, opt_state, batch):
            tokens = batch["tokens"]

            def loss_fn(p):
                logits = nnx.merge(graphdef, p)(tokens[:, :-1])
                labels = tokens[:, 1:]
                return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

            value, grads = jr.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        return step

    @staticmethod
    def synthetic_batch(cfg: dict, rows: int, step: int):
        rng = np.random.default_rng(step)
        return {"tokens": rng.integers(0, cfg["vocab"], (rows, cfg["seq"] + 1)).astype(np.int32)}


CASES = {
    "gpt": (gpt, (2, 2), "1f1b", lambda: optax.adam(1e-3)),
    "utransformer": (ut, [(2, 2), (4, 1)], "zb_h1", lambda: optax.sgd(0.1)),
    "nnx": (NNXGPT, (2, 2), "1f1b", lambda: optax.adam(1e-3)),
}


def build(name: str, mode: str):
    module, meshes, schedule, make_opt = CASES[name]
    cfg, opt = module.PRESETS["tiny"], make_opt()
    config = jr.PipelineConfig(
        backend="local",
        num_stages=2,
        num_micro_batches=4,
        schedule=schedule,
        stage_mesh_shape=meshes,
        mesh_axis_names=("data", "model"),
        reduce_gradients=mode,
    )
    params, opt_state = module.init_state(cfg, optimizer=opt)
    mesh = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])
    specs = module.param_specs(cfg)
    placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
    step = jr.parallelize(module.train_step(cfg, 2, opt), config=config, batch_argnums=(2,))
    reference = jax.jit(module.train_step(cfg, 2, opt))(params, opt_state, batch_of(name))[-1]
    return step, (placed, opt_state), float(reference)


def batch_of(name: str):
    module = CASES[name][0]
    return module.synthetic_batch(module.PRESETS["tiny"], 16, 0)


def serialized(step, state, batch, calls: int) -> tuple[dict[str, float], tuple]:
    """Each executable's median time, every call waited for before and after."""
    compilers = step.pipeline(*state, batch).compiled.engine.compilers
    times: dict[str, list[float]] = collections.defaultdict(list)
    originals = {}
    for c in compilers.values():
        originals[c] = c.call

        def timed(name, *args, _c=c, _call=c.call):
            jax.block_until_ready(args)
            start = time.perf_counter()
            out = _call(name, *args)
            jax.block_until_ready(out)
            times[f"stage {_c.s} {name}"].append(time.perf_counter() - start)
            return out

        c.call = timed
    try:
        for _ in range(calls):
            *state, loss = step(*state, batch)
            jax.block_until_ready(loss)
    finally:
        for c, call in originals.items():
            c.call = call
    return {k: statistics.median(v) * 1e3 for k, v in sorted(times.items())}, tuple(state)


def run(name: str, rounds: int) -> dict:
    batch = batch_of(name)
    variants = {mode: build(name, mode) for mode in MODES}
    states = {mode: v[1] for mode, v in variants.items()}
    first = {}
    for mode, (step, _, _) in variants.items():
        *states[mode], loss = step(*states[mode], batch)
        first[mode] = float(loss)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for r in range(rounds + 2):
        for mode, (step, _, _) in variants.items():
            start = time.perf_counter()
            *states[mode], loss = step(*states[mode], batch)
            jax.block_until_ready((states[mode], loss))
            if r >= 2:  # (two warm-up rounds)
                times[mode].append(time.perf_counter() - start)
    out = {}
    for mode, (step, _, reference) in variants.items():
        executables, states[mode] = serialized(step, states[mode], batch, 6)
        out[mode] = {
            "plan": {
                str(k): v for k, v in step.pipeline(*states[mode], batch).layout.reductions.items()
            },
            "step_ms": statistics.median(times[mode]) * 1e3,
            "executables_ms": executables,
            "first_loss": first[mode],
            "jit_loss": reference,
            "loss_rel_diff": abs(first[mode] - reference) / abs(reference),
        }
    once, every = out["once"]["step_ms"], out["every_micro_batch"]["step_ms"]
    out["once_over_every_micro_batch"] = once / every
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--models", default="gpt,utransformer,nnx")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    results = {name: run(name, args.rounds) for name in args.models.split(",")}
    print("| model | reduce_gradients | how the stages sum | step ms | once / every | vs jit |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        for mode in MODES:
            plan = "; ".join(f"{k}: {v.split(' (')[0]}" for k, v in r[mode]["plan"].items())
            ratio = f"{r['once_over_every_micro_batch']:.2f}" if mode == "once" else ""
            print(
                f"| {name} | {mode} | {plan} | {r[mode]['step_ms']:.1f} | {ratio} "
                f"| {r[mode]['loss_rel_diff']:.1e} |"
            )
    for name, r in results.items():
        for mode in MODES:
            cells = ", ".join(f"{k} {v:.2f}" for k, v in r[mode]["executables_ms"].items())
            print(f"{name} {mode} executables (ms, serialized): {cells}")
    if args.out:
        record = {
            "benchmark": "reduce_once_models",
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
            "jax": jax.__version__,
            "rounds": args.rounds,
            "results": results,
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
