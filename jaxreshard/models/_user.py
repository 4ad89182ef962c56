"""A model of the user's own for `jaxreshard profile`: a Python file or an importable module
that follows the built-in models' conventions.

[Note: user models]
`jaxreshard profile MODEL` takes, beside `gpt` and `utransformer`, a reference to the user's
model: `path/to/model.py` or `package.module`, optionally `:NAME` for an attribute of it (a
`ModelSpec`, or an object holding the functions below). The reference is the model's name
everywhere a name is recorded (JSON, checkpoints, `--auto-toml`'s `[model] name`), so a config
written for it loads again from the same working directory.

What the module defines (docs/profile.md, "Your own model", has a whole example):
- `PRESETS`: named configs, each an instance of one dataclass (its fields become `--flags`);
  the default preset is `tiny` if there is one, else the first;
- `num_layers(cfg)`: how many layers the stages share (stage cuts go between them);
- `init_params(cfg, seed)`: the parameters, a pytree of arrays;
- `train_step(cfg, num_stages, optimizer, *, candidates=False)`: the step
  `(params, opt_state, batch) -> (params, opt_state, loss)`, with `num_stages` even stages marked
  by `jr.stage_boundary` (or, with `candidates`, a `jr.stage_candidate` after every layer but the
  last: `jaxreshard.models.stage_marker` does either);
- `synthetic_batch(cfg, batch_size, step, seed)`: a batch (a dict of arrays, each with the batch
  on axis 0);
- optional: `param_specs(cfg, axis)` (tensor-parallel PartitionSpecs over mesh axis `axis`;
  default: every parameter replicated), `UNIT` and `units_per_sample(cfg)` (what throughput
  counts; default one sample), `num_params(cfg)` and `activation_bytes(cfg, batch_size)` (the
  memory check before a run on this machine's CPU; by default the parameters are counted from
  `init_params` under `jax.eval_shape`, and activations are not estimated).
The config's fields must be values a TOML file holds and must not take a name the profile
config uses (`check_model_fields` and `_check_writable` in `profiler/_config.py`).

A file is imported as a module of its own (its folder first on `sys.path`, as Python does for a
script, so that it can import its neighbours), marked `__jaxreshard_by_value__` with the
neighbours its import loaded: no other process can import it by its name, so a pipeline on Ray
sends them to the hosts by value, whichever module the step comes from; the hosts need the
file's other imports installed, not its folder. An exception from the model's own code is
reported as the model's (`describe` in cli/_console.py), not as a jaxreshard bug.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REQUIRED = {
    "num_layers": "num_layers(cfg) -> int",
    "init_params": "init_params(cfg, seed) -> params",
    "train_step": "train_step(cfg, num_stages, optimizer, *, candidates=False) -> step",
    "synthetic_batch": "synthetic_batch(cfg, batch_size, step, seed) -> batch",
}
_LOADED: dict[tuple[str, str], Any] = {}  # (where, attribute) -> ModelSpec
FOLDERS: set[Path] = set()  # the folders of the model files loaded (their code is the user's)


def absolute(reference: str) -> str:
    """`reference` with a file's path made absolute (from the working directory); a module's
    name or a built-in model's as it is."""
    where, colon, attribute = reference.partition(":")
    if not (where.endswith(".py") or "/" in where):
        return reference
    return str(Path(where).expanduser().resolve()) + colon + attribute


def same_model(a: str, b: str) -> bool:
    """Whether two references name the same model (`./m.py` and `m.py`, say)."""
    return a == b or absolute(a) == absolute(b)


def load_model(reference: str) -> Any:
    """The `ModelSpec` of the user's model `reference` (see [Note: user models])."""
    from jaxreshard.models import ModelSpec

    if not isinstance(reference, str) or not reference.strip():
        raise ValueError(
            f"model {reference!r}: give gpt, utransformer, or your own model as "
            "path/to/model.py or package.module (docs/profile.md, 'Your own model')"
        )
    where, _, attribute = reference.partition(":")
    file = where.endswith(".py") or "/" in where
    key = (absolute(where), attribute)
    if key in _LOADED:
        return dataclasses.replace(_LOADED[key], name=reference)
    module = _import_file(where, reference) if file else _import_module(where, reference)
    target: Any = module
    if attribute:
        if not attribute.isidentifier() or not hasattr(module, attribute):
            raise ValueError(
                f"model {reference!r}: {where} has no attribute {attribute!r}; name a ModelSpec "
                "or an object with the model's functions, or drop ':" + attribute + "'"
            )
        target = getattr(module, attribute)
    if isinstance(target, ModelSpec):
        spec = dataclasses.replace(target, name=reference, builtin=False)
    else:
        spec = _spec_of(target, reference)
    _LOADED[key] = spec
    return spec


