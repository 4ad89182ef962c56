"""GPT in plain JAX: token and position embeddings, pre-LN transformer blocks (causal self-
attention, MLP), a final LayerNorm and an output projection tied to the token embedding.

`train_step(cfg, num_stages)` returns a step for `jaxreshard.parallelize`: the blocks are spread
evenly over the stages with `jr.stage_boundary` (or, with `candidates=True`, every block ends in
a `jr.stage_candidate` for `partition="auto"` to choose from), and the tied embedding is used
by the first stage (lookup) and the last (projection), so its gradient is summed across stages.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jaxreshard.frontend import value_and_grad
from jaxreshard.models._common import (
    MAX_LAYERS,
    check_sizes,
    default_optimizer,
    layer_norm,
    stage_marker,
)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The sizes of a GPT (pre-LN decoder-only transformer).

    Attributes:
        vocab: tokens in the vocabulary.
        seq: tokens per sequence (the context length).
        hidden: the model width (embedding and residual stream).
        layers: transformer blocks.
        heads: attention heads per block; must divide hidden.
    """

    vocab: int
    seq: int
    hidden: int
    layers: int
    heads: int

    def __post_init__(self) -> None:
        check_sizes(
            "GPTConfig",
            {f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
            {"layers": MAX_LAYERS},
        )
        if self.hidden % self.heads:
            raise ValueError(
                f"GPTConfig: hidden={self.hidden} is not a multiple of heads={self.heads}"
            )

    @property
    def num_params(self) -> int:
        h = self.hidden
        per_block = 12 * h * h + 13 * h
        return self.vocab * h + self.seq * h + self.layers * per_block + 2 * h

    def activation_bytes(self, batch_size: int) -> int:
        """A rough f32 training-memory estimate of the activations a batch keeps for the
        backward (per layer about 68 s h + 10 a s^2 bytes a sample, as Korthikanti et al.
        count for 16-bit, doubled), plus the logits."""
        b, s, h, a = batch_size, self.seq, self.hidden, self.heads
        return b * s * (self.layers * 2 * (34 * h + 5 * a * s) + 12 * self.vocab)

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 N plus attention's 12 L h s (Kaplan et al.)."""
        return 6 * self.num_params + 12 * self.layers * self.hidden * self.seq


PRESETS = {
    "tiny": GPTConfig(vocab=512, seq=64, hidden=64, layers=4, heads=4),
    "small": GPTConfig(vocab=2048, seq=128, hidden=256, layers=8, heads=8),
    "125M": GPTConfig(vocab=51200, seq=1024, hidden=768, layers=12, heads=12),
    "350M": GPTConfig(vocab=51200, seq=1024, hidden=1024, layers=24, heads=16),
    "760M": GPTConfig(vocab=51200, seq=1024, hidden=1536, layers=24, heads=16),
    "1.3B": GPTConfig(vocab=51200, seq=1024, hidden=2048, layers=24, heads=32),
    "2.6B": GPTConfig(vocab=51200, seq=1024, hidden=2560, layers=32, heads=32),
}


def init_params(cfg: GPTConfig, seed: int = 0) -> dict[str, Any]:
    """Initial parameters (GPT-2 style scales), as numpy arrays."""
    rng = np.random.default_rng(seed)
    h = cfg.hidden

    def normal(*shape: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    blocks = []
    for _ in range(cfg.layers):
        blocks.append(
            {
                "ln1": {"g": np.ones(h, np.float32), "b": np.zeros(h, np.float32)},
                "qkv": {"w": normal(h, 3 * h), "b": np.zeros(3 * h, np.float32)},
                "proj": {
                    "w": normal(h, h, scale=0.02 / math.sqrt(2 * cfg.layers)),
                    "b": np.zeros(h, np.float32),
                },
                "ln2": {"g": np.ones(h, np.float32), "b": np.zeros(h, np.float32)},
                "fc": {"w": normal(h, 4 * h), "b": np.zeros(4 * h, np.float32)},
                "out": {
                    "w": normal(4 * h, h, scale=0.02 / math.sqrt(2 * cfg.layers)),
                    "b": np.zeros(h, np.float32),
                },
            }
        )
    return {
        "wte": normal(cfg.vocab, h),
        "wpe": normal(cfg.seq, h, scale=0.01),
        "blocks": blocks,
        "lnf": {"g": np.ones(h, np.float32), "b": np.zeros(h, np.float32)},
    }


def attention(p: dict[str, Any], x: jax.Array, heads: int) -> jax.Array:
    b, s, h = x.shape
    qkv = x @ p["qkv"]["w"] + p["qkv"]["b"]
    q, k, v = jnp.split(qkv.reshape(b, s, 3, heads, h // heads), 3, axis=2)
    q, k, v = (t[:, :, 0].transpose(0, 2, 1, 3) for t in (q, k, v))  # (b, heads, s, d)
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(h // heads)
    causal = jnp.tril(jnp.ones((s, s), bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    out = jax.nn.softmax(scores, axis=-1) @ v
    return out.transpose(0, 2, 1, 3).reshape(b, s, h) @ p["proj"]["w"] + p["proj"]["b"]


def block(p: dict[str, Any], x: jax.Array, heads: int) -> jax.Array:
    x = x + attention(p, layer_norm(x, p["ln1"]), heads)
    hidden = jax.nn.gelu(layer_norm(x, p["ln2"]) @ p["fc"]["w"] + p["fc"]["b"])
    return x + hidden @ p["out"]["w"] + p["out"]["b"]


def loss(
    params: dict[str, Any],
    tokens: jax.Array,
    cfg: GPTConfig,
    num_stages: int = 1,
    candidates: bool = False,
):
    """Mean next-token cross entropy; `tokens` is (batch, seq + 1). The blocks end in stage
    markers (`stage_marker`)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = jnp.take(params["wte"], inputs, axis=0) + params["wpe"][: inputs.shape[1]]
    mark = stage_marker(cfg.layers, num_stages, candidates)
    for i, p in enumerate(params["blocks"]):
        x = mark(block(p, x, cfg.heads), i)
    x = layer_norm(x, params["lnf"])
    logits = x @ params["wte"].T  # tied with the token embedding
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def train_step(
    cfg: GPTConfig,
    num_stages: int,
    optimizer: optax.GradientTransformation | None = None,
    *,
    candidates: bool = False,
):
    """A step `(params, opt_state, batch) -> (params, opt_state, loss)` that updates the
    parameters with `optimizer` (default: `optax.adam(1e-3)`); `init_state` with the same
    optimizer makes its first `opt_state`. `candidates=True`: every block but the last ends in
    a `jr.stage_candidate` instead of `num_stages` even stages."""
    optimizer = optimizer if optimizer is not None else default_optimizer()

    def step(params: Any, opt_state: Any, batch: dict[str, jax.Array]):
        tokens = batch["tokens"]
        value, grads = value_and_grad(lambda p: loss(p, tokens, cfg, num_stages, candidates))(
            params
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


def synthetic_batch(cfg: GPTConfig, batch_size: int, step: int, seed: int = 0) -> dict[str, Any]:
    """A seeded batch of token sequences with learnable structure (each token predicts the
    next through a fixed random map, with noise), so the loss falls within a few steps."""
    rng = np.random.default_rng(seed)
    successor = rng.integers(0, cfg.vocab, cfg.vocab)
    local = np.random.default_rng((seed, step))
    tokens = np.empty((batch_size, cfg.seq + 1), np.int32)
    tokens[:, 0] = local.integers(0, cfg.vocab, batch_size)
    for t in range(1, cfg.seq + 1):
        noise = local.random(batch_size) < 0.1
        tokens[:, t] = np.where(
            noise, local.integers(0, cfg.vocab, batch_size), successor[tokens[:, t - 1]]
        )
    return {"tokens": tokens}


def init_state(
    cfg: GPTConfig, seed: int = 0, optimizer: optax.GradientTransformation | None = None
) -> tuple[Any, Any]:
    """Initial parameters (numpy) and `optimizer`'s state for them (default: Adam's)."""
    params = init_params(cfg, seed)
    optimizer = optimizer if optimizer is not None else default_optimizer()
    return params, optimizer.init(params)


def param_specs(cfg: GPTConfig, axis: str = "model") -> dict[str, Any]:
    """Megatron-style tensor parallelism over mesh axis `axis`: attention heads and the MLP's
    hidden units split, the embedding split by vocabulary (so the logits are too)."""
    col, row, vec, rep = P(None, axis), P(axis, None), P(axis), P()
    norm = {"g": rep, "b": rep}
    block = {
        "ln1": norm,
        "qkv": {"w": col, "b": vec},
        "proj": {"w": row, "b": rep},
        "ln2": norm,
        "fc": {"w": col, "b": vec},
        "out": {"w": row, "b": rep},
    }
    return {"wte": row, "wpe": rep, "blocks": [block] * cfg.layers, "lnf": norm}
