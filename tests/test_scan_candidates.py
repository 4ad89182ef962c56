"""`jr.scan`: `lax.scan` over a layer stack whose iterations are stage candidates. Outside a
choice of cuts it is `lax.scan`; a chosen candidate splits it into scans whose results equal the
whole one's, and a pipelined step cut inside the stack equals jax.jit (the stack read by two
stages is their shared parameter: copied each step, its gradients summed)."""

import functools
import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxreshard as jr
from jaxreshard.frontend._markers import candidate_count, candidate_cuts

D, L = 16, 4
OPT = optax.adam(1e-2)


def body(h, wb):
    w, b = wb
    h = jnp.tanh(h @ w + b)
    return h, jnp.sum(h, axis=-1)  # a per-example output of every layer


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(1, 7),
    every=st.integers(1, 3),
    reverse=st.booleans(),
    picks=st.sets(st.integers(0, 6)),
    forcing=st.sets(st.integers(1, 6)),
    with_xs=st.booleans(),
)
def test_a_split_scan_equals_the_whole_scan(n, every, reverse, picks, forcing, with_xs):
    """Under any choice of its candidates and any boundaries, the scan's carry and stacked
    outputs equal lax.scan's; its candidates are the gaps after every `every` iterations that
    are not boundaries; each chosen one and each boundary is one stage boundary, and the pieces
    run the iterations between them in order (also reversed)."""
    rng = np.random.default_rng(n)
    xs = (rng.normal(size=(n, 3, 3)).astype(np.float32), rng.normal(size=(n, 3)).astype(np.float32))
    h0 = rng.normal(size=(2, 3)).astype(np.float32)
    if with_xs:
        args, f = (h0, xs), body
    else:
        args = (h0, None, n)

        def f(h, _):
            return jnp.sin(h) * 1.5, h[0]

    forced = tuple(sorted(g for g in forcing if g < n))
    gaps = [g for g in range(every, n, every) if g not in forced]
    chosen = {p for p in picks if p < len(gaps)}

    def split():
        return jr.scan(f, *args, reverse=reverse, candidate_every=every, boundaries=forced)

    want = jax.lax.scan(f, *args, reverse=reverse)
    with candidate_cuts(chosen):
        got = split()
        assert candidate_count() == len(gaps)
    with candidate_cuts(chosen):
        jaxpr = jax.make_jaxpr(split)()
    jax.tree.map(np.testing.assert_array_equal, got, want)
    jax.tree.map(np.testing.assert_array_equal, split(), want)  # (no choice: boundaries only)
    marks = [e.params["candidate"] for e in jaxpr.eqns if e.primitive.name == "stage_boundary"]
    assert sorted(marks) == sorted([-1] * len(forced) + list(chosen))
    ends = [0, *sorted([*forced, *(gaps[k] for k in chosen)]), n]
    lengths = [e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert lengths == [b - a for a, b in itertools.pairwise(ends)]


def test_outside_a_choice_it_is_lax_scan():
    rng = np.random.default_rng(0)
    xs = (rng.normal(size=(L, D, D)).astype(np.float32), rng.normal(size=(L, D)).astype(np.float32))
    h = rng.normal(size=(8, D)).astype(np.float32)
    jaxpr = jax.make_jaxpr(lambda h, xs: jr.scan(body, h, xs))(h, xs)
    assert (
        jaxpr.jaxpr.pretty_print()
        == jax.make_jaxpr(lambda h, xs: jax.lax.scan(body, h, xs))(h, xs).jaxpr.pretty_print()
    )
    loss = lambda xs, scan: jnp.sum(scan(body, h, xs)[0] ** 2)
    grads = jax.jit(jax.grad(loss), static_argnums=1)
    jax.tree.map(np.testing.assert_array_equal, grads(xs, jr.scan), grads(xs, jax.lax.scan))


def init_params():
    rng = np.random.default_rng(0)
    return {
        "embed": (rng.normal(size=(32, D)) / np.sqrt(32)).astype(np.float32),
        "w": (rng.normal(size=(L, D, D)) / np.sqrt(D)).astype(np.float32),
        "b": np.zeros((L, D), np.float32),
        "head": (rng.normal(size=(D, 8)) / np.sqrt(D)).astype(np.float32),
    }


def make_batch():
    rng = np.random.default_rng(1)
    return {
        "x": rng.normal(size=(32, 32)).astype(np.float32),
        "y": rng.normal(size=(32, 8)).astype(np.float32),
    }


def make_step(pipelined=True, reverse=False):
    """An embedding, candidate 0 after it, a scanned stack of L layers (candidates 1 to L - 1
    between its iterations) and a head that also reads the stack's per-layer outputs."""
    scan = jr.scan if pipelined else jax.lax.scan
    mark = jr.stage_candidate if pipelined else (lambda h: h)

    def step(params, state, batch):
        def loss_fn(p):
            h = mark(jnp.tanh(batch["x"] @ p["embed"]))
            h, per_layer = scan(body, h, (p["w"], p["b"]), reverse=reverse)
            out = h @ p["head"] + 0.01 * jnp.mean(per_layer, axis=0)[:, None]
            return jnp.mean((out - batch["y"]) ** 2)

        grad = jr.value_and_grad if pipelined else jax.value_and_grad
        loss, g = grad(loss_fn)(params)
        updates, state = OPT.update(g, state, params)
        return optax.apply_updates(params, updates), state, loss

    return step


BASE = dict(stage_mesh_shape=(1,), num_micro_batches=4, backend="local", devices_per_host=1)


def run(step, steps=2):
    params, batch = init_params(), make_batch()
    state, losses = OPT.init(params), []
    for _ in range(steps):
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    return params, losses


def assert_equal_to_jit(step, reverse=False):
    got, losses = run(step)
    want, want_losses = run(jax.jit(make_step(pipelined=False, reverse=reverse)))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("cuts", "reverse"), [((2,), False), ((1, 3), True), ((0, 2), False)])
