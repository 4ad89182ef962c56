"""A random sweep of models x pipeline configurations, each against `jax.jit` (the "equal to
`jax.jit`" contract on models and configs nobody tuned for it).

Each case draws a model (plain-JAX MLP with layer norm and `jax.checkpoint`, a convolutional
net, a small attention LM with a tied embedding, layer groups stacked and run by `lax.scan`
(with `jax.checkpoint` and `lax.cond` in the body), one layer stack run by `jr.scan` (cut inside
the scan), a Flax Linen MLP, Linen's `nn.scan` over
`nn.remat` blocks, a Flax NNX net, an Equinox net), an optimizer
(SGD, Nesterov momentum, Adam, AdamW with global-norm clipping, Lion, Adafactor, RMSprop), a
schedule (every one, with and without weight delay, virtual stages), 2-4 stages, a stage mesh
over `data, model`, 1-4 micro-batches, how the cuts are made (`jr.stage_boundary`, `cuts=`,
`partition="auto"` by prediction or with its trial), the resharding strategy, gradient
reduction, optimizer fusion, steps in flight, donation (and with `--explicit`, Explicit mesh
axes in 1 of 3 cases; with `--tensor-parallel`, the weights of a case whose mesh has a `model`
axis split over it, column- and row-wise by turns, with Auto axes; with `--resume`, the state
saved after the first step by `jr.save_checkpoint` and the second step taken in another layout
drawn at random, restored into its `placement`); runs 2 steps pipelined and under `jax.jit`, and
compares the losses (rtol 2e-4) and the state (rtol 2e-3; atol 2e-5, or 1e-3 for adaptive
optimizers, which divide near-zero gradients by their own size).

    python benchmarks/equal_to_jit_sweep.py --seed 7 --cases 100 [--backend ray] [--explicit]
        [--tensor-parallel] [--resume] [--models scan linen linen_scan ...] [--out F]

By default it draws the first five models (the recorded runs' seeds draw the same cases
again); `--models` names the others.

On Ray (a local cluster of 4 hosts x 2 devices) the Equinox net is left out: its class is
defined here and would travel by value, which an Equinox class does not survive (the hosts say
so: docs/models.md). 8 fake CPU devices.
"""

import argparse
import json
import os
import random
import sys
import tempfile
import time
import traceback
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax

jax.config.update("jax_num_cpu_devices", 8)
import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen, nnx  # noqa: E402

import jaxreshard as jr  # noqa: E402

B = 16


def opt(name):
    return {
        "sgd": lambda: optax.sgd(0.05),
        "momentum": lambda: optax.sgd(0.05, momentum=0.9, nesterov=True),
        "adam": lambda: optax.adam(1e-2),
        "adamw_clip": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)),
        "lion": lambda: optax.lion(1e-3),
        "adafactor": lambda: optax.adafactor(1e-2),
        "rmsprop": lambda: optax.rmsprop(1e-2),
    }[name]()


# -- dict-params models: (init, apply(p, batch, mark)) ------------------------------------------


