"""Train a Flax NNX language model with dropout as a 2-stage pipeline, then evaluate it there.

    python examples/train_nnx.py

The model is written as Flax's docs write one; `jr.stage_boundary` in `__call__` marks where
stage 0 ends. The step is NNX's functional form ("Bring your model" in the README): the model is
split into parameters and the rest (dropout's RNG state), `jr.value_and_grad(..., has_aux=True)`
returns the advanced RNG state and the accuracy, and Optax updates the parameters. Each update
runs where its parameter lives; the eval step is pipelined forward only on the same meshes and
takes the trained state as it is.
"""

import jax

jax.config.update("jax_num_cpu_devices", 4)  # fake CPU devices: 2 stages x (1, 2) meshes

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxreshard as jr  # noqa: E402

VOCAB, DIM, SEQ = 64, 64, 32


class Block(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)
        self.up = nnx.Linear(DIM, 4 * DIM, rngs=rngs)
        self.down = nnx.Linear(4 * DIM, DIM, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(self.down(nnx.gelu(self.up(self.norm(x)))))


class LM(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.blocks = nnx.List([Block(rngs=rngs) for _ in range(4)])
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            if i == 2:
                x = jr.stage_boundary(x)  # stage 0 ends here
            x = block(x)
        return self.embed.attend(self.norm(x))  # tied embedding: used by both stages


model = LM(rngs=nnx.Rngs(0, dropout=1))
graphdef, params, rest = nnx.split(model, nnx.Param, ...)
optimizer = optax.adamw(3e-3)
opt_state = optimizer.init(params)
config = jr.PipelineConfig(
    num_micro_batches=4,
    schedule="eager_1f1b",
    weight_delay=True,
    stage_mesh_shape=(1, 2),
    mesh_axis_names=("data", "model"),
)


@jr.parallelize(config=config, batch_argnums=(3,))
def train_step(params, rest, opt_state, tokens):
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def loss_fn(params):
        model = nnx.merge(graphdef, params, rest, copy=True)
        logits = model(inputs)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
        return loss, (nnx.state(model, nnx.Not(nnx.Param)), accuracy)

    (loss, (rest, accuracy)), grads = jr.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), rest, opt_state, {"loss": loss, "acc": accuracy}


@jr.parallelize(config=config, batch_argnums=(2,))
def eval_step(params, rest, tokens):
    model = nnx.merge(graphdef, params, rest, copy=True)
    model.eval()  # dropout off
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


rng = np.random.default_rng(0)
pattern = rng.integers(0, VOCAB, size=SEQ + 1)


def batch(n=16):
    """Noisy copies of one sequence: learnable, so the loss visibly falls."""
    tokens = np.tile(pattern, (n, 1))
    noise = rng.random(tokens.shape) < 0.1
    return np.where(noise, rng.integers(0, VOCAB, size=tokens.shape), tokens).astype(np.int32)


for i in range(30):
    params, rest, opt_state, metrics = train_step(params, rest, opt_state, batch())
    if i % 5 == 0:
        loss, acc = float(metrics["loss"]), float(metrics["acc"])
        print(f"step {i:2d}  loss {loss:.3f}  accuracy {acc:.2f}")
print(f"eval loss {float(eval_step(params, rest, batch())):.3f}")
exported = jr.collect(params)  # host numpy arrays, e.g. for a checkpoint
print("parameters:", sum(x.size for x in jax.tree.leaves(exported)))