def test_cuts_inside_a_scanned_stack_equal_jit(cuts, reverse):
    """Candidates 1 to 3 sit between the stack's layers: a cut there splits the scan, the stack
    becomes a parameter both stages read (copied once a step, its gradient sent back), and the
    step equals jax.jit; a reversed scan is cut in the order it runs."""
    cfg = jr.PipelineConfig(**BASE, cuts=cuts)
    step = jr.parallelize(make_step(reverse=reverse), config=cfg, batch_argnums=2)
    plan = step.plan(init_params(), OPT.init(init_params()), make_batch())
    assert plan.graph.num_stages == len(cuts) + 1
    per_step = {(t["kind"], t["shape"]) for t in plan.boundary_tensors() if t["kind"] == "param"}
    assert ("param", (L, D, D)) in per_step  # the stack, read on both sides of a cut inside it
    acts = {t["shape"] for t in plan.boundary_tensors() if t["kind"] == "act"}
    assert (8, D) in acts  # the carry, per micro-batch of 8 rows
    assert_equal_to_jit(step, reverse)


def test_auto_charges_the_stack_that_a_cut_inside_it_shares():
    """Every choice inside the stack carries the stack's copy and its gradient back; on a slow
    link that makes the cut before the scan (candidate 0) the fastest, and the plan says so."""
    cfg = jr.PipelineConfig(
        **BASE, partition="auto", num_stages=2, partition_trials=0, emulate_network_gbps=0.001
    )
    step = jr.parallelize(make_step(), config=cfg, batch_argnums=2)
    plan = step.plan(init_params(), OPT.init(init_params()), make_batch())
    report = plan.partition
    assert len(report.markers) == L and len(report.tried) == L
    by_cut = {c.cuts: c for c in report.tried}
    assert by_cut[(0,)].costs.shared == ()
    stack = L * D * D * 4
    for inside in [(1,), (2,), (3,)]:
        assert sum(s.seconds for s in by_cut[inside].costs.shared) >= stack / 1e6  # (1 MB/s)
    assert report.chosen == (0,)
    assert str(plan).count("MiB) is read by segments [1, 2, 3, 4]") == 2  # the stack: w and b
    assert_equal_to_jit(step)