def mlp_model(rng, depth=4, width=48):
    p = {}
    fan = 24
    for i in range(depth):
        w = width if i % 2 == 0 else width // 3
        p[f"w{i}"] = (rng.normal(size=(fan, w)) / np.sqrt(fan)).astype(np.float32)
        p[f"b{i}"] = np.zeros((w,), np.float32) + 0.01 * i
        p[f"g{i}"] = np.ones((w,), np.float32)
        fan = w
    p["head"] = (rng.normal(size=(fan, 5)) / np.sqrt(fan)).astype(np.float32)

    def apply(p, batch, mark):
        h = batch["x"]

        def layer(h, w, b, g):
            h = h @ w + b
            mu = h.mean(-1, keepdims=True)
            var = ((h - mu) ** 2).mean(-1, keepdims=True)
            return jax.nn.gelu((h - mu) / jnp.sqrt(var + 1e-5) * g)

        for i in range(depth):
            f = jax.checkpoint(layer) if i % 2 else layer
            h = f(h, p[f"w{i}"], p[f"b{i}"], p[f"g{i}"])
            h = mark(h, i, depth)
        logits = h @ p["head"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    batch = lambda r: {
        "x": r.normal(size=(B, 24)).astype(np.float32),
        "y": r.integers(0, 5, size=(B,)).astype(np.int32),
    }
    return p, apply, batch


def conv_model(rng, depth=3):
    p = {}
    c = 3
    for i in range(depth):
        co = 8 if i % 2 == 0 else 4
        p[f"k{i}"] = (rng.normal(size=(3, 3, c, co)) / np.sqrt(9 * c)).astype(np.float32)
        p[f"b{i}"] = np.zeros((co,), np.float32)
        c = co
    p["head"] = (rng.normal(size=(c, 4)) / np.sqrt(c)).astype(np.float32)

    def apply(p, batch, mark):
        h = batch["x"]
        for i in range(depth):
            h = jax.lax.conv_general_dilated(
                h, p[f"k{i}"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
            )
            h = jax.nn.relu(h + p[f"b{i}"])
            h = mark(h, i, depth)
        logits = h.mean((1, 2)) @ p["head"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    batch = lambda r: {
        "x": r.normal(size=(B, 8, 8, 3)).astype(np.float32),
        "y": r.integers(0, 4, size=(B,)).astype(np.int32),
    }
    return p, apply, batch


def attn_model(rng, depth=3, d=32, T=8, vocab=20):
    p = {"emb": (rng.normal(size=(vocab, d)) * 0.1).astype(np.float32)}
    for i in range(depth):
        for n in ("q", "k", "v", "o"):
            p[f"{n}{i}"] = (rng.normal(size=(d, d)) / np.sqrt(d)).astype(np.float32)
        p[f"f{i}"] = (rng.normal(size=(d, 2 * d)) / np.sqrt(d)).astype(np.float32)
        p[f"f2{i}"] = (rng.normal(size=(2 * d, d)) / np.sqrt(2 * d)).astype(np.float32)

    def apply(p, batch, mark):
        x = p["emb"][batch["t"][:, :-1]]
        mask = jnp.tril(jnp.ones((T - 1, T - 1), bool))
        for i in range(depth):
            q, k, v = (x @ p[f"{n}{i}"] for n in "qkv")
            a = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(d)
            a = jax.nn.softmax(jnp.where(mask, a, -1e9), -1)
            x = x + jnp.einsum("bts,bsd->btd", a, v) @ p[f"o{i}"]
            x = x + jax.nn.gelu(x @ p[f"f{i}"]) @ p[f"f2{i}"]
            x = mark(x, i, depth)
        logits = x @ p["emb"].T  # tied
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["t"][:, 1:]).mean()

    batch = lambda r: {"t": r.integers(0, vocab, size=(B, T)).astype(np.int32)}
    return p, apply, batch


def scan_model(rng, depth=4, d=32, per_group=3):
    """Layers stacked per group (`w`: (per_group, d, d)) and run by `lax.scan`, a
    `jax.checkpoint`ed body with a residual and RMS norm, and a `lax.cond` on the weights
    inside; the marks sit between the groups (a stage holds whole scans)."""
    p = {"inp": (rng.normal(size=(12, d)) / np.sqrt(12)).astype(np.float32)}
    for i in range(depth):
        p[f"w{i}"] = (rng.normal(size=(per_group, d, d)) / np.sqrt(d)).astype(np.float32)
        p[f"g{i}"] = np.ones((per_group, d), np.float32)
    p["head"] = (rng.normal(size=(d, 3)) / np.sqrt(d)).astype(np.float32)

    @jax.checkpoint
    def body(h, layer):
        w, g = layer
        z = h @ w
        z = jax.lax.cond(jnp.sum(w) > 0, jnp.tanh, jax.nn.silu, z)  # (per step, not per row)
        h = h + z
        return h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * g, None

    def apply(p, batch, mark):
        h = batch["x"] @ p["inp"]
        for i in range(depth):
            h, _ = jax.lax.scan(body, h, (p[f"w{i}"], p[f"g{i}"]))
            h = mark(h, i, depth)
        return jnp.mean((h @ p["head"] - batch["y"]) ** 2)

    batch = lambda r: {
        "x": r.normal(size=(B, 12)).astype(np.float32),
        "y": r.normal(size=(B, 3)).astype(np.float32),
    }
    return p, apply, batch


def jr_scan_model(rng, depth=4, d=32):
    """One stack of `depth` layers (`w`: (depth, d, d)) run by `jr.scan`: its candidates are
    the gaps between the iterations, so cuts fall inside the scan (the sweep's cut modes draw
    among them; `mark` is not called), and its per-layer outputs reach the loss."""
    p = {
        "inp": (rng.normal(size=(12, d)) / np.sqrt(12)).astype(np.float32),
        "w": (rng.normal(size=(depth, d, d)) / np.sqrt(d)).astype(np.float32),
        "g": np.ones((depth, d), np.float32),
        "head": (rng.normal(size=(d, 3)) / np.sqrt(d)).astype(np.float32),
    }

    @jax.checkpoint
    def body(h, layer):
        w, g = layer
        h = h + jnp.tanh(h @ w)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * g
        return h, jnp.mean(h, -1)  # (per example)

    def apply(p, batch, mark):
        h, per_layer = jr.scan(body, batch["x"] @ p["inp"], (p["w"], p["g"]))
        return jnp.mean((h @ p["head"] - batch["y"]) ** 2) + 0.1 * jnp.mean(per_layer**2)

    batch = lambda r: {
        "x": r.normal(size=(B, 12)).astype(np.float32),
        "y": r.normal(size=(B, 3)).astype(np.float32),
    }
    return p, apply, batch


class LinenBlock(linen.Module):
    width: int

    @linen.compact
    def __call__(self, h):
        h = linen.Dense(self.width)(h)
        h = linen.LayerNorm()(h)
        return jax.nn.relu(h)


class LinenNet(linen.Module):
    """A Flax Linen MLP; `mark(h, i, depth)` after each block (a static callable field)."""

    mark: Any
    depth: int = 4

    @linen.compact
    def __call__(self, x):
        h = x
        for i in range(self.depth):
            h = LinenBlock(24 if i % 2 else 40)(h)
            h = self.mark(h, i, self.depth)
        return linen.Dense(4)(h)


class LinenScanBlock(linen.Module):
    @linen.compact
    def __call__(self, h, _):
        h = h + linen.Dense(h.shape[-1])(linen.LayerNorm()(h))
        return jax.nn.gelu(h), None


class LinenScanNet(linen.Module):
    """Linen's lifted transforms: each group is `nn.scan` over 2 `nn.remat` blocks (parameters
    stacked by the scan), with `mark(h, i, depth)` between the groups."""

    mark: Any
    depth: int = 4

    @linen.compact
    def __call__(self, x):
        h = linen.Dense(24)(x)
        for i in range(self.depth):
            stack = linen.scan(
                linen.remat(LinenScanBlock),
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=2,
            )
            h, _ = stack(name=f"stack{i}")(h, None)
            h = self.mark(h, i, self.depth)
        return linen.Dense(4)(h)


def linen_model(rng, depth=4, net=LinenNet):
    init = net(lambda h, i, depth: h, depth).init(
        jax.random.key(int(rng.integers(1 << 30))), jnp.zeros((1, 10), jnp.float32)
    )
    p = jax.tree.map(np.asarray, init["params"])

    def apply(p, batch, mark):
        out = net(mark, depth).apply({"params": p}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(out, batch["y"]).mean()

    batch = lambda r: {
        "x": r.normal(size=(B, 10)).astype(np.float32),
        "y": r.integers(0, 4, size=(B,)).astype(np.int32),
    }
    return p, apply, batch


DICT_MODELS = {
    "mlp": mlp_model,
    "conv": conv_model,
    "attn": attn_model,
    "scan": scan_model,
    "linen": linen_model,
    "linen_scan": lambda rng: linen_model(rng, net=LinenScanNet),
    "jr_scan": jr_scan_model,
}


def dict_steps(model, tx, marking):
    """(pipelined step, jit step, params, batches)."""
    rng = np.random.default_rng(0)
    params, apply, batch = model(rng)
    batches = [batch(np.random.default_rng(10 + i)) for i in range(2)]

    def make(pipelined):
        def mark(h, i, depth):
            if not pipelined or i == depth - 1:
                return h
            return marking(h, i)

        vg = jr.value_and_grad if pipelined else jax.value_and_grad

        def step(params, state, b):
            loss, g = vg(lambda p: apply(p, b, mark))(params)
            updates, state = tx.update(g, state, params)
            return optax.apply_updates(params, updates), state, loss

        return step

    return make(True), jax.jit(make(False)), (params, tx.init(params)), batches


def regression_batches(seed, d_in, d_out):
    """Two batches of `B` rows: inputs `x` of width `d_in`, targets `y` of width `d_out`."""
    out = []
    for i in range(2):
        r = np.random.default_rng(seed + i)
        out.append({"x": r.normal(size=(B, d_in)).astype(np.float32),
                    "y": r.normal(size=(B, d_out)).astype(np.float32)})  # fmt: skip
    return out


# -- NNX ----------------------------------------------------------------------------------------


class NNXNet(nnx.Module):
    def __init__(self, rngs, depth=4, d=32):
        self.inp = nnx.Linear(12, d, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(d, d, rngs=rngs) for _ in range(depth)])
        self.norms = nnx.List([nnx.LayerNorm(d, rngs=rngs) for _ in range(depth)])
        self.out = nnx.Linear(d, 3, rngs=rngs)
        self.marking = None

    def __call__(self, x):
        h = self.inp(x)
        for i, (lin, norm) in enumerate(zip(self.layers, self.norms)):
            h = h + nnx.relu(lin(norm(h)))
            if self.marking is not None and i < len(self.layers) - 1:
                h = self.marking(h, i)
        return self.out(h)


def nnx_steps(tx, marking):
    model = NNXNet(nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batches = regression_batches(20, 12, 3)

    def make(pipelined):
        vg = jr.value_and_grad if pipelined else jax.value_and_grad

        def step(params, state, b):
            def loss_fn(p):
                m = nnx.merge(graphdef, p, rest, copy=True)
                m.marking = marking if pipelined else None
                return jnp.mean((m(b["x"]) - b["y"]) ** 2)

            loss, g = vg(loss_fn)(params)
            updates, state = tx.update(g, state, params)
            return optax.apply_updates(params, updates), state, loss

        return step

    return make(True), jax.jit(make(False)), (params, tx.init(params)), batches


# -- Equinox ------------------------------------------------------------------------------------


class EqxNet(eqx.Module):
    layers: list
    marking: object = eqx.field(static=True, default=None)

    def __init__(self, key, depth=4, d=32, marking=None):
        keys = jax.random.split(key, depth + 1)
        self.layers = [eqx.nn.Linear(10 if i == 0 else d, d, key=keys[i]) for i in range(depth)]
        self.layers.append(eqx.nn.Linear(d, 2, key=keys[-1]))
        self.marking = marking

    def __call__(self, x):
        h = x
        for i, layer in enumerate(self.layers[:-1]):
            h = jax.nn.tanh(jax.vmap(layer)(h))
            if self.marking is not None and i < len(self.layers) - 2:
                h = self.marking(h, i)
        return jax.vmap(self.layers[-1])(h)


def eqx_steps(tx, marking):
    batches = regression_batches(30, 10, 2)

    def make(pipelined):
        vg = jr.filter_value_and_grad if pipelined else eqx.filter_value_and_grad

        def loss_fn(m, b):
            return jnp.mean((m(b["x"]) - b["y"]) ** 2)

        def step(model, state, b):
            loss, g = vg(loss_fn)(model, b)
            updates, state = tx.update(g, state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), state, loss

        return step

    plain = EqxNet(jax.random.key(0))
    marked = EqxNet(jax.random.key(0), marking=marking)
    states = [tx.init(eqx.filter(m, eqx.is_inexact_array)) for m in (plain, marked)]
    return make(True), eqx.filter_jit(make(False)), ((plain, marked), states), batches


# -- the sweep ----------------------------------------------------------------------------------

SCHEDULES = [
    ("gpipe", None, False),
    ("1f1b", None, False),
    ("eager_1f1b", None, False),
    ("eager_1f1b", None, True),
    ("zb_h1", None, False),
    ("interleaved_1f1b", 2, False),
    ("eager_interleaved_1f1b", 2, True),
    ("zbv", 2, False),
    ("dualpipev", 2, False),
]
SHAPES = [(1, 1), (2, 1), (1, 2), (2, 2)]
OPTS = ["sgd", "momentum", "adam", "adamw_clip", "lion", "adafactor", "rmsprop"]
MODELS = ["mlp", "conv", "attn", "nnx", "eqx"]  # (the default draw: the recorded seeds' cases)
MORE_MODELS = ["scan", "linen", "linen_scan", "jr_scan"]  # (drawn when named by --models)


def leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))]


