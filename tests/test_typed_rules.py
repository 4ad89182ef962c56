"""The rules the typed (Explicit-mesh) trace of a stage that sums its gradients once takes for
ops JAX refuses there (see [Note: refusals an Explicit mesh adds]): each gives the values and
gradients JAX gives on a mesh it does not refuse, and leaves a `reduced` table's gradient
`unreduced`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxreshard.frontend._typed_contract import (
    dot_contracting_split,
    dot_split_on_one_side,
    gather_by_split_indices,
)
from jaxreshard.frontend._typed_eval import typed_eval


def _explicit_mesh():
    return jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


def _only(fn, *args):
    (eqn,) = [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name != "pjit"]
    return eqn


def _gather_eqn(fn, table, idx):
    """The `gather` of `fn`, as a stage's jaxpr (traced with no mesh) holds it."""
    closed = jax.make_jaxpr(fn)(table, idx)
    (body,) = [e.params["jaxpr"] for e in closed.jaxpr.eqns]
    (eqn,) = [e for e in body.jaxpr.eqns if e.primitive.name == "gather"]
    return eqn


def _check_gather(fn, table, idx, tspec, ispec, reduced=False):
    """Values and the table's gradient of `fn` traced typed on the 2 x 2 Explicit mesh (where
    JAX refuses its gather and the rule takes it), against `fn` and its gradient with no
    mesh."""
    typed = typed_eval(jax.make_jaxpr(fn)(table, idx))
    cot = np.random.default_rng(1).normal(size=np.shape(fn(table, idx))).astype(np.float32)
    want = np.asarray(fn(table, idx))
    want_grad = np.asarray(jax.grad(lambda t: jnp.sum(jnp.nan_to_num(fn(t, idx)) * cot))(table))
    mesh = _explicit_mesh()
    with jax.set_mesh(mesh):
        specs = {}

        def through_rule(t, i):
            (y,) = typed(t, i)
            return y

        def loss(t, i, c):
            return jnp.sum(jnp.nan_to_num(through_rule(t, i)) * c)

        def grad(t, i, c):
            if reduced:  # (cast before differentiating, as a stage's parameters are)
                t = jax.reshard(t, tspec.update(reduced={"data"}))
            g = jax.grad(loss)(t, i, c)
            specs["grad"] = jax.typeof(g).sharding.spec
            return jax.reshard(g, tspec) if reduced else g

        t = jax.device_put(table, NamedSharding(mesh, tspec))
        i = jax.device_put(idx, NamedSharding(mesh, ispec))
        with pytest.raises(Exception, match=r"out_sharding|dangerous"):
            jax.jit(fn).lower(t, i)  # (JAX's own refusal)
        got = jax.jit(through_rule)(t, i)
        c = jax.device_put(cot, NamedSharding(mesh, jax.typeof(got).sharding.spec))
        got_grad = jax.jit(grad)(t, i, c)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got_grad), want_grad, rtol=1e-5, atol=1e-6)
    return specs


TABLE = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)
IDX = np.array([[0, 3, 15, 8, 7], [1, 9, 2, 14, 6], [5, 5, 12, 0, 11], [13, 4, 10, 3, 8]])


@pytest.mark.parametrize("tspec", [P(), P("model", None), P(None, "model")], ids=str)
@pytest.mark.parametrize("mode", ["fill", "clip", "wrap"])
def test_an_embedding_lookup_by_split_tokens_equals_jax(cpu_devices, tspec, mode):
    """Rows split over `data`; the table whole, vocabulary-parallel (each `model` device holds
    a block of rows: masked lookups summed), or split by features."""
    idx = IDX.astype(np.int32)
    if mode != "wrap":  # (out of bounds: NaN for `fill`, the edge row for `clip`)
        idx = idx.copy()
        idx[0, 1], idx[2, 3] = 16, -3
    fn = lambda t, i: jnp.take(t, i, axis=0, mode=mode)
    _check_gather(fn, TABLE, idx, tspec, P("data", None))


