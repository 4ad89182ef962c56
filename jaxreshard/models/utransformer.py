"""U-Transformer in plain JAX: a diffusion-style U-shaped conv net with self-attention.

Four down levels halve the resolution and double the channels; four up levels mirror them and
concatenate the long skip connection saved by the matching down level; residual conv blocks carry
a noise-level embedding; self-attention follows the conv blocks at the low resolutions and in the
middle. The model is trained to recover clean images from noisy ones (denoising MSE).

`train_step(cfg, num_stages)` spreads the nine units (4 down, middle, 4 up) evenly over the
stages, so the skip connections of the outer levels cross from the first stages to the last ones:
the case where several boundary tensors of different sizes and layouts leave one stage. With
`candidates=True` every unit but the last ends in a `jr.stage_candidate` instead, for
`partition="auto"` to choose the cuts.
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
    check_sizes,
    default_optimizer,
    group_norm,
    stage_marker,
)

MAX_LEVELS = 16
MAX_BLOCKS = 256  # per level


@dataclasses.dataclass(frozen=True)
class UTransformerConfig:
    """Sizes. Level l has `blocks` residual conv blocks of `base * channel_mult[l]` channels
    at resolution `image / 2**l`; attention follows them at levels `attention_from` and up (the
    low resolutions) and in the middle.

    Attributes:
        image: height and width of the square images, in pixels.
        channels: channels of the input images.
        base: channels at the first level.
        channel_mult: each level's channels as a multiple of `base` (one entry per level).
        blocks: residual conv blocks per level.
        attention_from: the first level with attention (levels count from 0).
        heads: attention heads; must divide base.
        groups: GroupNorm groups; must divide base.
    """

    image: int = 32
    channels: int = 3
    base: int = 320
    channel_mult: tuple[int, ...] = (1, 2, 4, 8)
    blocks: int = 1
    attention_from: int = 2
    heads: int = 8
    groups: int = 32

    def __post_init__(self) -> None:
        mult = self.channel_mult
        if not isinstance(mult, (list, tuple)) or not 1 <= len(mult) <= MAX_LEVELS:
            raise ValueError(
                f"UTransformerConfig: channel_mult={mult!r} must be a list of 1 to {MAX_LEVELS} "
                "integers (one per level), e.g. [1, 2, 4, 8]"
            )
        object.__setattr__(self, "channel_mult", tuple(mult))  # from TOML lists
        sizes = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("channel_mult", "attention_from")
        }
        sizes |= {f"channel_mult[{i}]": m for i, m in enumerate(self.channel_mult)}
        check_sizes("UTransformerConfig", sizes, {"blocks": MAX_BLOCKS, "image": 2**16})
        a = self.attention_from
        if not isinstance(a, int) or isinstance(a, bool) or a < 0:
            raise ValueError(
                f"UTransformerConfig: attention_from={a!r} must be an integer >= 0 (a level; "
                f"{self.levels} or more: attention only in the middle)"
            )
        if self.image % 2 ** (self.levels - 1):
            raise ValueError(
                f"UTransformerConfig: image={self.image} must be divisible by "
                f"2**(levels - 1) = {2 ** (self.levels - 1)}"
            )
        if self.base % self.groups:
            raise ValueError(
                f"UTransformerConfig: base={self.base} is not a multiple of groups={self.groups}"
            )
        if self.base % self.heads:
            raise ValueError(
                f"UTransformerConfig: base={self.base} is not a multiple of heads={self.heads}"
            )

    @property
    def levels(self) -> int:
        return len(self.channel_mult)

    def width(self, level: int) -> int:
        return self.base * self.channel_mult[level]

    @property
    def num_units(self) -> int:
        return 2 * self.levels + 1

    def activation_bytes(self, batch_size: int) -> int:
        """A rough f32 estimate of the activations a batch keeps for the backward: about a
        dozen tensors of each block's size on the way down and up, and the attention maps."""
        total = 0
        for level in range(self.levels):
            pixels = (self.image // 2**level) ** 2
            total += 2 * 12 * 4 * pixels * self.width(level) * (self.blocks + 1)
            if level >= self.attention_from:
                total += 2 * 4 * 4 * self.heads * pixels * pixels
        return batch_size * total

    @property
    def num_params(self) -> int:
        return sum(
            int(np.prod(np.shape(x))) for x in jax.tree.leaves(init_params(self, abstract=True))
        )


PRESETS = {
    "tiny": UTransformerConfig(image=16, base=16, heads=2, groups=4),
    "comm": UTransformerConfig(image=32, base=8, heads=2, groups=4, attention_from=3),
    "small": UTransformerConfig(image=32, base=64, heads=4, groups=16),
    "470M": UTransformerConfig(
        image=32, base=320, channel_mult=(1, 2, 4, 4), blocks=2, heads=8, groups=32
    ),
}


# -- parameters ---------------------------------------------------------------------------------


def init_params(
    cfg: UTransformerConfig, seed: int = 0, *, abstract: bool = False
) -> dict[str, Any]:
    """Initial parameters as numpy arrays (He-scaled convs, zero-initialised residual outputs);
    with `abstract`, `jax.ShapeDtypeStruct`s (for counting a large model without allocating)."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int, fan_in: int, zero: bool = False) -> Any:
        if abstract:
            return jax.ShapeDtypeStruct(shape, np.float32)
        if zero:
            return np.zeros(shape, np.float32)
        return (rng.standard_normal(shape) * math.sqrt(2 / fan_in)).astype(np.float32)

    def const(n: int, value: float) -> Any:
        return jax.ShapeDtypeStruct((n,), np.float32) if abstract else np.full(n, value, np.float32)

    def conv(cin: int, cout: int, k: int = 3, zero: bool = False) -> dict[str, Any]:
        return {"w": normal(k, k, cin, cout, fan_in=k * k * cin, zero=zero), "b": const(cout, 0)}

    def dense(cin: int, cout: int, zero: bool = False) -> dict[str, Any]:
        return {"w": normal(cin, cout, fan_in=cin, zero=zero), "b": const(cout, 0)}

    def norm(c: int) -> dict[str, Any]:
        return {"g": const(c, 1), "b": const(c, 0)}

    temb = 4 * cfg.base

    def res(cin: int, cout: int) -> dict[str, Any]:
        p = {
            "norm1": norm(cin),
            "conv1": conv(cin, cout),
            "temb": dense(temb, cout),
            "norm2": norm(cout),
            "conv2": conv(cout, cout, zero=True),
        }
        if cin != cout:
            p["skip"] = conv(cin, cout, k=1)
        return p

    def attn(c: int) -> dict[str, Any]:
        return {"norm": norm(c), "qkv": dense(c, 3 * c), "proj": dense(c, c, zero=True)}

    down, up = [], []
    c = cfg.base
    skips = []
    for level in range(cfg.levels):
        w = cfg.width(level)
        unit = {"res": [res(c, w)] + [res(w, w) for _ in range(cfg.blocks - 1)]}
        if level >= cfg.attention_from:
            unit["attn"] = attn(w)
        if level < cfg.levels - 1:
            unit["down"] = conv(w, w)
        down.append(unit)
        skips.append(w)
        c = w
    middle = {"res1": res(c, c), "attn": attn(c), "res2": res(c, c)}
    for level in reversed(range(cfg.levels)):
        w = cfg.width(level)
        unit = {"res": [res(c + skips[level], w)] + [res(w, w) for _ in range(cfg.blocks - 1)]}
        if level >= cfg.attention_from:
            unit["attn"] = attn(w)
        if level > 0:
            unit["up"] = conv(w, w)
        up.append(unit)
        c = w
    return {
        "time": {"fc1": dense(cfg.base, temb), "fc2": dense(temb, temb)},
        "stem": conv(cfg.channels, cfg.base),
        "down": down,
        "middle": middle,
        "up": up,
        "out_norm": norm(cfg.base),
        "out": conv(cfg.base, cfg.channels),
    }


# -- the network ---------------------------------------------------------------------------------


def conv2d(p: dict[str, Any], x: jax.Array, stride: int = 1) -> jax.Array:
    k = p["w"].shape[0]
    y = jax.lax.conv_general_dilated(
        x,
        p["w"],
        (stride, stride),
        [(k // 2, k // 2)] * 2,
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    return y + p["b"]


def res_block(p: dict[str, Any], x: jax.Array, temb: jax.Array, groups: int) -> jax.Array:
    h = conv2d(p["conv1"], jax.nn.silu(group_norm(x, p["norm1"], groups)))
    h = h + (temb @ p["temb"]["w"] + p["temb"]["b"])[:, None, None, :]
    h = conv2d(p["conv2"], jax.nn.silu(group_norm(h, p["norm2"], groups)))
    return (conv2d(p["skip"], x) if "skip" in p else x) + h


def self_attention(p: dict[str, Any], x: jax.Array, heads: int, groups: int) -> jax.Array:
    n, hh, ww, c = x.shape
    t = group_norm(x, p["norm"], groups).reshape(n, hh * ww, c)
    qkv = (t @ p["qkv"]["w"] + p["qkv"]["b"]).reshape(n, hh * ww, 3, heads, c // heads)
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    weights = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / math.sqrt(c // heads), axis=-1)
    out = (weights @ v).transpose(0, 2, 1, 3).reshape(n, hh * ww, c)
    return x + (out @ p["proj"]["w"] + p["proj"]["b"]).reshape(n, hh, ww, c)


def noise_embedding(sigma: jax.Array, dim: int) -> jax.Array:
    """Sinusoidal features of log(sigma), as diffusion models embed their time step."""
    freqs = jnp.exp(-math.log(10_000) * jnp.arange(dim // 2) / (dim // 2))
    angles = jnp.log(sigma)[:, None] * 100 * freqs[None, :]
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


def denoise(
    params: dict[str, Any],
    noisy: jax.Array,
    sigma: jax.Array,
    cfg: UTransformerConfig,
    num_stages: int = 1,
    candidates: bool = False,
) -> jax.Array:
    """Predict the clean image from `noisy` (NHWC) at noise levels `sigma` (N,). The units end
    in stage markers (`stage_marker`); skips and the embedding cross stages on their own."""
    cut = stage_marker(cfg.num_units, num_stages, candidates)

    t = params["time"]
    temb = noise_embedding(sigma, cfg.base) @ t["fc1"]["w"] + t["fc1"]["b"]
    temb = jax.nn.silu(temb) @ t["fc2"]["w"] + t["fc2"]["b"]
    g = cfg.groups
    x = conv2d(params["stem"], noisy)
    skips = []
    for unit, p in enumerate(params["down"]):
        for r in p["res"]:
            x = res_block(r, x, temb, g)
        if "attn" in p:
            x = self_attention(p["attn"], x, cfg.heads, g)
        skips.append(x)
        if "down" in p:
            x = conv2d(p["down"], x, stride=2)
        x = cut(x, unit)
    m = params["middle"]
    x = res_block(m["res1"], x, temb, g)
    x = self_attention(m["attn"], x, cfg.heads, g)
    x = cut(res_block(m["res2"], x, temb, g), cfg.levels)
    for unit, p in enumerate(params["up"], start=cfg.levels + 1):
        x = jnp.concatenate([x, skips.pop()], axis=-1)
        for r in p["res"]:
            x = res_block(r, x, temb, g)
        if "attn" in p:
            x = self_attention(p["attn"], x, cfg.heads, g)
        if "up" in p:
            x = conv2d(p["up"], jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2))
        x = cut(x, unit)
    x = jax.nn.silu(group_norm(x, params["out_norm"], g))
    return conv2d(params["out"], x)


def loss(
    params: dict[str, Any],
    batch: dict[str, jax.Array],
    cfg: UTransformerConfig,
    num_stages: int = 1,
    candidates: bool = False,
) -> jax.Array:
    """Denoising MSE: noise the clean images at each sample's sigma and predict them back."""
    sigma = batch["sigma"]
    noisy = batch["images"] + sigma[:, None, None, None] * batch["noise"]
    predicted = denoise(params, noisy, sigma, cfg, num_stages, candidates)
    return jnp.mean((predicted - batch["images"]) ** 2)


def train_step(
    cfg: UTransformerConfig,
    num_stages: int,
    optimizer: optax.GradientTransformation | None = None,
    *,
    candidates: bool = False,
):
    """A step `(params, opt_state, batch) -> (params, opt_state, loss)` that updates the
    parameters with `optimizer` (default: `optax.adam(1e-3)`); `init_state` with the same
    optimizer makes its first `opt_state`. `candidates=True`: every unit but the last ends in
    a `jr.stage_candidate` instead of `num_stages` even stages."""
    optimizer = optimizer if optimizer is not None else default_optimizer()

    def step(params: Any, opt_state: Any, batch: dict[str, jax.Array]):
        value, grads = value_and_grad(lambda p: loss(p, batch, cfg, num_stages, candidates))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


def synthetic_batch(
    cfg: UTransformerConfig, batch_size: int, step: int, seed: int = 0
) -> dict[str, Any]:
    """Seeded images (sums of a few smooth colored blobs), Gaussian noise and noise levels."""
    local = np.random.default_rng((seed, step))
    n, s = batch_size, cfg.image
    coords = (np.arange(s) + 0.5) / s
    images = np.zeros((n, s, s, cfg.channels), np.float32)
    for _ in range(3):
        cy, cx = local.random((2, n, 1, 1))
        width = 0.05 + 0.2 * local.random((n, 1, 1))
        blob = np.exp(
            -((coords[None, :, None] - cy) ** 2 + (coords[None, None, :] - cx) ** 2)
            / (2 * width**2)
        )
        color = local.uniform(-1, 1, (n, 1, 1, cfg.channels))
        images += blob[..., None] * color
    noise = local.standard_normal(images.shape).astype(np.float32)
    sigma = np.exp(local.uniform(np.log(0.05), np.log(1.0), n)).astype(np.float32)
    return {"images": images, "noise": noise, "sigma": sigma}


def init_state(
    cfg: UTransformerConfig, seed: int = 0, optimizer: optax.GradientTransformation | None = None
) -> tuple[Any, Any]:
    """Initial parameters (numpy) and `optimizer`'s state for them (default: Adam's)."""
    params = init_params(cfg, seed)
    optimizer = optimizer if optimizer is not None else default_optimizer()
    return params, optimizer.init(params)


def param_specs(cfg: UTransformerConfig, axis: str = "model") -> dict[str, Any]:
    """Tensor parallelism over mesh axis `axis`: each residual block's first conv splits its
    output channels and its second conv its input channels (one all-reduce per block, as in
    Megatron's MLP); attention splits heads; the rest is replicated."""
    params = init_params(cfg, abstract=True)
    rep = P()

    def res(p: dict[str, Any]) -> dict[str, Any]:
        out = jax.tree.map(lambda _: rep, p)
        out["conv1"] = {"w": P(None, None, None, axis), "b": P(axis)}
        out["norm2"] = {"g": P(axis), "b": P(axis)}
        out["temb"] = {"w": P(None, axis), "b": P(axis)}
        out["conv2"] = {"w": P(None, None, axis, None), "b": rep}
        return out

    def attn(p: dict[str, Any]) -> dict[str, Any]:
        out = jax.tree.map(lambda _: rep, p)
        out["qkv"] = {"w": P(None, axis), "b": P(axis)}
        out["proj"] = {"w": P(axis, None), "b": rep}
        return out

    def unit(u: dict[str, Any]) -> dict[str, Any]:
        out = jax.tree.map(lambda _: rep, u)
        out["res"] = [res(r) for r in u["res"]]
        if "attn" in u:
            out["attn"] = attn(u["attn"])
        return out

    specs = jax.tree.map(lambda _: rep, params)
    specs["down"] = [unit(u) for u in params["down"]]
    specs["up"] = [unit(u) for u in params["up"]]
    m = params["middle"]
    specs["middle"] = {"res1": res(m["res1"]), "attn": attn(m["attn"]), "res2": res(m["res2"])}
    specs["time"] = {
        "fc1": {"w": P(None, axis), "b": P(axis)},
        "fc2": {"w": P(axis, None), "b": rep},
    }
    return specs