def test_a_cut_inside_the_stack_counts_its_copy_and_gradient_on_the_later_mesh(monkeypatch):
    """The stage after a cut inside the stack holds a copy of it and a gradient accumulator
    for the step: each choice's memory on mesh 1 carries both (w and b), the cut before the
    scan neither."""
    from jaxreshard.runtime.step._cut_transfers import SharedParams

    cfg = jr.PipelineConfig(**BASE, partition="auto", num_stages=2, partition_trials=0)
    args = (init_params(), OPT.init(init_params()), make_batch())
    with_copies = jr.parallelize(make_step(), config=cfg, batch_argnums=2).plan(*args).partition
    monkeypatch.setattr(SharedParams, "copy_bytes", lambda self, bounds: [0] * len(self.meshes))
    without = jr.parallelize(make_step(), config=cfg, batch_argnums=2).plan(*args).partition
    stack = 2 * (L * D * D + L * D) * 4  # (the copy and its gradient)
    got = {c.cuts: c.memory for c in with_copies.tried}
    for choice in without.tried:
        extra = stack if choice.cuts != (0,) else 0
        assert got[choice.cuts] == (choice.memory[0], choice.memory[1] + extra), choice.cuts


def test_an_equinox_stack_of_layers_cut_inside_its_scan_equals_jit():
    """The Equinox idiom: layers made by filter_vmap, stacked, and scanned with the static part
    closed over; jr.scan cuts it and the step equals eqx.filter_jit's."""
    keys = jax.random.split(jax.random.key(0), L)
    stack = eqx.filter_vmap(lambda k: eqx.nn.Linear(D, D, key=k))(keys)
    dynamic, static = eqx.partition(stack, eqx.is_array)
    opt = optax.sgd(0.1, momentum=0.9)
    rng = np.random.default_rng(2)
    batch = {"x": rng.normal(size=(16, D)).astype(np.float32),
             "y": rng.normal(size=(16, D)).astype(np.float32)}  # fmt: skip

    def make(scan, value_and_grad):
        def step(dyn, state, batch):
            def loss_fn(dyn):
                def layer(h, d):
                    return jax.nn.gelu(jax.vmap(eqx.combine(d, static))(h)), None

                h, _ = scan(layer, batch["x"], dyn)
                return jnp.mean((h - batch["y"]) ** 2)

            loss, g = value_and_grad(loss_fn)(dyn)
            updates, state = opt.update(g, state, dyn)
            return eqx.apply_updates(dyn, updates), state, loss

        return step

    cfg = jr.PipelineConfig(**BASE, cuts=(1,))
    piped = jr.parallelize(make(jr.scan, jr.filter_value_and_grad), config=cfg, batch_argnums=2)
    plain = eqx.filter_jit(make(jax.lax.scan, eqx.filter_value_and_grad))
    results = []
    for step in (piped, plain):
        dyn, state = dynamic, opt.init(dynamic)
        for _ in range(2):
            dyn, state, loss = step(dyn, state, batch)
        results.append((dyn, float(loss)))
    assert piped.plan(dynamic, opt.init(dynamic), batch).graph.num_stages == 2
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
        results[0][0],
        results[1][0],
    )


def test_what_adds_no_candidates_and_what_is_refused():
    """A scan whose carry holds no arrays adds no candidates (nothing would cross), nor does a
    jr.scan inside another's body; a jr.stage_candidate there is refused with the fix, and so
    are xs whose leading sizes disagree (lax.scan refuses them too)."""
    xs = np.ones((4, 3), np.float32)
    with candidate_cuts("all"):
        jr.scan(lambda c, x: (c, x * 2), None, xs)
        assert candidate_count() == 0

        def outer(h, x):
            h, _ = jr.scan(lambda g, y: (g + y, None), h, jnp.stack([x, x]))
            return h, None

        jr.scan(outer, jnp.zeros(3), xs)
        assert candidate_count() == 3  # the outer scan's gaps only
        refused = r"jr.stage_candidate inside the body of a jr.scan.*drop this one"
        with pytest.raises(jr.PipelineSplitError, match=refused):
            jr.scan(lambda h, x: (jr.stage_candidate(h + x), None), jnp.zeros(3), xs)
        sizes = r"jr.scan: the xs leaves' leading sizes are \[4, 6\]; they must all be"
        with pytest.raises(ValueError, match=sizes):
            jr.scan(lambda h, x: (h, None), jnp.zeros(3), (xs, np.ones((6, 3))))
        with pytest.raises(ValueError, match=r"sizes are \[4\] and length=6"):
            jr.scan(lambda h, x: (h, None), jnp.zeros(3), xs, length=6)
    jr.scan(lambda h, x: (jr.stage_candidate(h + x), None), jnp.zeros(3), xs)  # (no choice)


