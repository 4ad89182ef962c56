"""A scan-over-layers model of your own for `jaxreshard profile`: the stack cut by `jr.scan`.

    jaxreshard profile examples/profile_scan_model.py --num-stages 2 --steps 10
    jaxreshard profile examples/profile_scan_model.py --partition auto --num-stages 3

The residual MLP of `profile_model.py` with its blocks' parameters stacked (a leading `layers`
axis) and run by one `jr.scan`, as scan-over-layers models are written to compile once for any
depth. Even stages end where `boundaries=` says; with `candidates`, every gap between two
blocks is a candidate for `partition="auto"` and `--auto`. Both stages of a cut inside the
stack read the whole stacked parameters, so each step copies them to the later stage and sums
its gradients back; the partitioner charges that (docs/partitioning.md, "A scanned stack of
layers").
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxreshard as jr
from jaxreshard.models import scan_boundaries


@dataclasses.dataclass(frozen=True)
class ScanConfig:
    """Sizes (each one a `--flag` of the command).

    Attributes:
        layers: residual blocks, stacked; stage cuts go between them.
        width: features every block reads and writes.
        hidden: each block's inner width.
        classes: labels to predict.
    """

    layers: int = 4
    width: int = 64
    hidden: int = 256
    classes: int = 10


PRESETS = {"tiny": ScanConfig(), "deep": ScanConfig(layers=12, width=128, hidden=512)}
UNIT = "samples"


def num_layers(cfg: ScanConfig) -> int:
    return cfg.layers


def init_params(cfg: ScanConfig, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 1.0 / np.sqrt(shape[-2]), shape).astype(np.float32)

    L, w, h = cfg.layers, cfg.width, cfg.hidden
    stack = {
        "up": {"w": normal(L, w, h), "b": np.zeros((L, h), np.float32)},
        "down": {"w": normal(L, h, w), "b": np.zeros((L, w), np.float32)},
    }
    head = {"w": normal(w, cfg.classes), "b": np.zeros(cfg.classes, np.float32)}
    return {"stack": stack, "head": head}


def block(x: jax.Array, p: dict) -> tuple[jax.Array, None]:
    h = jax.nn.gelu(x @ p["up"]["w"] + p["up"]["b"])
    return x + h @ p["down"]["w"] + p["down"]["b"], None


def loss_fn(params: dict, batch: dict, cfg: ScanConfig, num_stages: int, candidates: bool):
    ends = () if candidates else scan_boundaries(cfg.layers, num_stages)  # (even stages)
    x, _ = jr.scan(block, batch["x"], params["stack"], boundaries=ends)
    logits = x @ params["head"]["w"] + params["head"]["b"]
    labels = jax.nn.one_hot(batch["y"], cfg.classes)
    return jnp.mean(optax.softmax_cross_entropy(logits, labels))


def train_step(cfg: ScanConfig, num_stages: int, optimizer, *, candidates: bool = False):
    """`(params, opt_state, batch) -> (params, opt_state, loss)`: `num_stages` even stages, or
    with `candidates` a candidate between every two blocks (jr.scan's)."""

    def step(params, opt_state, batch):
        loss, grads = jr.value_and_grad(loss_fn)(params, batch, cfg, num_stages, candidates)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def synthetic_batch(cfg: ScanConfig, batch_size: int, step: int, seed: int = 0) -> dict:
    """Inputs whose label is the argmax of a fixed random projection: learnable."""
    teacher = np.random.default_rng(seed).normal(size=(cfg.width, cfg.classes))
    x = np.random.default_rng((seed, step)).normal(size=(batch_size, cfg.width))
    return {"x": x.astype(np.float32), "y": np.argmax(x @ teacher, axis=1).astype(np.int32)}