@pytest.mark.parametrize("tspec", [P(), P("model", None)], ids=str)
def test_a_reduced_table_gets_an_unreduced_gradient(cpu_devices, tspec):
    """A parameter typed `reduced` over `data`: the lookup's gradient is each device's term,
    `unreduced` over `data` (no all-reduce); summed it is JAX's."""
    fn = lambda t, i: jnp.take(t, i, axis=0)
    specs = _check_gather(fn, TABLE, IDX.astype(np.int32), tspec, P("data", None), reduced=True)
    assert specs["grad"].unreduced == frozenset({"data"}), specs


def test_a_label_lookup_in_vocabulary_parallel_logits_equals_jax(cpu_devices):
    """`take_along_axis` over split logits (batching dims split like the labels, the
    vocabulary over `model`): cross-entropy's gather."""
    logits = np.random.default_rng(2).normal(size=(4, 6, 16)).astype(np.float32)
    labels = np.random.default_rng(3).integers(0, 16, size=(4, 6, 1)).astype(np.int32)
    fn = lambda t, i: jnp.take_along_axis(t, i, axis=-1)
    _check_gather(fn, logits, labels, P("data", None, "model"), P("data", None, None))


def test_the_gather_rule_refuses_rows_whole_over_a_reduced_axis(cpu_devices):
    eqn = _gather_eqn(lambda t, i: jnp.take(t, i, axis=0), TABLE, IDX.astype(np.int32))
    taken = []

    def typed(t, i):
        i = i[..., None]
        t = jax.reshard(t, P(None, None, reduced={"data"}))
        taken.append(gather_by_split_indices(eqn, [t, i], jax.sharding.get_abstract_mesh()))
        return i

    mesh = _explicit_mesh()
    with jax.set_mesh(mesh):
        for spec in (P(), P("model", None), P("data", None)):
            i = jax.device_put(IDX.astype(np.int32), NamedSharding(mesh, spec))
            jax.jit(typed).lower(jax.device_put(TABLE, NamedSharding(mesh, P())), i)
    assert taken[0] is None and taken[1] is None and taken[2] is not None, taken


def test_a_row_parallel_matmul_sums_the_contracted_split(cpu_devices):
    """x (rows over `data`, features over `model`) @ w (rows over `model`): JAX asks for an
    out_sharding on an Explicit mesh; the rule gives the sum, split by rows, and the reduced
    weight's gradient unreduced over `data`."""
    x = np.random.default_rng(4).normal(size=(8, 6)).astype(np.float32)
    w = np.random.default_rng(5).normal(size=(6, 4)).astype(np.float32)
    eqn = _only(lambda a, b: a @ b, x, w)
    mesh = _explicit_mesh()
    seen = {}
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
        ws = jax.device_put(w, NamedSharding(mesh, P("model", None)))
        with pytest.raises(Exception, match="Contracting dimensions are sharded"):
            jax.jit(lambda a, b: a @ b).lower(xs, ws)

        def loss(b, a):
            (y,) = dot_contracting_split(eqn, [a, b])
            seen["y"] = jax.typeof(y).sharding.spec
            return jnp.sum(y**2)

        def grad(b, a):
            b = jax.reshard(b, P("model", None, reduced={"data"}))
            g = jax.grad(loss)(b, a)
            seen["grad"] = jax.typeof(g).sharding.spec
            return jax.reshard(g, P("model", None))

        got = jax.jit(grad)(ws, xs)
    want = jax.grad(lambda b: jnp.sum((x @ b) ** 2))(w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)
    assert seen["y"] == P("data", None), seen
    assert seen["grad"].unreduced == frozenset({"data"}), seen


# -- whole stages ---------------------------------------------------------------------------------

ONCE = "once per step, over data"