def test_a_scan_over_the_batch_rows_is_refused_naming_the_fix():
    """Candidates must not depend on the batch size: a jr.scan over the rows has more at the
    whole batch than per micro-batch."""

    def step(params, state, batch):
        def loss_fn(p):
            h, _ = jr.scan(lambda c, x: (c + jnp.sum(x @ p["embed"]), None), 0.0, batch["x"])
            return h

        loss, _ = jr.value_and_grad(loss_fn)(params)
        return params, state, loss

    cfg = jr.PipelineConfig(**BASE, cuts=(0,))
    refused = r"reached 31 jr.stage_candidate markers .* whole batch and 7 at a micro-batch"
    with pytest.raises(jr.PipelineSplitError, match=refused + r".*rows with lax.scan"):
        jr.parallelize(step, config=cfg, batch_argnums=2).plan(
            init_params(), OPT.init(init_params()), make_batch()
        )


def test_boundaries_inside_the_stack_make_stages_by_hand_and_beside_candidates():
    """`boundaries=(2,)` ends a stage after the stack's first two layers: two stages without
    any choice of cuts, equal to jax.jit; with partition="auto" that boundary stays and the
    search chooses among the other candidates (the embedding's and gaps 1 and 3)."""

    def make(boundaries, **config):
        def step(params, state, batch):
            def loss_fn(p):
                h = jr.stage_candidate(jnp.tanh(batch["x"] @ p["embed"]))
                h, per_layer = jr.scan(body, h, (p["w"], p["b"]), boundaries=boundaries)
                out = h @ p["head"] + 0.01 * jnp.mean(per_layer, axis=0)[:, None]
                return jnp.mean((out - batch["y"]) ** 2)

            loss, g = jr.value_and_grad(loss_fn)(params)
            updates, state = OPT.update(g, state, params)
            return optax.apply_updates(params, updates), state, loss

        return jr.parallelize(step, config=jr.PipelineConfig(**BASE, **config), batch_argnums=2)

    args = (init_params(), OPT.init(init_params()), make_batch())
    by_hand = make((2,))
    assert by_hand.plan(*args).graph.num_stages == 2
    assert_equal_to_jit(by_hand)
    auto = make((2,), partition="auto", num_stages=3, partition_trials=0)
    report = auto.plan(*args).partition
    assert report.markers == [0, 1, "forced", 2]
    assert len(report.tried) == 3 and auto.plan(*args).graph.num_stages == 3
    assert_equal_to_jit(auto)
    for wrong in [(0,), (4,), (2, 2), "2", (True,)]:
        with pytest.raises(ValueError, match=r"jr.scan\(boundaries=.*distinct iteration counts"):
            make(wrong).plan(*args)


@pytest.mark.parametrize("every", [0, -1, 1.5, True])
def test_candidate_every_must_be_a_positive_int(every):
    with pytest.raises(ValueError, match=r"jr.scan\(candidate_every=.*an int >= 1"):
        jr.scan(body, jnp.zeros((2, D)), None, length=3, candidate_every=every)


def test_a_candidate_inside_lax_scan_is_refused_naming_jr_scan():
    def step(params, state, batch):
        def loss_fn(p):
            def layer(h, wb):
                return jr.stage_candidate(body(h, wb)[0]), None

            h = jnp.tanh(batch["x"] @ p["embed"])
            h, _ = jax.lax.scan(layer, h, (p["w"], p["b"]))
            return jnp.mean((h @ p["head"] - batch["y"]) ** 2)

        loss, _ = jr.value_and_grad(loss_fn)(params)
        return params, state, loss

    cfg = jr.PipelineConfig(**BASE, cuts=(0,))
    refused = r"inside `scan` at .*test_scan_candidates.py.*scan it with jr.scan"
    with pytest.raises(jr.PipelineSplitError, match=refused):
        jr.parallelize(step, config=cfg, batch_argnums=2).plan(
            init_params(), OPT.init(init_params()), make_batch()
        )