def _import_file(where: str, reference: str) -> Any:
    path = Path(where).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"model {reference!r}: no file {path} (from {Path.cwd()}); give the path of your "
            "model's .py file, or an importable module name such as mypackage.model"
        )
    path = path.resolve()
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
    stem = "".join(c if c.isalnum() else "_" for c in path.stem)
    name = f"jaxreshard_user_model_{stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # (its neighbours import, as for a script)
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise ValueError(f"model {reference!r}: {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(loader_spec)
    # No other process can import it by this name: a Ray pipeline sends it by value (see
    # `_by_value` in runtime/ray/_pipeline.py), whichever module the step itself is from.
    module.__jaxreshard_by_value__ = True
    sys.modules[name] = module  # (dataclasses and pickling look the module up by name)
    before = set(sys.modules)
    FOLDERS.add(path.parent)
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ValueError(
            f"model {reference!r}: importing {path} failed: {type(e).__name__}: {e}; fix the "
            f"file (`python {path}` shows where)"
        ) from e
    for new in set(sys.modules) - before:  # its neighbours (files of its folder) go too
        neighbour = sys.modules.get(new)
        file = getattr(neighbour, "__file__", None)
        if file and Path(file).resolve().is_relative_to(path.parent):
            neighbour.__jaxreshard_by_value__ = True
    return module


def _import_module(where: str, reference: str) -> Any:
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        if e.name is None or not (where == e.name or where.startswith(e.name + ".")):
            raise ValueError(
                f"model {reference!r}: importing {where} failed: {e}; install what it imports"
            ) from e
        here = "./" + where.replace(".", "/") + ".py"
        raise ValueError(
            f"model {reference!r}: no module {where!r} on the Python path ({e}); give gpt, "
            f"utransformer, the path of your model's .py file ({here} for one here), or a module "
            "name importable here (install its package, or set PYTHONPATH)"
        ) from e
    except Exception as e:  # (the module's own code failed)
        raise ValueError(
            f"model {reference!r}: importing {where} failed: {type(e).__name__}: {e}; fix the "
            "module"
        ) from e


def _spec_of(target: Any, reference: str) -> Any:
    """A ModelSpec from the functions and presets `target` (a module or an object) defines."""
    from jaxreshard.models import ModelSpec

    missing = [sig for name, sig in REQUIRED.items() if not callable(getattr(target, name, None))]
    presets = getattr(target, "PRESETS", None)
    if not isinstance(presets, dict) or not presets:
        missing.insert(0, "PRESETS = {'tiny': Config(...), ...} (a dict of dataclass configs)")
    if missing:
        file = getattr(target, "__file__", None)
        found = f" (imported from {file})" if file else ""
        raise ValueError(
            f"model {reference!r}{found}: it does not define {'; '.join(missing)}. A model for "
            "`jaxreshard profile` defines these as the built-in ones do (docs/profile.md, "
            "'Your own model', has a whole example); for a file of yours whose name is also "
            "an installed module's, give its path (./name.py)"
        )
    types = {type(cfg) for cfg in presets.values()}
    config_type = next(iter(types))
    bad = [
        name
        for name, cfg in presets.items()
        if not isinstance(name, str) or not dataclasses.is_dataclass(cfg) or isinstance(cfg, type)
    ]
    if bad or len(types) > 1:
        raise ValueError(
            f"model {reference!r}: PRESETS must map names to instances of one dataclass (its "
            f"fields become the --flags); got {sorted(t.__name__ for t in types)}"
            + (f", and {bad!r} are not dataclass instances named by strings" if bad else "")
        )
    unit = getattr(target, "UNIT", "samples")
    per_sample = getattr(target, "units_per_sample", None)
    module = SimpleNamespace(
        init_params=target.init_params,
        train_step=target.train_step,
        synthetic_batch=target.synthetic_batch,
        param_specs=getattr(target, "param_specs", None),
        num_params=getattr(target, "num_params", None),
        activation_bytes=getattr(target, "activation_bytes", None),
        source=target,
    )
    return ModelSpec(
        reference,
        config_type,
        dict(presets),
        module,
        str(unit),
        per_sample if callable(per_sample) else (lambda cfg: 1),
        _counted(target.num_layers, reference),
        builtin=False,
    )


def _counted(num_layers: Any, reference: str) -> Any:
    def count(cfg: Any) -> int:
        n = num_layers(cfg)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(
                f"model {reference!r}: num_layers(cfg) returned {n!r}; it must be the number "
                "of layers the stages share, an int >= 1"
            )
        return n

    return count


def accepts_candidates(train_step: Any) -> bool:
    """Whether `train_step` takes the `candidates` keyword (or any keyword)."""
    try:
        parameters = inspect.signature(train_step).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(
        p.name == "candidates" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters
    )