def test_a_tensor_parallel_gpt_sums_its_gradients_once(cpu_devices):
    """The shipped GPT with Megatron-style weights (vocabulary-parallel embedding and logits,
    column- then row-parallel matmuls) on two 2 x 2 stages: the typed traces take the gather
    and matmul rules, both stages sum over `data` once (the tied embedding keeps its
    per-micro-batch sum), and the step equals jax.jit."""
    import optax

    import jaxreshard as jr
    from jaxreshard.models import gpt

    cfg = gpt.GPTConfig(vocab=64, seq=16, hidden=32, layers=2, heads=2)
    sgd = optax.sgd(0.1)
    mesh = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])
    params, opt_state = gpt.init_state(cfg, optimizer=sgd)
    placed = jax.tree.map(
        lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)),
        params,
        gpt.param_specs(cfg),
    )
    config = jr.PipelineConfig(
        backend="local",
        num_stages=2,
        num_micro_batches=4,
        stage_mesh_shape=(2, 2),
        mesh_axis_names=("data", "model"),
    )
    step = jr.parallelize(gpt.train_step(cfg, 2, sgd), config=config, batch_argnums=(2,))
    batch = gpt.synthetic_batch(cfg, 16, 0)
    reductions = step.pipeline(placed, opt_state, batch).layout.reductions
    shared = f"{ONCE} (the 1 shared with other stages: every micro-batch)"
    assert reductions == {0: shared, 1: shared}, reductions
    got, _, got_loss = step(placed, opt_state, batch)
    want, _, want_loss = jax.jit(gpt.train_step(cfg, 2, sgd))(params, opt_state, batch)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=2e-5)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)


def test_a_flax_nnx_lm_with_dropout_sums_its_gradients_once(cpu_devices):
    """Flax NNX: the embedding's lookup by data-split tokens (the gather rule), dropout's
    random draws and `where` (traced with no mesh: their reshards pass through, the mask is
    laid out as the activations). Both stages sum once, and three AdamW steps equal jax.jit."""
    nnx = pytest.importorskip("flax.nnx")
    import optax
    from test_libraries import NNXLM, assert_same, config, nnx_step, run, three_batches

    import jaxreshard as jr

    model = NNXLM(rngs=nnx.Rngs(0, dropout=1))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adamw(1e-2)
    train = nnx_step(graphdef, tx)
    state = (params, rest, tx.init(params))
    step = jr.parallelize(train, config=config(stage_mesh_shape=(2, 1)), batch_argnums=(3,))
    reductions = step.pipeline(*state, three_batches()[0]).layout.reductions
    shared = f"{ONCE} (the 1 shared with other stages: every micro-batch)"
    assert reductions == {0: shared, 1: shared}, reductions
    assert_same(run(step, state, three_batches()), run(jax.jit(train), state, three_batches()))


def test_a_matmul_split_on_one_side_slices_the_other_instead_of_gathering_a_weight(cpu_devices):
    """x whole over `model` @ w split by rows over `model`: JAX on an Explicit mesh may gather
    w (it did in GPT's typed stage: a weight all-gather every micro-batch); the rule slices x
    (no transfer) and sums the products, as the Auto program does. Values and the gradients of
    both equal JAX's."""
    import re

    x = np.random.default_rng(6).normal(size=(8, 6)).astype(np.float32)
    w = np.random.default_rng(7).normal(size=(6, 4)).astype(np.float32)
    eqn = _only(lambda a, b: a @ b, x, w)
    mesh = _explicit_mesh()
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
        ws = jax.device_put(w, NamedSharding(mesh, P("model", None)))
        gathers = lambda fn: len(
            re.findall(r" all-gather(-start)?\(", fn.lower(xs, ws).compile().as_text())
        )

        def loss(a, b):
            (y,) = dot_split_on_one_side(eqn, [a, b])
            return jnp.sum(jnp.sin(y))

        rule = jax.jit(lambda a, b: dot_split_on_one_side(eqn, [a, b])[0])
        assert gathers(rule) == 0
        got = rule(xs, ws)
        got_grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(xs, ws)
    np.testing.assert_allclose(np.asarray(got), x @ w, rtol=1e-5, atol=1e-6)
    want = jax.grad(lambda a, b: jnp.sum(jnp.sin(a @ b)), argnums=(0, 1))(x, w)
    for g, r in zip(got_grads, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)


