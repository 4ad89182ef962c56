"""Models as Flax (NNX, Linen) and Equinox users write them: pipelined steps equal `jax.jit`."""

import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxreshard as jr

nnx = pytest.importorskip("flax.nnx")
nn = pytest.importorskip("flax.linen")
eqx = pytest.importorskip("equinox")

VOCAB, DIM, SEQ, ROWS = 32, 16, 8, 8


def config(**overrides):
    base = dict(
        num_micro_batches=4,
        stage_mesh_shape=(1, 2),
        mesh_axis_names=("data", "model"),
        backend="local",
    )
    return jr.PipelineConfig(**{**base, **overrides})


def tokens(seed=0, rows=ROWS):
    return np.random.default_rng(seed).integers(0, VOCAB, size=(rows, SEQ + 1)).astype(np.int32)


def leaves(tree):
    fetch = lambda x: x.fetch() if isinstance(x, jr.RemoteArray) else x
    out = []
    for x in jax.tree.leaves(tree):
        x = fetch(x)
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out.append(np.asarray(x))
    return out


def assert_same(got, want, rtol=1e-5, atol=1e-6):
    a, b = leaves(got), leaves(want)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, y.shape, x.dtype, y.dtype)
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def run(step, state, batches):
    """Three steps; `step(*state, batch)` returns (*state, metrics)."""
    out = []
    for batch in batches:
        *state, metrics = step(*state, batch)
        out.append(metrics)
    return state, out


def three_batches():
    return [{"tokens": tokens(seed)} for seed in range(3)]


# -- Flax NNX -----------------------------------------------------------------------------------