def runtime_choices(r):
    """The runtime's choices a case draws: gradient reduction, resharding strategy, optimizer
    fusion, mesh axis types (with `--explicit`) and steps in flight."""
    return dict(
        reduce_gradients=r.choice(["once", "every_micro_batch"]),
        resharding=r.choice(["auto", "send_recv", "broadcast_greedy", "allgather"]),
        fuse_optimizer=r.choice(["auto", "never"]),
        mesh_axis_types=r.choice(["auto", "auto", "explicit"]) if EXPLICIT else "auto",
        steps_in_flight=r.choice([1, 2, 3]),
    )


def one(r, info):
    model = r.choice(MODELS)
    sched, v, wd = r.choice(SCHEDULES)
    meshes = 2 if v else r.choice([2, 2, 3])
    stages = meshes * (v or 1)
    shape = r.choice([s for s in SHAPES if s[0] * s[1] * meshes <= 8])
    m = r.choice([1, 2, 4])
    if B // m % shape[0]:
        m = 2
    o = r.choice(OPTS)
    how = r.choice(["auto", "auto_trial", "boundary", "cuts"])
    if model == "jr_scan" and how == "boundary":  # (its candidates are jr.scan's: no forced cut)
        how = "cuts"
    cfg = dict(
        num_micro_batches=m,
        schedule=sched,
        weight_delay=wd,
        virtual_stages=v,
        stage_mesh_shape=shape,
        mesh_axis_names=("data", "model"),
        backend=BACKEND,
        **runtime_choices(r),
    )
    donate = r.choice([(), (0, 1)])
    depth = 3 if model == "conv" else 4  # (marker positions: depth - 1)
    if model == "attn":
        depth = 3
    candidates = depth - 1
    if stages - 1 > candidates:
        stages = candidates + 1
        if v:
            stages = 2 * (stages // 2) if stages >= 4 else 2
            v = None if stages < 4 else v
            if v is None:
                sched, wd = "1f1b", False
                cfg.update(schedule=sched, weight_delay=wd, virtual_stages=None)
    if how == "boundary":
        cut_at = sorted(r.sample(range(candidates), stages - 1))
        marking = lambda h, i: jr.stage_boundary(h) if i in cut_at else h
        desc = f"boundary{cut_at}"
    else:
        marking = lambda h, i: jr.stage_candidate(h)
        cfg["num_stages"] = stages
        if how == "cuts":
            cut_at = tuple(sorted(r.sample(range(candidates), stages - 1)))
            cfg["cuts"] = cut_at
            desc = f"cuts{list(cut_at)}"
        else:
            cfg["partition"] = "auto"
            cfg["partition_trials"] = 1 if how == "auto_trial" else 0
            desc = how
    tx = opt(o)
    label = f"{model} {o} stages={stages} {desc} {cfg}"
    info["label"] = label
    if model in DICT_MODELS:
        pstep, jstep, state, batches = dict_steps(DICT_MODELS[model], tx, marking)
        got_state = want_state = state
    elif model == "nnx":
        pstep, jstep, state, batches = nnx_steps(tx, marking)
        got_state = want_state = state
    else:
        pstep, jstep, ((plain, marked), s), batches = eqx_steps(tx, marking)
        got_state, want_state = (marked, s[1]), (plain, s[0])
    step = jr.parallelize(
        pstep, config=jr.PipelineConfig(**cfg), batch_argnums=2, donate_argnums=donate
    )
    label += f" donate={donate}"
    info["label"] = label
    copy = lambda t: jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, t)
    got, want = copy(got_state), copy(want_state)  # (a donating step deletes its inputs)
    # (not with Explicit axes: the weights' split is then their type, and JAX asks the step for
    # `out_sharding`s that a model written without it lacks, under `jax.jit` as here)
    split_weights = TENSOR_PARALLEL and shape[1] > 1 and cfg["mesh_axis_types"] == "auto"
    if split_weights:
        got = [tensor_parallel(got[0], shape), *got[1:]]
        info["label"] = label = label + " tensor-parallel"
    gl, wl = [], []
    for i, b in enumerate(batches):
        if RESUME and i == 1:  # saved after step 1, resumed in another layout
            got, step = resumed(
                r, got, b, pstep, cfg, stages, how, candidates, donate, split_weights, info
            )
            label = info["label"]
        *got, loss = step(*got, b)
        gl.append(float(loss))
        *want, loss = jstep(*want, b)
        wl.append(float(loss))
    np.testing.assert_allclose(gl, wl, rtol=2e-4, atol=1e-5, err_msg="losses")
    for x, y in zip(leaves(got), leaves(want)):
        # (adaptive optimizers divide near-zero gradients by their own size: a 1e-7 gradient's
        # reassociation noise moves its update by a good part of the learning rate)
        atol = 2e-5 if o in ("sgd", "momentum") else 1e-3
        np.testing.assert_allclose(x, y, rtol=2e-3, atol=atol, err_msg="state")
    return label