def test_splits_over_several_axes_keep_their_order(cpu_devices):
    """A contracted dim split over ('model', 'data') on one side only: the other side is sliced
    in that order, not alphabetically (else the devices multiply different blocks); a gather
    whose batching dims are split in different orders is left to JAX."""
    x = np.random.default_rng(8).normal(size=(2, 64)).astype(np.float32)
    w = np.random.default_rng(9).normal(size=(64, 3)).astype(np.float32)
    eqn = _only(lambda a, b: a @ b, x, w)
    logits = np.random.default_rng(10).normal(size=(4, 6, 16)).astype(np.float32)
    labels = np.random.default_rng(11).integers(0, 16, size=(4, 6, 1)).astype(np.int32)
    take = _gather_eqn(lambda t, i: jnp.take_along_axis(t, i, axis=-1), logits, labels)
    mesh = _explicit_mesh()
    taken = []
    with jax.set_mesh(mesh):
        for order in [("data", "model"), ("model", "data")]:
            xs = jax.device_put(x, NamedSharding(mesh, P(None, order)))
            ws = jax.device_put(w, NamedSharding(mesh, P()))
            got = jax.jit(lambda a, b: dot_split_on_one_side(eqn, [a, b])[0])(xs, ws)
            np.testing.assert_allclose(np.asarray(got), x @ w, rtol=1e-5, atol=1e-5)

        def typed(t, i):
            taken.append(
                gather_by_split_indices(take, [t, i[..., None]], jax.sharding.get_abstract_mesh())
            )
            return t

        for order in [("data", "model"), ("model", "data")]:
            t = jax.device_put(logits, NamedSharding(mesh, P(("data", "model"))))
            i = jax.device_put(labels, NamedSharding(mesh, P(order)))
            jax.jit(typed).lower(t, i)
    assert taken[0] is not None and taken[1] is None, taken


def test_an_index_out_of_bounds_is_clamped_as_jax_does(cpu_devices):
    """`t[i]` promises in-bounds indices; XLA clamps one that is not, and so does the rule for
    a vocabulary-split table (masking it everywhere would give a row of zeros)."""
    idx = IDX.astype(np.int32).copy()
    idx[1, 2] = 40
    _check_gather(lambda t, i: jnp.asarray(t)[i], TABLE, idx, P("model", None), P("data", None))


@jax.custom_jvp
def _tanh_clipped_gradient(z):
    return jnp.tanh(z)


@_tanh_clipped_gradient.defjvp
def _(primals, tangents):  # not tanh's derivative: only the rule gives these gradients
    (z,), (dz,) = primals, tangents
    y = _tanh_clipped_gradient(z)
    return y, jnp.where(jnp.abs(z) < 0.5, 1.0 - y**2, 0.0) * dz


@pytest.mark.parametrize(
    "act",
    [
        jax.nn.relu,  # the rule's gradient at 0 is 0; `max`'s own would be 0.5
        jax.nn.softplus,  # `logaddexp`: a literal operand, and a `where` in the rule
        jax.nn.relu6,  # a rule that calls the function again
        lambda z: _tanh_clipped_gradient(z),
    ],
    ids=["relu", "softplus", "relu6", "own_rule"],
)
def test_a_custom_jvp_keeps_its_rule_in_the_typed_trace(cpu_devices, act):
    """A `custom_jvp_call` traced on the step's own (Auto) mesh: the typed trace binds it again
    with its body and its JVP rule evaluated there, and the gradients are the rule's (JAX
    refused the call as it was; evaluating the body alone changes relu's gradient at 0)."""
    auto = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    explicit = jax.make_mesh(
        (2,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2]
    )

    c = np.random.default_rng(2).normal(size=(8, 4)).astype(np.float32)

    def f(x, w):  # (linear in act: its gradient at 0 is the rule's, whatever it is)
        return jnp.sum(act(x @ w) * c)

    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    w = np.random.default_rng(1).normal(size=(4, 4)).astype(np.float32)
    w[:, 0] = 0.0  # relu's input is exactly 0 in a column
    typed = [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(auto, P("data"))),
        jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(auto, P())),
    ]
    with jax.set_mesh(auto):
        closed = jax.make_jaxpr(f)(*typed)
    assert "custom_jvp_call" in str(closed)
    with jax.set_mesh(explicit):
        grad = jax.jit(jax.grad(lambda x, w: typed_eval(closed)(x, w)[0], argnums=(0, 1)))
        got = grad(
            jax.device_put(x, NamedSharding(explicit, P("data"))),
            jax.device_put(w, NamedSharding(explicit, P())),
        )
    want = jax.grad(f, argnums=(0, 1))(x, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-5)