class NNXLM(nnx.Module):
    """A tiny language model with dropout and a tied embedding, cut into two stages."""

    def __init__(self, *, rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.hidden = nnx.Linear(DIM, DIM, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.out = nnx.Linear(DIM, DIM, rngs=rngs)

    def __call__(self, x):
        h = self.drop(nnx.gelu(self.hidden(self.embed(x))))
        h = jr.stage_boundary(h)
        return self.embed.attend(nnx.gelu(self.out(h)))


def nnx_step(graphdef, tx):
    def train_step(params, rest, opt_state, batch):
        def loss_fn(params):
            model = nnx.merge(graphdef, params, rest, copy=True)
            logits = model(batch["tokens"][:, :-1])
            labels = batch["tokens"][:, 1:]
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
            return loss, (nnx.state(model, nnx.Not(nnx.Param)), accuracy)

        (loss, (rest, accuracy)), grads = jr.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), rest, opt_state, (loss, accuracy)

    return train_step


def test_nnx_lm_with_dropout_and_metrics_matches_jax_jit():
    model = NNXLM(rngs=nnx.Rngs(0, dropout=1))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adamw(1e-2)
    step = nnx_step(graphdef, tx)
    state = (params, rest, tx.init(params))
    want = run(jax.jit(step), state, three_batches())
    got = run(jr.parallelize(step, config=config(), batch_argnums=(3,)), state, three_batches())
    assert_same(got, want)
    # the RNG count advanced once per step, as under jax.jit
    assert int(got[0][1]["drop"]["rngs"]["count"][...]) == 3


def test_nnx_value_and_grad_names_the_replacement():
    model = NNXLM(rngs=nnx.Rngs(0, dropout=1))

    def train_step(model, batch):
        def loss_fn(model):
            return jnp.mean(model(batch["tokens"][:, :-1]))

        return nnx.value_and_grad(loss_fn)(model)

    graphdef, state = nnx.split(model)
    step = lambda state, batch: train_step(nnx.merge(graphdef, state), batch)
    with pytest.raises(jr.PipelineSplitError, match=r"nnx.split\(model, nnx.Param, ...\)") as info:
        jr.parallelize(step, config=config(), batch_argnums=(1,))(state, {"tokens": tokens()})
    # Issue 25: the message pointed into jaxreshard/frontend/_markers.py; it names the user's
    # nnx.value_and_grad line, and the boundary's line in the model.
    here = re.escape(__file__)
    call = train_step.__code__.co_firstlineno + 4
    boundary = NNXLM.__call__.__code__.co_firstlineno + 2
    assert re.match(
        rf"{here}:{call} \(.*train_step\): the step differentiates with "
        rf"nnx.value_and_grad/nnx.grad through jr.stage_boundary \(at {here}:{boundary} ",
        str(info.value),
    ), str(info.value)
    assert "_markers.py" not in str(info.value)


# -- Flax Linen ---------------------------------------------------------------------------------


class LinenLM(nn.Module):
    stages: int = 2

    @nn.compact
    def __call__(self, x, *, train: bool):
        embed = nn.Embed(VOCAB, DIM)
        h = nn.gelu(nn.Dense(DIM)(embed(x)))
        h = nn.Dropout(0.25, deterministic=not train)(h)
        for _ in range(self.stages - 1):
            h = jr.stage_boundary(h)
            h = nn.Dropout(0.25, deterministic=not train)(nn.gelu(nn.Dense(DIM)(h)))
        return embed.attend(h)  # tied: the embedding is used by the first and the last stage


@pytest.mark.parametrize("stages", [2, 3])
def test_linen_lm_with_dropout_rngs_and_preprocessing_matches_jax_jit(stages):
    model = LinenLM(stages)
    params = model.init(jax.random.key(0), tokens()[:, :-1], train=False)["params"]
    tx = optax.sgd(0.1, momentum=0.9)

    def train_step(params, opt_state, batch, key):
        inputs, labels = batch["tokens"][:, :-1], batch["tokens"][:, 1:]  # before the loss
        onehot = jax.nn.one_hot(labels, VOCAB)

        def loss_fn(params):
            logits = model.apply({"params": params}, inputs, train=True, rngs={"dropout": key})
            return optax.softmax_cross_entropy(logits, onehot).mean()

        loss, grads = jr.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def steps(step):
        state, losses = (params, tx.init(params)), []
        for seed in range(3):
            *state, loss = step(*state, {"tokens": tokens(seed)}, jax.random.key(seed))
            losses.append(loss)
        return state, losses

    want = steps(jax.jit(train_step))
    got = steps(jr.parallelize(train_step, config=config(), batch_argnums=(2,)))
    assert_same(got, want)


# -- Equinox ------------------------------------------------------------------------------------


class EqxLM(eqx.Module):
    """Written per example (vmapped over the batch), with static fields and a function leaf."""

    embed: eqx.nn.Embedding
    hidden: eqx.nn.Linear
    drop: eqx.nn.Dropout
    act: callable
    depth: int

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.embed = eqx.nn.Embedding(VOCAB, DIM, key=k1)
        self.hidden = eqx.nn.Linear(DIM, DIM, key=k2)
        self.drop = eqx.nn.Dropout(0.25)
        self.act = jax.nn.gelu
        self.depth = 2

    def __call__(self, x, key):
        h = jax.vmap(self.embed)(x)
        for _ in range(self.depth):
            h = self.act(jax.vmap(self.hidden)(h))
        h = self.drop(h, key=key)
        h = jr.stage_boundary(h)
        return h @ self.embed.weight.T


def test_equinox_whole_model_argument_with_dropout_matches_filter_jit():
    model = EqxLM(jax.random.key(0))
    tx = optax.adam(1e-2)
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))

    def loss_fn(model, batch, key):
        keys = jax.random.split(key, batch.shape[0])
        logits = jax.vmap(model)(batch[:, :-1], keys)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    def make_step(value_and_grad):
        def train_step(model, opt_state, batch, key):
            loss, grads = value_and_grad(loss_fn)(model, batch, key)
            updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), opt_state, loss

        return train_step

    def steps(step):
        state, losses = (model, opt_state), []
        for seed in range(3):
            *state, loss = step(*state, tokens(seed), jax.random.key(10 + seed))
            losses.append(loss)
        return state, losses

    want = steps(eqx.filter_jit(make_step(eqx.filter_value_and_grad)))
    pipelined = jr.parallelize(
        make_step(jr.filter_value_and_grad), config=config(), batch_argnums=(2,)
    )
    got = steps(pipelined)
    assert_same(eqx.filter(got, eqx.is_array), eqx.filter(want, eqx.is_array))
    assert got[0][0].act is jax.nn.gelu and got[0][0].depth == 2  # static leaves come back

    wrong = jr.parallelize(
        make_step(eqx.filter_value_and_grad), config=config(), batch_argnums=(2,)
    )
    with pytest.raises(jr.PipelineSplitError, match=r"jr.filter_value_and_grad\(loss_fn\)") as info:
        wrong(model, opt_state, tokens(), jax.random.key(0))
    line = make_step.__code__.co_firstlineno + 2  # value_and_grad(loss_fn)(model, batch, key)
    assert str(info.value).startswith(
        f"{__file__}:{line} (test_equinox_whole_model_argument_with_dropout_matches_filter_jit."
        "<locals>.make_step.<locals>.train_step): the step differentiates with "
        "eqx.filter_value_and_grad/eqx.filter_grad through jr.stage_boundary"
    ), str(info.value)


