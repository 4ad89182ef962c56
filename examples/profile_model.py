"""A model of your own, profiled and searched by the `jaxreshard profile` command.

    jaxreshard profile examples/profile_model.py --num-stages 2 --steps 10
    jaxreshard profile examples/profile_model.py --preset deep --partition auto --num-stages 3
    jaxreshard profile examples/profile_model.py --auto --auto-toml best.toml

A residual MLP classifier in plain JAX and Optax: `layers` blocks of `width` features, each
with a `hidden`-wide inner layer. Its gradients outweigh its activations (a block holds
2 * width * hidden weights against batch * width activations), the case where a pipeline beats
data parallelism over slow links. The functions below are what the profiler calls; this file
is the template for yours (docs/profile.md, "Your own model").
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import jaxreshard as jr
from jaxreshard.models import stage_marker


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """Sizes (each one a `--flag` of the command).

    Attributes:
        layers: residual blocks; stage cuts go between them.
        width: features every block reads and writes.
        hidden: each block's inner width.
        classes: labels to predict.
    """

    layers: int = 4
    width: int = 128
    hidden: int = 512
    classes: int = 10


PRESETS = {
    "tiny": MLPConfig(),
    "deep": MLPConfig(layers=8, width=256, hidden=1024),
}
UNIT = "samples"  # what throughput counts: one per example


def num_layers(cfg: MLPConfig) -> int:
    """How many layers the stages share."""
    return cfg.layers


def init_params(cfg: MLPConfig, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def dense(n_in: int, n_out: int) -> dict:
        w = rng.normal(0.0, 1.0 / np.sqrt(n_in), (n_in, n_out)).astype(np.float32)
        return {"w": w, "b": np.zeros(n_out, np.float32)}

    blocks = [
        {"up": dense(cfg.width, cfg.hidden), "down": dense(cfg.hidden, cfg.width)}
        for _ in range(cfg.layers)
    ]
    return {"blocks": blocks, "head": dense(cfg.width, cfg.classes)}


def param_specs(cfg: MLPConfig, axis: str) -> dict:
    """Megatron-style tensor parallelism over mesh axis `axis`: each block's inner units split
    (optional: without this function every parameter is replicated on its stage's mesh)."""
    block = {"up": {"w": P(None, axis), "b": P(axis)}, "down": {"w": P(axis, None), "b": P()}}
    return {"blocks": [block] * cfg.layers, "head": {"w": P(), "b": P()}}


def loss_fn(params: dict, batch: dict, cfg: MLPConfig, num_stages: int, candidates: bool):
    mark = stage_marker(cfg.layers, num_stages, candidates)
    x = batch["x"]
    for i, p in enumerate(params["blocks"]):
        h = jax.nn.gelu(x @ p["up"]["w"] + p["up"]["b"])
        x = mark(x + h @ p["down"]["w"] + p["down"]["b"], i)
    logits = x @ params["head"]["w"] + params["head"]["b"]
    labels = jax.nn.one_hot(batch["y"], cfg.classes)
    return jnp.mean(optax.softmax_cross_entropy(logits, labels))


def train_step(cfg: MLPConfig, num_stages: int, optimizer, *, candidates: bool = False):
    """`(params, opt_state, batch) -> (params, opt_state, loss)`. The blocks end in
    `num_stages` even stages, or with `candidates` each block but the last ends in a
    `jr.stage_candidate` (for `partition="auto"` and `--auto`)."""

    def step(params, opt_state, batch):
        loss, grads = jr.value_and_grad(loss_fn)(params, batch, cfg, num_stages, candidates)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def synthetic_batch(cfg: MLPConfig, batch_size: int, step: int, seed: int = 0) -> dict:
    """Inputs whose label is the argmax of a fixed random projection: learnable."""
    teacher = np.random.default_rng(seed).normal(size=(cfg.width, cfg.classes))
    x = np.random.default_rng((seed, step)).normal(size=(batch_size, cfg.width))
    return {"x": x.astype(np.float32), "y": np.argmax(x @ teacher, axis=1).astype(np.int32)}


def num_params(cfg: MLPConfig) -> int:
    """The parameter count (optional: without it the profiler runs `init_params` under
    `jax.eval_shape` to count them, which allocates a NumPy initialisation in full)."""
    block = 2 * cfg.width * cfg.hidden + cfg.hidden + cfg.width
    return cfg.layers * block + cfg.width * cfg.classes + cfg.classes


def activation_bytes(cfg: MLPConfig, batch_size: int) -> int:
    """What a batch's forward keeps for its backward, roughly (optional: the memory check
    before a run on this machine's CPU)."""
    return 4 * batch_size * cfg.layers * (2 * cfg.width + 2 * cfg.hidden)