def test_an_equinox_mlp_with_relu_and_dropout_sums_its_gradients_once(cpu_devices):
    """The Equinox example's classifier (relu, a `custom_jvp`; dropout) on data-split meshes:
    both stages sum once (they fell back while the typed trace could not bind relu), and three
    Adam steps equal eqx.filter_jit."""
    eqx = pytest.importorskip("equinox")
    import optax

    import jaxreshard as jr

    class Classifier(eqx.Module):
        first: eqx.nn.Linear
        head: eqx.nn.Linear
        dropout: eqx.nn.Dropout

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.first = eqx.nn.Linear(8, 16, key=k1)
            self.head = eqx.nn.Linear(16, 4, key=k2)
            self.dropout = eqx.nn.Dropout(0.2)

        def __call__(self, x, key):
            h = self.dropout(jax.nn.relu(self.first(x)), key=key)
            h = jr.stage_boundary(h)
            return self.head(jax.nn.relu(h))

    def loss_fn(model, x, y, key):
        logits = jax.vmap(model)(x, jax.random.split(key, x.shape[0]))
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    tx = optax.adam(1e-2)

    def make_step(value_and_grad):
        def train_step(model, opt_state, x, y, key):
            loss, grads = value_and_grad(loss_fn)(model, x, y, key)
            updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), opt_state, loss

        return train_step

    model = Classifier(jax.random.key(0))
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    rng = np.random.default_rng(0)
    batches = [
        (rng.normal(size=(16, 8)).astype(np.float32), rng.integers(0, 4, 16).astype(np.int32))
        for _ in range(3)
    ]

    def steps(step):
        state, losses = (model, opt_state), []
        for i, (x, y) in enumerate(batches):
            *state, loss = step(*state, x, y, jax.random.key(i))
            losses.append(loss)
        return eqx.filter((state, losses), eqx.is_array)

    config = jr.PipelineConfig(
        backend="local",
        num_micro_batches=4,
        stage_mesh_shape=(2,),
        mesh_axis_names=("data",),
    )
    step = jr.parallelize(make_step(jr.filter_value_and_grad), config=config, batch_argnums=(2, 3))
    x, y = batches[0]
    reductions = step.pipeline(model, opt_state, x, y, jax.random.key(0)).layout.reductions
    assert reductions == {0: ONCE, 1: ONCE}, reductions
    got, want = steps(step), steps(eqx.filter_jit(make_step(eqx.filter_value_and_grad)))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)


def _layer(h, w, b):
    return jnp.tanh(h @ w + b)


def _second_stage(kind, h, p):
    if kind == "remat":  # gradient checkpointing
        return jax.checkpoint(_layer)(h, p["w1"], p["b1"])
    if kind == "scan":  # a scan over a stack of layers
        return jax.lax.scan(lambda c, wb: (_layer(c, *wb), None), h, (p["ws"], p["bs"]))[0]
    if kind == "cond":
        return jax.lax.cond(h.shape[0] > 0, lambda h: _layer(h, p["w1"], p["b1"]), jnp.sin, h)
    if kind == "exp":  # an op of a parameter with JAX's own reduced rule
        return _layer(h, p["w1"], p["b1"]) * jnp.exp(p["b1"])
    if kind == "cubed":  # one without (integer_pow): ours
        return _layer(h, p["w1"] ** 3, p["b1"])
    if kind == "regularised":  # (a parameter's own term is added to the loss)
        return _layer(h, p["w1"], p["b1"])
    assert kind == "scaled"  # a weight times a constant
    return _layer(h, p["w1"] * 0.5, p["b1"])