# -- masked losses, aux outputs, preprocessing, eval ----------------------------------------------


def mlp_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "a": rng.normal(size=(6, 16)).astype(np.float32) * 0.4,
        "b": rng.normal(size=(16, 5)).astype(np.float32) * 0.4,
    }


def mlp_batch(seed=0, rows=8):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(rows, 6)).astype(np.float32),
        "y": rng.integers(0, 5, size=(rows,)).astype(np.int32),
        "mask": (rng.random(size=(rows,)) < 0.6).astype(np.float32),
    }


def forward(p, x):
    h = jnp.tanh(x @ p["a"])
    h = jr.stage_boundary(h)
    return h @ p["b"]


def test_masked_mean_warns_with_the_fix_and_the_fix_matches_jax_jit():
    def mean_of_means(params, batch):
        def loss_fn(p):
            losses = optax.softmax_cross_entropy_with_integer_labels(
                forward(p, batch["x"]), batch["y"]
            )
            return jnp.sum(losses * batch["mask"]) / jnp.sum(batch["mask"])

        return jr.value_and_grad(loss_fn)(params)

    with pytest.warns(jr.MicroBatchWarning, match=r"loss_reduction='sum'"):
        jr.parallelize(mean_of_means, config=config(), batch_argnums=(1,))(
            mlp_params(), mlp_batch()
        )

    def documented(params, batch):
        count = jnp.sum(batch["mask"])  # the whole batch's count, before the loss

        def loss_fn(p):
            losses = optax.softmax_cross_entropy_with_integer_labels(
                forward(p, batch["x"]), batch["y"]
            )
            return jnp.sum(losses * batch["mask"]) / count

        return jr.value_and_grad(loss_fn)(params)

    want = jax.jit(documented)(mlp_params(), mlp_batch())
    with warnings_as_errors():
        got = jr.parallelize(documented, config=config(loss_reduction="sum"), batch_argnums=(1,))(
            mlp_params(), mlp_batch()
        )
    assert_same(got, want)


def warnings_as_errors():
    import warnings

    manager = warnings.catch_warnings()
    manager.__enter__()
    warnings.simplefilter("error", jr.MicroBatchWarning)

    class Done:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            manager.__exit__(*exc)

    return Done()


