"""Train an Equinox MLP classifier with dropout as a 2-stage pipeline.

    python examples/train_equinox.py

The model is written as Equinox's docs write one: per example, vmapped over the batch, with
static fields (the activation function, the depth) that `parallelize` treats as static, as
`eqx.filter_jit` does. The step passes the whole model; `jr.filter_value_and_grad` is
`eqx.filter_value_and_grad` for pipelines. Dropout keys are split per example, and each
micro-batch draws exactly its rows of the whole batch's draw.
"""

import jax

jax.config.update("jax_num_cpu_devices", 4)  # fake CPU devices: 2 stages x (1, 2) meshes

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxreshard as jr  # noqa: E402

FEATURES, HIDDEN, CLASSES = 16, 64, 4


class Classifier(eqx.Module):
    first: eqx.nn.Linear
    second: eqx.nn.Linear
    head: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    activation: callable = eqx.field(static=True)

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.first = eqx.nn.Linear(FEATURES, HIDDEN, key=k1)
        self.second = eqx.nn.Linear(HIDDEN, HIDDEN, key=k2)
        self.head = eqx.nn.Linear(HIDDEN, CLASSES, key=k3)
        self.dropout = eqx.nn.Dropout(0.2)
        self.activation = jax.nn.relu

    def __call__(self, x, key):
        h = self.dropout(self.activation(self.first(x)), key=key)
        h = jr.stage_boundary(h)  # stage 0 ends here
        return self.head(self.activation(self.second(h)))


def loss_fn(model, x, y, key):
    logits = jax.vmap(model)(x, jax.random.split(key, x.shape[0]))
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, jnp.mean(jnp.argmax(logits, -1) == y)


optimizer = optax.adam(1e-2)
config = jr.PipelineConfig(
    num_micro_batches=4, stage_mesh_shape=(1, 2), mesh_axis_names=("data", "model")
)


@jr.parallelize(config=config, batch_argnums=(2, 3))
def train_step(model, opt_state, x, y, key):
    (loss, accuracy), grads = jr.filter_value_and_grad(loss_fn, has_aux=True)(model, x, y, key)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss, accuracy


model = Classifier(jax.random.key(0))
opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
rng = np.random.default_rng(0)
centers = rng.normal(size=(CLASSES, FEATURES)).astype(np.float32)
key = jax.random.key(1)
for i in range(40):
    y = rng.integers(0, CLASSES, size=32).astype(np.int32)
    x = (centers[y] + 1.5 * rng.normal(size=(32, FEATURES))).astype(np.float32)
    key, step_key = jax.random.split(key)
    model, opt_state, loss, accuracy = train_step(model, opt_state, x, y, step_key)
    if i % 10 == 0:
        print(f"step {i:2d}  loss {float(loss):.3f}  accuracy {float(accuracy):.2f}")
print(f"step {i:2d}  loss {float(loss):.3f}  accuracy {float(accuracy):.2f}")