def resumed(r, state, batch, pstep, cfg, stages, how, candidates, donate, split_weights, info):
    """`state` saved to a checkpoint and restored into another layout drawn by `relayout` (a
    pipeline of the same step on other meshes, schedule, micro-batches and, where the cuts are
    chosen, another stage count and cuts): the restored state and the new step; the case's
    label gets what changed. Weights split over `model` keep Auto axes (as the first layout
    does: see `one`)."""
    new = relayout(random.Random(r.random()), cfg, stages, how, candidates)
    if split_weights:
        new["mesh_axis_types"] = "auto"
    changed = {k: v for k, v in new.items() if cfg.get(k) != v}
    info["label"] += f" resumed in {changed}"
    step = jr.parallelize(
        pstep, config=jr.PipelineConfig(**new), batch_argnums=2, donate_argnums=donate
    )
    with tempfile.TemporaryDirectory() as tmp:
        jr.save_checkpoint(f"{tmp}/ckpt", tuple(state))
        target = step.placement(*state, batch)[:2]
        restored = jr.restore_checkpoint(f"{tmp}/ckpt", target)
    return list(restored), step


def relayout(r, cfg, stages, how, candidates):
    """Another pipeline config for the step of `cfg`: the stage count and cuts stay where
    forced boundaries make them (`how == "boundary"`), and are drawn again otherwise; the
    schedule, mesh, micro-batches and the runtime's choices are drawn again."""
    if how != "boundary":
        stages = r.randint(2, candidates + 1)
    virtual = stages >= 4 and stages % 2 == 0
    sched, v, wd = r.choice([s for s in SCHEDULES if s[1] is None or virtual])
    meshes = stages // (v or 1)
    shape = r.choice([s for s in SHAPES if s[0] * s[1] * meshes <= 8])
    m = r.choice([1, 2, 4])
    if B // m % shape[0]:
        m = 2
    new = dict(cfg)
    new.update(
        num_micro_batches=m,
        schedule=sched,
        weight_delay=wd,
        virtual_stages=v,
        stage_mesh_shape=shape,
        **runtime_choices(r),
    )
    for key in ("num_stages", "cuts", "partition", "partition_trials"):
        new.pop(key, None)
    if how != "boundary":
        new["num_stages"] = stages
        if r.random() < 0.5:
            new["cuts"] = tuple(sorted(r.sample(range(candidates), stages - 1)))
        else:
            new.update(partition="auto", partition_trials=r.choice([0, 1]))
    return new