def test_aux_outputs_are_concatenated_reduced_or_kept_as_jax_jit_computes_them():
    counter = np.int32(7)

    def train_step(params, batch, counter):
        labels = jnp.asarray(batch["y"])  # preprocessing before the loss

        def loss_fn(p):
            logits = forward(p, batch["x"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            aux = {
                "logits": logits,  # per example: concatenated in batch order
                "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels),  # reduced like the loss
                "counter": counter + 1,  # no batch dependence: as it is
                "norm": jnp.sum(p["b"] ** 2),
            }
            return loss, aux

        (loss, aux), grads = jr.value_and_grad(loss_fn, has_aux=True)(params)
        # metrics after the gradient from aux outputs and the batch are fine
        hits = jnp.sum(jnp.argmax(aux["logits"], -1) == labels)
        return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), loss, aux, hits

    want = jax.jit(train_step)(mlp_params(), mlp_batch(), counter)
    got = jr.parallelize(train_step, config=config(), batch_argnums=(1,))(
        mlp_params(), mlp_batch(), counter
    )
    assert_same(got, want)


def test_integer_batch_counts_in_aux_need_a_float_or_a_sum():
    def train_step(params, batch):
        def loss_fn(p):
            logits = forward(p, batch["x"])
            hits = jnp.sum(jnp.argmax(logits, -1) == batch["y"])
            return jnp.mean(logits**2), hits

        return jr.value_and_grad(loss_fn, has_aux=True)(params)

    with pytest.raises(ValueError, match=r"aux leaf 0 \(int32\[\]\) is an integer.*jnp.mean"):
        jr.parallelize(train_step, config=config(), batch_argnums=(1,))(mlp_params(), mlp_batch())
    got = jr.parallelize(train_step, config=config(loss_reduction="sum"), batch_argnums=(1,))
    (_, hits), _ = got(mlp_params(), mlp_batch())
    (_, want), _ = jax.jit(train_step)(mlp_params(), mlp_batch())
    assert int(hits) == int(want)


def test_a_second_forward_pass_after_the_gradient_points_to_has_aux():
    def train_step(params, batch):
        loss, grads = jr.value_and_grad(lambda p: jnp.mean(forward(p, batch["x"]) ** 2))(params)
        new = jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)
        accuracy = jnp.mean(jnp.argmax(forward(new, batch["x"]), -1) == batch["y"])
        return new, loss, accuracy

    with pytest.raises(jr.PipelineSplitError, match="has_aux=True"):
        jr.parallelize(train_step, config=config(), batch_argnums=(1,))(mlp_params(), mlp_batch())


def test_eval_runs_forward_only_on_the_state_training_left():
    tx = optax.adam(1e-2)

    def train_step(params, opt_state, batch):
        def loss_fn(p):
            logits = forward(p, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = jr.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def eval_step(params, batch):
        logits = forward(params, batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"]),
                "logits": logits}  # fmt: skip

    params = mlp_params()
    train = jr.parallelize(train_step, config=config(), batch_argnums=(2,))
    params, _opt_state, _ = train(params, tx.init(params), mlp_batch())
    evaluate = jr.parallelize(eval_step, config=config(), batch_argnums=(1,))
    got = evaluate(params, mlp_batch(1))
    want = jax.jit(eval_step)(jr.collect(params), mlp_batch(1))
    assert_same(got, want)
    plan = evaluate.plan(params, mlp_batch(1))
    assert plan.graph.forward_only
    for k, i in enumerate(plan.graph.params):  # nothing moved: each parameter is where it was
        leaf = jax.tree.leaves(params)[i]
        sharding = plan.pipeline.sharding(plan.graph.owner[k], plan.layout.param_specs[k])
        assert leaf.sharding == sharding


def test_collect_brings_state_to_the_host_or_one_device():
    params = mlp_params()

    def train_step(params, batch):
        loss, grads = jr.value_and_grad(lambda p: jnp.mean(forward(p, batch["x"]) ** 2))(params)
        return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), loss

    new, _ = jr.parallelize(train_step, config=config(), batch_argnums=(1,))(params, mlp_batch())
    assert len({frozenset(x.devices()) for x in jax.tree.leaves(new)}) == 2  # two stage meshes
    host = jr.collect(new)
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(host))
    device = jax.devices()[5]
    one = jr.collect(new, device)
    assert all(x.devices() == {device} for x in jax.tree.leaves(one))
    want, _ = jax.jit(train_step)(params, mlp_batch())
    assert_same(host, want)
    assert_same(one, want)