def test_the_partitioner_prices_boundary_tensors_in_the_layout_the_runtime_gives_them():
    """A cut inside the stack sends the first piece's per-layer outputs, (layers, rows), and
    the carry: the partitioner prices each in the layout the runtime gives it on meshes that
    split the rows (the outputs along dim 1), without a warning about a micro-batch the step
    does not have."""
    import warnings

    from jaxreshard.runtime.step._cut_transfers import crossing_spec
    from jaxreshard.runtime.step._memory import crossing_bytes

    base = {**BASE, "stage_mesh_shape": (2,), "devices_per_host": 2}
    args = (init_params(), OPT.init(init_params()), make_batch())
    with warnings.catch_warnings():
        warnings.simplefilter("error", jr.ReplicatedSpecWarning)
        auto = jr.PipelineConfig(**base, partition="auto", num_stages=2, partition_trials=0)
        jr.parallelize(make_step(), config=auto, batch_argnums=2).plan(*args)
        step = jr.parallelize(make_step(), config=jr.PipelineConfig(**base, cuts=(2,)),
                              batch_argnums=2)  # fmt: skip
        plan = step.plan(*args)
    acts = {k: t for k, t in plan.layout.transfers.items() if k[0] == "act"}
    assert {t.shape for t in acts.values()} == {(2, 8), (8, D)}  # per-layer outputs, carry

    def entries(spec, ndim):
        return tuple(spec) + (None,) * (ndim - len(spec))

    for t in acts.values():
        want = entries(crossing_spec({"data": 2}, t.shape, 8, "data"), len(t.shape))
        got = {entries(t.src_spec, len(t.shape)), entries(t.dst_spec, len(t.shape))}
        assert got == {want}, (t.shape, t.src_spec, t.dst_spec)
    # The memory estimate splits them the same way (each in half over `data`).
    halves = sum(int(np.prod(t.shape)) * 4 // 2 for t in acts.values())
    assert crossing_bytes(plan.graph, 0, {"data": 2}, "data") == halves
    assert_equal_to_jit(step)


def test_auto_past_max_choices_searches_and_finds_the_choice_every_prediction_finds(monkeypatch):
    """With more ways to cut than `MAX_CHOICES` (here lowered to 2 of the 6 ways to cut 3
    stages from 4 candidates), the partitioner searches ([Note: cut search]) instead of
    predicting every way, and on the same segment times chooses what predicting all did."""
    from jaxreshard.runtime.step import _partition, _partition_report

    real, timed = _partition.segment_cost, {}

    def once(graph, s, device, split):  # (both runs see the same measured segments)
        if s not in timed:
            timed[s] = real(graph, s, device, split)
        return timed[s]

    monkeypatch.setattr(_partition, "segment_cost", once)
    cfg = jr.PipelineConfig(
        **BASE, partition="auto", num_stages=3, partition_trials=0, emulate_network_gbps=0.01
    )
    args = (init_params(), OPT.init(init_params()), make_batch())
    every = jr.parallelize(make_step(), config=cfg, batch_argnums=2).plan(*args).partition
    assert every.ways == 6 and len(every.tried) == 6 and not every.to_json()["searched"]
    monkeypatch.setattr(_partition, "MAX_CHOICES", 2)
    monkeypatch.setattr(_partition_report, "MAX_CHOICES", 2)
    step = jr.parallelize(make_step(), config=cfg, batch_argnums=2)
    plan = step.plan(*args)
    searched = plan.partition
    assert searched.to_json()["searched"] and searched.chosen == every.chosen
    assert "6 ways to cut, over the 2 predicted one by one" in str(plan)
    assert_equal_to_jit(step)
    tight = jr.PipelineConfig(**{**cfg.to_dict(), "memory_cap_gib": 1e-6})
    over = r"no choice of cuts of the \d+ its search predicted \(of 6\) fits in"
    with pytest.raises(ValueError, match=over):
        jr.parallelize(make_step(), config=tight, batch_argnums=2).plan(*args)


def test_a_batch_statistic_in_a_split_scan_is_named_at_the_users_line_once():
    """The pieces of a split scan repeat their body's equations: a batch statistic in the body
    warns once, at the user's line, not at jr.scan's."""

    def layer(h, wb):
        h = jnp.tanh(h @ wb[0] + wb[1])
        return h, jnp.max(h)  # (a statistic of the micro-batch's rows)

    def step(params, state, batch):
        def loss_fn(p):
            h, peaks = jr.scan(layer, jnp.tanh(batch["x"] @ p["embed"]), (p["w"], p["b"]))
            return jnp.mean((h @ p["head"] - batch["y"]) ** 2) + jnp.sum(peaks)

        loss, _ = jr.value_and_grad(loss_fn)(params)
        return params, state, loss

    cfg = jr.PipelineConfig(**BASE, cuts=(0, 2))
    with pytest.warns(jr.MicroBatchWarning) as caught:
        jr.parallelize(step, config=cfg, batch_argnums=2).plan(
            init_params(), OPT.init(init_params()), make_batch()
        )
    messages = [str(w.message) for w in caught if w.category is jr.MicroBatchWarning]
    assert len(messages) == len(set(messages)) >= 1
    assert all("test_scan_candidates.py" in m and "_scan.py" not in m for m in messages), messages


def test_boundaries_outside_parallelize_differentiate_as_lax_scan_under_jit():
    """Outside `parallelize` a boundary is the identity: under jax.jit and jax.grad a scan cut
    by `boundaries=` (given any way a sequence is) gives lax.scan's loss and gradients, also
    reversed and with no xs."""
    rng = np.random.default_rng(3)
    xs = (rng.normal(size=(L, D, D)).astype(np.float32) / 4, np.zeros((L, D), np.float32))
    h = rng.normal(size=(8, D)).astype(np.float32)

    def loss(xs, scan, reverse, **kw):
        out, per_layer = scan(body, h, xs, reverse=reverse, **kw)
        return jnp.sum(out**2) + jnp.sum(per_layer)

    for reverse in (False, True):
        plain = functools.partial(loss, scan=jax.lax.scan, reverse=reverse)
        want = jax.jit(jax.value_and_grad(plain))(xs)
        for ends in [(1, 3), np.array([2]), [3]]:
            cut = functools.partial(loss, scan=jr.scan, reverse=reverse, boundaries=ends)
            got = jax.jit(jax.value_and_grad(cut))(xs)
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)
    carry, _ = jr.scan(lambda c, _: (c * 2, None), jnp.ones(2), (), length=4, boundaries=(2,))
    np.testing.assert_array_equal(carry, 16 * np.ones(2))
    assert jr.scan(lambda c, x: (c + x, None), 0.0, jnp.ones(3), boundaries=None)[0] == 3