@pytest.mark.parametrize("kind", ["remat", "scan", "cond", "scaled", "exp", "cubed", "regularised"])
def test_control_flow_and_constants_beside_reduced_weights_sum_once(cpu_devices, kind):
    """Bodies of `jax.checkpoint`, `lax.scan` and `lax.cond` were typed on the step's own mesh
    (JAX refused them as they were); the typed trace binds each again with its body evaluated
    by its own rules. A constant beside a reduced weight is cast reduced; a cube of a parameter
    (`integer_pow`, with no reduced rule in JAX) takes ours. The second stage sums once, and
    three steps equal jax.jit. A parameter's own term added to the loss (a value of reduced
    parameters alone, leaving the stage) keeps the per-micro-batch sum, and says why: summed
    once, its gradient came out N times over."""
    from test_parallelize import assert_same, make_batch, make_params, run_steps

    import jaxreshard as jr

    def make_step():
        def step(params, batch):
            def loss_fn(p):
                h = jnp.tanh(batch["x"] @ p["emb"])
                h = _second_stage(kind, jr.stage_boundary(h), p)
                loss = jnp.mean((h @ p["out"] - batch["y"]) ** 2)
                return loss + 1e-3 * jnp.sum(p["w1"] ** 2) if kind == "regularised" else loss

            loss, grads = jr.value_and_grad(loss_fn)(params)
            return jax.tree.map(lambda w, g: w - 0.05 * g, params, grads), loss

        return step

    def params():
        p = make_params(2)
        p["ws"] = np.stack([p["w1"], 0.5 * p["w1"]])
        p["bs"] = np.stack([p["b1"], -p["b1"]])
        return p

    config = jr.PipelineConfig(
        backend="local",
        num_stages=2,
        num_micro_batches=4,
        stage_mesh_shape=(2,),
        mesh_axis_names=("data",),
    )
    step = jr.parallelize(make_step(), config=config, batch_argnums=(1,))
    reductions = step.pipeline(params(), make_batch(16)).layout.reductions
    if kind == "regularised":
        assert reductions[0] == ONCE and "counted once per device" in reductions[1], reductions
    else:
        assert reductions == {0: ONCE, 1: ONCE}, reductions
    out = run_steps(step, params(), make_batch(16), 3)
    assert_same(*out, *run_steps(jax.jit(make_step()), params(), make_batch(16), 3), tol=2e-5)


def _flax_megatron_spec(path, layer_norm=None):
    """Megatron-style layout of a Flax (NNX or Linen) transformer's parameters by their names:
    attention kernels split by heads, the output projection by its input heads, the MLP column-
    then row-parallel; `layer_norm`: the spec of a `ln` layer's scale and bias (default: whole)."""
    names = [str(k.key) for k in path if hasattr(k, "key")]
    layer, kind = names[-2], names[-1]
    if layer in ("query", "key", "value"):
        return P(None, "model", None) if kind == "kernel" else P("model", None)
    if layer == "out" and kind == "kernel":
        return P("model", None, None)
    if layer == "up":
        return P(None, "model") if kind == "kernel" else P("model")
    if layer == "down" and kind == "kernel":
        return P("model", None)
    if layer == "ln":
        return P() if layer_norm is None else layer_norm
    return P()


def _check_sums_once_on_two_tensor_parallel_stages(params, spec, logits):
    """`params` laid out by `spec(path)` on a 2 x 2 (data, model) mesh, trained by SGD on the
    next token of `logits(params, tokens)` over two 2 x 2 stages: both stages sum their
    gradients once, and three steps equal jax.jit's."""
    import optax
    from test_libraries import assert_same, config, run, three_batches

    import jaxreshard as jr

    mesh = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])
    placed = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.device_put(x, NamedSharding(mesh, spec(path))), params
    )
    tx = optax.sgd(0.1)

    def train(params, opt_state, batch):
        def loss_fn(p):
            labels = batch["tokens"][:, 1:]
            return optax.softmax_cross_entropy_with_integer_labels(
                logits(p, batch["tokens"][:, :-1]), labels
            ).mean()

        loss, grads = jr.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jr.parallelize(train, config=config(stage_mesh_shape=(2, 2)), batch_argnums=(2,))
    reductions = step.pipeline(placed, tx.init(placed), three_batches()[0]).layout.reductions
    assert reductions == {0: ONCE, 1: ONCE}, reductions
    got = run(step, (placed, tx.init(placed)), three_batches())
    assert_same(got, run(jax.jit(train), (params, tx.init(params)), three_batches()))