# -- random draws ----------------------------------------------------------------------------------


DRAW_CASES = {
    "typed_key": lambda: jax.random.key(3),
    "raw_key": lambda: jax.random.PRNGKey(3),
}


@pytest.mark.parametrize("key_kind", sorted(DRAW_CASES))
@pytest.mark.parametrize("partitionable", [True, False])
def test_random_draws_match_jax_jit(key_kind, partitionable, monkeypatch):
    jax.config.update("jax_threefry_partitionable", partitionable)
    try:
        _draws_match(DRAW_CASES[key_kind]())
    finally:
        jax.config.update("jax_threefry_partitionable", True)


def _draws_match(key):
    def train_step(params, batch, key):
        def loss_fn(p):
            k1, k2 = jax.random.split(jax.random.fold_in(key, 1))
            h = jnp.tanh(batch["x"] @ p["a"])
            h = h * jax.random.bernoulli(k1, 0.7, h.shape)  # dropout-like, batch dim 0
            h, k2 = jr.stage_boundary((h, k2))  # a key through a boundary
            noise = jax.checkpoint(lambda z: z + 0.1 * jax.random.normal(k2, z.shape))(h)
            scan_keys = jax.random.split(k2, 2)

            def body(c, k):
                return c + 0.05 * jax.random.uniform(k, c.shape), None

            h, _ = jax.lax.scan(body, noise, scan_keys)
            per_example = jax.vmap(lambda k: jax.random.normal(k, (5,)))(
                jax.random.split(k1, batch["x"].shape[0])
            )
            time_major = jax.random.normal(k2, (3, batch["x"].shape[0]))
            out = h @ p["b"] + per_example + time_major.sum(0)[:, None]
            shared = jax.random.normal(k2, (5,))  # no batch dim: the same in every micro-batch
            return jnp.mean((out + shared) ** 2)

        return jr.value_and_grad(loss_fn)(params)

    want = jax.jit(train_step)(mlp_params(), mlp_batch(), key)
    got = jr.parallelize(train_step, config=config(), batch_argnums=(1,))(
        mlp_params(), mlp_batch(), key
    )
    assert_same(got, want)


def test_a_draw_whose_batch_dim_cannot_be_found_raises():
    def train_step(params, batch, key):
        def loss_fn(p):
            n = batch["x"].shape[0]
            h = jr.stage_boundary(jnp.tanh(batch["x"] @ p["a"]))
            pairs = jax.random.normal(key, (n, n))  # grows in two dims
            return jnp.mean(h @ p["b"]) + jnp.mean(pairs)

        return jr.value_and_grad(loss_fn)(params)

    with pytest.raises(jr.PipelineSplitError, match=r"random_bits.*no single dim is 4"):
        jr.parallelize(train_step, config=config(), batch_argnums=(1,))(
            mlp_params(), mlp_batch(), jax.random.key(0)
        )


def test_batch_statistics_inside_the_loss_warn():
    def batch_norm(params, batch):
        def loss_fn(p):
            h = batch["x"] @ p["a"]
            h = (h - h.mean(0)) / (h.std(0) + 1e-5)  # statistics over the micro-batch
            h = jr.stage_boundary(jnp.tanh(h))
            return jnp.mean((h @ p["b"]) ** 2)

        return jr.value_and_grad(loss_fn)(params)

    with pytest.warns(jr.MicroBatchWarning, match="BatchNorm"):
        jr.parallelize(batch_norm, config=config(), batch_argnums=(1,))(mlp_params(), mlp_batch())