def test_a_nested_scans_boundaries_are_refused_and_a_refusal_leaves_no_count_behind():
    from jaxreshard.frontend._markers import _state

    def outer(h, x):
        h, _ = jr.scan(lambda g, y: (g + y, None), h, jnp.stack([x, x, x]), boundaries=(1,))
        return h, None

    xs = np.ones((4, 3), np.float32)
    for cuts in (None, "all"):
        with candidate_cuts(cuts):
            with pytest.raises(jr.PipelineSplitError, match=r"put the boundaries on the outer"):
                jr.scan(outer, jnp.zeros(3), xs, boundaries=(2,))
            with pytest.raises(ValueError, match=r"leading sizes"):
                jr.scan(
                    lambda h, x: (h, None), jnp.zeros(3), (xs, np.ones((6, 3))), boundaries=(1,)
                )
        assert getattr(_state, "scan_body", 0) == 0


def test_each_message_of_a_batch_statistic_warns_once():
    from jaxreshard.frontend._batch import Finding, warn_statistics

    eqn = jax.make_jaxpr(lambda x: jnp.max(x))(jnp.ones(3)).eqns[0]
    with pytest.warns(jr.MicroBatchWarning) as caught:
        warn_statistics([Finding("reduces", eqn, None)] * 3, "mean")
    assert len(caught) == 1