def test_a_flax_nnx_transformer_with_tensor_parallel_kernels_sums_once(cpu_devices):
    """Flax NNX's own layers laid out Megatron-style on two 2 x 2 stages (attention kernels
    split by heads, the output projection by its input heads, the MLP column- then
    row-parallel): its `LayerNorm` multiplies a (rows, 1) statistic by a (1, features) scale
    (both operands broadcast), and `Linear` reshapes its bias to (1, 1, features) to add it.
    JAX refused both beside `reduced` weights ("cannot be sharded/varying on the same axes
    that another input is reduced on"; "Using *pspec is dangerous"), so both stages fell
    back. The scale is split over `model` too: widened beside the statistic, it stays so.
    Both now sum once, and three SGD steps equal jax.jit (not Adam: the attention key bias has
    a gradient of rounding noise only, which Adam makes a step; docs/models.md)."""
    nnx = pytest.importorskip("flax.nnx")
    from test_libraries import VOCAB

    import jaxreshard as jr

    dim, heads = 16, 2

    class Block(nnx.Module):
        def __init__(self, *, rngs):
            self.ln = nnx.LayerNorm(dim, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(
                num_heads=heads, in_features=dim, decode=False, rngs=rngs
            )
            self.up = nnx.Linear(dim, 2 * dim, rngs=rngs)
            self.down = nnx.Linear(2 * dim, dim, rngs=rngs)

        def __call__(self, x):
            x = x + self.attn(self.ln(x))
            return x + self.down(nnx.gelu(self.up(x)))

    class LM(nnx.Module):
        def __init__(self, *, rngs):
            self.embed = nnx.Embed(VOCAB, dim, rngs=rngs)
            self.first, self.second = Block(rngs=rngs), Block(rngs=rngs)
            self.head = nnx.Linear(dim, VOCAB, rngs=rngs)

        def __call__(self, tokens):
            h = self.first(self.embed(tokens))
            return self.head(self.second(jr.stage_boundary(h)))

    graphdef, params = nnx.split(LM(rngs=nnx.Rngs(0)), nnx.Param)
    _check_sums_once_on_two_tensor_parallel_stages(
        params,
        lambda path: _flax_megatron_spec(path, layer_norm=P("model")),
        lambda p, tokens: nnx.merge(graphdef, p)(tokens),
    )


def test_an_equinox_transformer_with_tensor_parallel_weights_sums_once(cpu_devices):
    """Equinox's own layers, vmapped over the rows as Equinox writes models, laid out
    Megatron-style on two 2 x 2 stages. `eqx.nn.Embedding` indexes its table by a scalar; under
    `vmap` that joins the data-split indices to constant zeros (a `concatenate`), which JAX
    refused on an Explicit mesh ("All operands should have the same sharding"), so stage 0
    fell back. Both stages now sum once, and three steps equal jax.jit."""
    eqx = pytest.importorskip("equinox")
    from test_libraries import VOCAB

    import jaxreshard as jr

    dim = 16

    class Block(eqx.Module):
        ln: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k = jax.random.split(key, 3)
            self.ln = eqx.nn.LayerNorm(dim)
            self.attn = eqx.nn.MultiheadAttention(2, dim, key=k[0])
            self.up = eqx.nn.Linear(dim, 2 * dim, key=k[1])
            self.down = eqx.nn.Linear(2 * dim, dim, key=k[2])

        def __call__(self, x):  # (seq, dim)
            h = jax.vmap(self.ln)(x)
            x = x + self.attn(h, h, h)
            return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(x)))

    class LM(eqx.Module):
        embed: eqx.nn.Embedding
        first: Block
        second: Block
        head: eqx.nn.Linear

        def __init__(self, key):
            k = jax.random.split(key, 4)
            self.embed = eqx.nn.Embedding(VOCAB, dim, key=k[0])
            self.first, self.second = Block(k[1]), Block(k[2])
            self.head = eqx.nn.Linear(dim, VOCAB, key=k[3])

        def __call__(self, tokens):  # (rows, seq)
            h = jax.vmap(lambda t: self.first(jax.vmap(self.embed)(t)))(tokens)
            h = jr.stage_boundary(h)
            return jax.vmap(lambda x: jax.vmap(self.head)(self.second(x)))(h)

    params, static = eqx.partition(LM(jax.random.PRNGKey(0)), eqx.is_array)

    def spec(path):
        name = ".".join(str(getattr(k, "name", "")) for k in path)
        if name.endswith(("query_proj.weight", "key_proj.weight", "value_proj.weight")):
            return P("model", None)
        if name.endswith("up.weight"):
            return P("model", None)
        if name.endswith("up.bias"):
            return P("model")
        if name.endswith(("output_proj.weight", "down.weight")):
            return P(None, "model")
        return P()

    _check_sums_once_on_two_tensor_parallel_stages(
        params, spec, lambda p, tokens: eqx.combine(p, static)(tokens)
    )


