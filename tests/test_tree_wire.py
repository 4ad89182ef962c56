"""What travels to the Ray hosts pickled (`jaxreshard/_tree_wire.py`), without Ray's actors: a
`jax.checkpoint`ed function loaded in a fresh process, and the numbered trees' checks."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("ray", reason="Ray is not installed here (the GPU image has none)")

from jaxreshard._tree_wire import dump_numbered, dumps, load_numbered


def test_a_checkpointed_function_travels_by_value_and_runs_in_a_fresh_process(tmp_path):
    """Its wrapper's globals hold JAX's caches, which do not pickle: they go by module and name
    (see [Note: JAX's caches travel by reference])."""

    @jax.checkpoint
    def layer(h, w):
        return jnp.tanh(h @ w)

    (tmp_path / "fn.pkl").write_bytes(dumps(layer))
    script = textwrap.dedent(f"""
        import pickle, jax, numpy as np
        layer = pickle.loads(open({str(tmp_path / "fn.pkl")!r}, "rb").read())
        w = np.full((3, 3), 0.5, np.float32)
        print(float(jax.grad(lambda w: layer(np.ones((2, 3), np.float32), w).sum())(w).sum()))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    w = np.full((3, 3), 0.5, np.float32)
    want = float(jax.grad(lambda w: layer(np.ones((2, 3), np.float32), w).sum())(w).sum())
    assert float(done.stdout.split()[-1]) == pytest.approx(want, rel=1e-6)


def test_a_numbered_tree_comes_back_in_order_or_is_refused():
    tree = {"b": [np.zeros(2), np.ones(3)], "a": np.zeros(1)}
    leaves, treedef = load_numbered(dump_numbered(tree), "the tree")
    assert leaves == [0, 1, 2] and treedef == jax.tree.structure(tree)
    import pickle

    # A tree that flattens to other positions here (as a class that travelled by value does).
    shuffled = pickle.dumps(({"a": 1, "b": 0}, 2))
    with pytest.raises(ValueError, match=r"the tree came to this host as 2 leaves, not the "
                       r"driver's 2 in its order: .*Define the model's classes"):  # fmt: skip
        load_numbered(shuffled, "the tree")
    fewer = pickle.dumps(({"a": 0}, 2))
    with pytest.raises(ValueError, match=r"as 1 leaves, not the driver's 2"):
        load_numbered(fewer, "the tree")


def test_a_module_the_host_cannot_import_is_named(tmp_path, monkeypatch):
    (tmp_path / "jr_wire_only_here.py").write_text("class Node:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import jr_wire_only_here

    data = dumps(({"x": jr_wire_only_here.Node()}, 1))
    monkeypatch.delitem(sys.modules, "jr_wire_only_here")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    with pytest.raises(ValueError, match=r"the tree names 'jr_wire_only_here', which this host "
                       r"cannot import .*make their module importable on every host"):  # fmt: skip
        load_numbered(data, "the tree")