@pytest.mark.parametrize("mixes", [False, True], ids=["attention", "in-batch negatives"])
def test_one_row_micro_batches_warn_only_about_values_that_mix_examples(mixes):
    """With one row per micro-batch JAX squeezes the size-1 batch dim of a batched matmul
    (attention's scores) in one trace and not the other: not a value mixing examples. A
    (B, B) similarity matrix still is."""
    import warnings

    from jaxreshard.models import gpt

    cfg = gpt.GPTConfig(vocab=64, seq=8, hidden=16, layers=2, heads=2)

    def train_step(params, tokens):
        def loss_fn(p):
            if mixes:
                h = jnp.take(p["wte"], tokens[:, 0], axis=0)
                return jnp.mean(jax.nn.log_softmax(h @ h.T))
            return gpt.loss(p, tokens, cfg, num_stages=2)

        return jr.value_and_grad(loss_fn)(params)

    params, toks = gpt.init_params(cfg, 0), gpt.synthetic_batch(cfg, 4, 0, 0)["tokens"]
    cfg4 = config(num_micro_batches=4, num_stages=2 if not mixes else 1)
    step = jr.parallelize(train_step, config=cfg4, batch_argnums=(1,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, _ = step(params, toks)
    found = [w for w in caught if issubclass(w.category, jr.MicroBatchWarning)]
    assert bool(found) == mixes, [str(w.message) for w in found]
    if mixes:
        assert "across examples" in str(found[0].message)
    else:
        np.testing.assert_allclose(float(loss), float(jax.jit(train_step)(params, toks)[0]),
                                   rtol=1e-5)  # fmt: skip


def test_static_leaves_changing_every_call_warn():
    def train_step(params, batch, scale):
        def loss_fn(p):
            return jnp.mean(forward(p, batch["x"]) ** 2) * scale

        return jr.value_and_grad(loss_fn)(params)

    step = jr.parallelize(train_step, config=config(num_micro_batches=2), batch_argnums=(1,))
    with pytest.warns(UserWarning, match=r"static \(non-array\) leaves \['args\[2\]'\]") as caught:
        for scale in (1.0, 2.0, 3.0, 4.0):
            step(mlp_params(), mlp_batch(), scale)
    static = [w for w in caught if "static (non-array)" in str(w.message)]
    assert [w.filename for w in static] == [__file__]  # the user's call, not jaxreshard's


def eqx_mlp_step(tx, value_and_grad):
    def loss_fn(model, batch):
        return jnp.mean((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2)

    def step(model, opt_state, batch):
        loss, grads = value_and_grad(loss_fn)(model, batch)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    return step


def eqx_batches():
    rng = np.random.default_rng(4)
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
    return [{"x": normal(ROWS, 6), "y": normal(ROWS, 3)} for _ in range(2)]


@pytest.mark.ray
def test_an_equinox_model_trains_on_the_ray_runtime_as_under_filter_jit(ray_runtime):
    """An Equinox model's `PyTreeDef` does not survive pickling into a host (it holds Equinox's
    MISSING sentinel: every Equinox model failed on Ray); its arguments travel as a skeleton
    each host flattens itself (see [Note: argument structure on the hosts])."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    model = eqx.nn.Sequential([
        eqx.nn.Linear(6, 16, key=k1), eqx.nn.Lambda(jnp.tanh),
        eqx.nn.Lambda(jr.stage_boundary),
        eqx.nn.Linear(16, 16, key=k2), eqx.nn.Lambda(jnp.tanh),
        eqx.nn.Lambda(jr.stage_boundary),
        eqx.nn.Linear(16, 3, key=k3),
    ])  # fmt: skip
    tx = optax.adam(1e-2)
    state = (model, tx.init(eqx.filter(model, eqx.is_inexact_array)))
    want = run(eqx.filter_jit(eqx_mlp_step(tx, eqx.filter_value_and_grad)), state, eqx_batches())
    step = jr.parallelize(
        eqx_mlp_step(tx, jr.filter_value_and_grad), config=config(backend="ray"), batch_argnums=2
    )
    got = run(step, state, eqx_batches())
    held = lambda x: eqx.is_array(x) or isinstance(x, jr.RemoteArray)  # (Ray: on the hosts)
    assert_same(eqx.filter(got, held), eqx.filter(want, held))


class EqxTanhBlock(eqx.Module):
    """Defined in the step's module, so it travels to the hosts by value."""

    linear: eqx.nn.Linear

    def __call__(self, x, *, key=None):
        return jr.stage_boundary(jnp.tanh(self.linear(x)))


@pytest.mark.ray
def test_an_equinox_class_that_travels_by_value_is_named_with_the_fix(ray_runtime):
    """cloudpickle rebuilds an Equinox Module class without its fields (equinox issue #231):
    the host says so, and where to define the class, instead of tracing a model with none."""
    k1, k2 = jax.random.split(jax.random.key(1))
    model = eqx.nn.Sequential([EqxTanhBlock(eqx.nn.Linear(6, 16, key=k1)),
                               eqx.nn.Linear(16, 3, key=k2)])  # fmt: skip
    tx = optax.sgd(1e-2)
    step = jr.parallelize(
        eqx_mlp_step(tx, jr.filter_value_and_grad), config=config(backend="ray"), batch_argnums=2
    )
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    message = (
        r"host \d+: the step's arguments came to this host as \d+ leaves, not the driver's \d+ "
        r".*an Equinox Module loses its fields.*Define the model's classes in a module every "
        "host can import"
    )
    with pytest.raises(ValueError, match=message):
        step(model, opt_state, eqx_batches()[0])


@pytest.mark.ray
def test_restoring_an_equinox_class_that_travels_by_value_on_ray_is_named_with_the_fix(
    ray_runtime, tmp_path
):
    """A restore target's classes travel to the hosts by reference (this test module cannot be
    imported there: the error names it and the fix); one that travels by value and flattens
    differently there (an Equinox Module class) is refused, not read into misplaced leaves."""
    from ray import cloudpickle

    from jaxreshard.runtime.ray._remote import RemoteStruct

    model = EqxTanhBlock(eqx.nn.Linear(6, 16, key=jax.random.key(2)))
    jr.save_checkpoint(tmp_path / "ckpt", model)
    sharding = ray_runtime.sharding(ray_runtime.mesh((1,), ("data",)), jax.P())
    target = jax.tree.map(lambda x: RemoteStruct(x.shape, x.dtype, sharding), model)
    with pytest.raises(Exception, match=rf"names '{re.escape(__name__)}', which this host cannot"):
        jr.restore_checkpoint(tmp_path / "ckpt", target)
    message = (
        r"the restore target's tree .* came to this host as 0 leaves, not the driver's 2 in its "
        r"order: .*an Equinox Module loses its fields.*Define the model's classes in a module"
    )
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # (as a script's classes go)
    try:
        with pytest.raises(Exception, match=message):
            jr.restore_checkpoint(tmp_path / "ckpt", target)
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@jax.checkpoint
def remat_block(h, w):
    """A scanned layer wrapped by `jax.checkpoint` at module level: a closure of JAX's whose
    globals hold JAX's module-level caches, which do not pickle."""
    return jnp.tanh(h @ w), None


def scanned_loss(params, batch):
    h, _ = jax.lax.scan(remat_block, batch["x"], params["first"])
    h = jr.stage_boundary(h)
    h, _ = jax.lax.scan(remat_block, h, params["second"])
    return jnp.mean((h - batch["y"]) ** 2)


@pytest.mark.ray
def test_a_step_calling_a_module_level_checkpointed_function_runs_on_ray(ray_runtime):
    """This module travels to the hosts by value, and with it `remat_block`: cloudpickle failed
    on JAX's caches it references ("cannot pickle 'WeakrefLRUCache'"); they now travel by
    reference (see [Note: JAX's caches travel by reference] in `jaxreshard/_tree_wire.py`)."""
    import optax

    rng = np.random.default_rng(3)
    params = {k: (rng.normal(size=(3, 8, 8)) / 3).astype(np.float32) for k in ("first", "second")}
    batches = [
        {"x": rng.normal(size=(ROWS, 8)).astype(np.float32),
         "y": rng.normal(size=(ROWS, 8)).astype(np.float32)}
        for _ in range(2)
    ]  # fmt: skip
    tx = optax.adam(1e-2)

    def step(value_and_grad):
        def one(params, opt_state, batch):
            loss, grads = value_and_grad(scanned_loss)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return one

    state = (params, tx.init(params))
    want = run(jax.jit(step(jax.value_and_grad)), state, batches)
    got = run(
        jr.parallelize(step(jr.value_and_grad), config=config(backend="ray"), batch_argnums=2),
        state,
        batches,
    )
    fetched = jax.tree.map(
        lambda x: x.fetch() if isinstance(x, jr.RemoteArray) else x,
        got,
        is_leaf=lambda x: isinstance(x, jr.RemoteArray),
    )
    assert_same(fetched, want)


@pytest.mark.ray
def test_nnx_dropout_training_and_eval_on_the_ray_runtime(ray_runtime):
    model = NNXLM(rngs=nnx.Rngs(0, dropout=1))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adamw(1e-2)
    step = nnx_step(graphdef, tx)
    state = (params, rest, tx.init(params))
    batches = three_batches()[:2]
    want = run(jax.jit(step), state, batches)
    ray_config = config(backend="ray")
    got = run(jr.parallelize(step, config=ray_config, batch_argnums=(3,)), state, batches)
    assert_same(got, want)

    def eval_step(params, rest, batch):
        model = nnx.merge(graphdef, params, rest, copy=True)
        model.eval()
        logits = model(batch["tokens"][:, :-1])
        labels = batch["tokens"][:, 1:]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), logits

    (new_params, new_rest, _), _ = got
    evaluate = jr.parallelize(eval_step, config=ray_config, batch_argnums=(2,))
    (p_want, r_want, _), _ = want
    assert_same(
        evaluate(new_params, new_rest, batches[0]), jax.jit(eval_step)(p_want, r_want, batches[0])
    )


# -- what users' steps also do -------------------------------------------------------------------


def test_optax_multisteps_schedules_and_clipping_match_jax_jit():
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
    tx = optax.MultiSteps(
        optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(schedule)), every_k_schedule=2
    )

    def train_step(params, opt_state, batch):
        def loss_fn(p):
            logits = forward(p, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = jr.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def steps(step):
        state, losses = (mlp_params(), tx.init(mlp_params())), []
        for seed in range(4):
            *state, loss = step(*state, mlp_batch(seed))
            losses.append(loss)
        return state, losses

    want = steps(jax.jit(train_step))
    assert_same(steps(jr.parallelize(train_step, config=config(), batch_argnums=(2,))), want)


def test_namedtuple_none_leaves_bf16_and_a_new_batch_size():
    from typing import NamedTuple

    class Weights(NamedTuple):
        a: jax.Array
        b: jax.Array
        bias: jax.Array | None

    def train_step(w, batch):
        def loss_fn(w):
            h = jnp.tanh(batch["x"].astype(jnp.bfloat16) @ w.a)
            h = jr.stage_boundary(h)
            out = (h @ w.b).astype(jnp.float32)
            return jnp.mean(out**2) + (0.0 if w.bias is None else jnp.sum(w.bias))

        loss, grads = jr.value_and_grad(loss_fn)(w)
        return jax.tree.map(lambda p, g: p - 0.1 * g, w, grads), loss

    p = mlp_params()
    w = Weights(p["a"].astype(jnp.bfloat16), p["b"].astype(jnp.bfloat16), None)
    step = jr.parallelize(train_step, config=config(), batch_argnums=(1,))
    for rows in (8, 16):  # a new batch size compiles again
        got = step(w, mlp_batch(rows=rows))
        want = jax.jit(train_step)(w, mlp_batch(rows=rows))
        assert got[0].bias is None and got[0].a.dtype == jnp.bfloat16
        assert_same(got, want, rtol=2e-2, atol=2e-3)  # bf16: micro-batch sums round apart
    assert len(step._cache) == 2