def test_a_flax_linen_transformer_with_tensor_parallel_kernels_sums_once(cpu_devices):
    """Flax Linen's own layers (`MultiHeadDotProductAttention`, `Dense`, `LayerNorm`) laid out
    Megatron-style on two 2 x 2 stages: both stages sum once, and three steps equal jax.jit."""
    linen = pytest.importorskip("flax.linen")
    from test_libraries import VOCAB, three_batches

    import jaxreshard as jr

    dim = 16

    class Block(linen.Module):
        @linen.compact
        def __call__(self, x):
            h = linen.LayerNorm(name="ln")(x)
            x = x + linen.MultiHeadDotProductAttention(num_heads=2, name="attn")(h)
            up = linen.Dense(2 * dim, name="up")(x)
            return x + linen.Dense(dim, name="down")(linen.gelu(up))

    class LM(linen.Module):
        @linen.compact
        def __call__(self, tokens):
            h = Block(name="first")(linen.Embed(VOCAB, dim, name="embed")(tokens))
            return linen.Dense(VOCAB, name="head")(Block(name="second")(jr.stage_boundary(h)))

    model = LM()
    params = model.init(jax.random.PRNGKey(0), three_batches()[0]["tokens"][:, :-1])["params"]
    _check_sums_once_on_two_tensor_parallel_stages(
        params, _flax_megatron_spec, lambda p, tokens: model.apply({"params": p}, tokens)
    )


@pytest.mark.parametrize(
    "op",
    [
        lambda x: x[:, :, 0],  # slice + squeeze
        lambda x: jnp.broadcast_to(x[:, :, :1], (4, 4, 3, 2)),
        lambda x: jnp.expand_dims(x[:, :, 0], 1),
        lambda x: jnp.cumsum(x[:, :, :1], axis=2),
        lambda x: jnp.tile(x[:, :, :1], (1, 1, 2, 1)),
        lambda x: jnp.take(x[:, :, :1], jnp.array([0, 0]), axis=2),
        lambda x: jax.lax.dynamic_update_slice(x, x[:, :, :1] * 2, (0, 0, 1, 0)),
        lambda x: jax.lax.scan(lambda c, _: (jnp.tanh(c), None), x[:, :, :1], length=2)[0],
        lambda x: jax.lax.cond(jnp.sum(x) > 0, lambda y: y, jnp.tanh, x[:, :, :1]),
    ],
    ids=[
        "squeeze",
        "broadcast",
        "expand_dims",
        "cumsum",
        "tile",
        "take",
        "dynamic_update_slice",
        "scan",
        "cond",
    ],
)
def test_a_size_one_dim_split_over_a_size_one_axis_differentiates(cpu_devices, op):
    """On a (2, 1) mesh a dim that slicing leaves of size 1 stays split over `model` (size 1);
    JAX types the cotangent of a squeeze or broadcast of it without that split and refuses its
    own gradient, refuses a cumsum, tile or take along it, and an update typed otherwise than
    its operand; a scan's carry or a cond's branches must keep one type. The typed trace drops
    size-1 axes from every operand's type first, and the gradient of a `reduced` weight before
    each op equals JAX's with no mesh."""
    mesh = jax.make_mesh((2, 1), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 4, 8)).astype(np.float32)
    w = rng.normal(size=(8, 6)).astype(np.float32)

    def fn(w, x):
        return jnp.sum(op((x @ w).reshape(4, 4, 3, 2)) ** 2)

    want = np.asarray(jax.grad(fn)(w, x))
    typed = typed_eval(jax.make_jaxpr(fn)(w, x))
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        ws = jax.device_put(w, NamedSharding(mesh, P(None, "model")))

        @jax.jit
        def grad(w, x):
            w = jax.reshard(w, P(None, "model", reduced={"data"}))
            g = jax.grad(lambda w: typed(w, x)[0])(w)
            assert jax.typeof(g).sharding.spec.unreduced == {"data"}, jax.typeof(g)
            return jax.reshard(g, P(None, "model"))

        got = np.asarray(grad(ws, xs))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