def tensor_parallel(params: Any, shape: tuple[int, int]) -> Any:
    """`params` placed on the first stage's mesh with every float matrix split over `model`,
    column- and row-wise by turns (Megatron's alternation, on a model nobody laid out for it):
    by its last dim or its first, whichever divides, else whole."""
    mesh = jax.make_mesh(shape, ("data", "model"), devices=jax.devices()[: shape[0] * shape[1]])
    turn = [0]

    def place(x: Any) -> Any:
        if not eqx.is_array(x):
            return x
        spec = jax.sharding.PartitionSpec()
        if x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating):
            column, row = x.shape[-1] % shape[1] == 0, x.shape[0] % shape[1] == 0
            if column and (turn[0] % 2 == 0 or not row):
                spec = jax.sharding.PartitionSpec(*[None] * (x.ndim - 1), "model")
            elif row:
                spec = jax.sharding.PartitionSpec("model")
            turn[0] += 1
        return jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))

    return jax.tree.map(place, params)


BACKEND = "local"
EXPLICIT = False
TENSOR_PARALLEL = False
RESUME = False


def main():
    global BACKEND, EXPLICIT, TENSOR_PARALLEL, RESUME
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=50)
    parser.add_argument("--backend", choices=("local", "ray"), default="local")
    parser.add_argument("--out", help="write every case, passed or failed, as JSON")
    parser.add_argument(
        "--explicit", action="store_true", help="draw mesh_axis_types='explicit' in 1 of 3 cases"
    )
    parser.add_argument(
        "--tensor-parallel",
        action="store_true",
        help="place the weights of cases whose mesh has a model axis column- and row-split "
        "over it by turns",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="save a checkpoint after the first step and take the second in another layout "
        "drawn at random, restored from it",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=MODELS + MORE_MODELS,
        help=f"draw from these models (default: {' '.join(MODELS)})",
    )
    args = parser.parse_args()
    BACKEND, EXPLICIT, TENSOR_PARALLEL = args.backend, args.explicit, args.tensor_parallel
    RESUME = args.resume
    if args.models:
        MODELS[:] = args.models
    if BACKEND == "ray" and MODELS == ["eqx"]:
        parser.error(
            "--models eqx with --backend ray: the Equinox net cannot run on Ray (its "
            "class is defined here and travels by value); add another model"
        )
    if BACKEND == "ray":
        if "eqx" in MODELS:
            MODELS.remove("eqx")
        jr.init(backend="ray", num_hosts=4, devices_per_host=2, timeout_s=60)
    cases = []
    for i in range(args.cases):
        r = random.Random(args.seed * 1000 + i)
        start, info = time.perf_counter(), {}
        try:
            one(r, info)
            error = None
        except Exception as e:
            error = f"{type(e).__name__}: {str(e)[:1500]}"
            traceback.print_exc(limit=-4)
        seconds = time.perf_counter() - start
        cases.append({"case": i, "label": info.get("label"), "error": error, "seconds": seconds})
        print(f"{'FAIL' if error else 'ok  '} {i} {seconds:5.1f}s {info.get('label')}"
              + (f"\n  {error}" if error else ""), flush=True)  # fmt: skip
        jax.clear_caches()
    failed = sum(c["error"] is not None for c in cases)
    print(f"{failed} failed of {len(cases)} (seed {args.seed}, backend {BACKEND}, explicit axes "
          f"{'drawn' if EXPLICIT else 'not drawn'}"
          f"{', tensor-parallel weights' if TENSOR_PARALLEL else ''}"
          f"{', resumed in another layout' if RESUME else ''})")  # fmt: skip
    if args.out:
        record = {"benchmark": "equal_to_jit_sweep", "date": time.strftime("%Y-%m-%d"),
                  "seed": args.seed, "backend": BACKEND, "explicit": EXPLICIT,
                  "tensor_parallel": TENSOR_PARALLEL, "resume": RESUME,
                  "models": list(MODELS),
                  "jax": jax.__version__,
                  "failed": failed, "cases": cases}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
