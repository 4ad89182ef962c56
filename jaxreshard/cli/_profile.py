"""`jaxreshard profile MODEL`: train a model on synthetic data as a pipeline and profile it."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from jaxreshard.cli._console import (
    PLOT_SUFFIXES,
    CommandError,
    check_outputs,
    check_writable,
    cpu_devices,
    field_docs,
    make_console,
    normalized,
    write_json,
)


def _profile(args: argparse.Namespace) -> int:
    from jaxreshard import profiler

    check_outputs(
        args, {"json": None, "trace": None, "plot": PLOT_SUFFIXES, "auto_toml": (".toml",)}
    )
    if (args.checkpoint_every or args.resume) and not args.checkpoint:
        flag = "--resume" if args.resume else "--checkpoint-every"
        raise CommandError(f"{flag} needs --checkpoint DIR (the folder of the checkpoints)")
    if args.auto and (args.compare_schedules or args.compare_resharding or args.checkpoint):
        raise CommandError(
            "--auto searches layouts on its own; it does not go with --compare-schedules, "
            "--compare-resharding or --checkpoint"
        )
    if args.auto_toml and not args.auto:
        raise CommandError("--auto-toml FILE writes the winner of --auto; add --auto")
    if args.checkpoint:
        if args.compare_schedules or args.compare_resharding:
            raise CommandError(
                "--checkpoint saves one run's training state; it does not go with "
                "--compare-schedules / --compare-resharding"
            )
        root = normalized(args.checkpoint)
        if root.exists() and not root.is_dir():
            raise CommandError(f"--checkpoint {args.checkpoint}: is a file; give a folder")
        check_writable("--checkpoint", args.checkpoint, root)
    if args.compile_cache not in (None, "off"):
        cache_dir = normalized(args.compile_cache)
        if cache_dir.exists() and not cache_dir.is_dir():
            raise CommandError(
                f"--compile-cache {args.compile_cache}: is a file, not a folder; give a folder "
                "for JAX's compilation cache, or off"
            )
        check_writable("--compile-cache", args.compile_cache, cache_dir)
    overrides: dict[str, dict[str, object]] = {"model": {}, "run": {}, "pipeline": {}}
    for dest, value in vars(args).items():
        if value is not None and dest.startswith(("model__", "run__", "pipeline__")):
            table, key = dest.split("__", 1)
            overrides[table][key] = value
    pc = profiler.load_profile_config(args.model, args.config, overrides)
    cpu_devices(profiler.devices_needed(pc), required=pc.pipeline.backend == "local")
    if _on_this_machines_cpu(pc):
        profiler.check_fits(pc)
    console = make_console()
    cache = _compile_cache(args.compile_cache)
    if cache:
        console.print(f"XLA compile cache: {cache} (--compile-cache off to compile afresh)")
    progress = not args.no_progress
    if args.auto:
        record = profiler.auto_search(
            pc,
            top=args.auto_top,
            console=console,
            progress=progress,
            toml_path=args.auto_toml and normalized(args.auto_toml),
            meshes=args.auto_meshes == "search",
            cuts=args.auto_cuts == "search",
            virtual=args.auto_virtual == "search",
            mixed=args.auto_mixed,
            refine=args.auto_refine,
        )
        if args.json:
            write_json(args.json, record)
            console.print(f"wrote {args.json}")
        return 0
    if args.compare_schedules or args.compare_resharding:
        kinds = [k for k in ("schedules", "resharding") if getattr(args, f"compare_{k}")]
        results = {}
        for kind in kinds:
            variants = (
                profiler.schedule_variants(pc)
                if kind == "schedules"
                else profiler.resharding_variants(pc)
            )
            title = (
                f"{pc.model} {pc.preset}: {kind} compared, {pc.num_stages} stages x "
                f"{pc.pipeline.num_micro_batches} micro-batches, {pc.run.steps} steps each "
                "(interleaved); speedup over the first row"
            )
            rows = profiler.compare(
                pc,
                variants,
                bound=pc.pipeline.backend != "ray",
                console=console,
                progress=progress,
                title=title,
                measure_placement=kind == "schedules" and profiler.measures_placement(pc),
            )
            results[kind] = profiler.compare_json(pc, kind, rows)
        if args.json:
            write_json(args.json, results[kinds[0]] if len(kinds) == 1 else results)
            console.print(f"wrote {args.json}")
        return 0
    profiler.run_profile(
        pc,
        bound=args.bound,
        console=console,
        progress=progress,
        json_path=args.json and normalized(args.json),
        trace_path=args.trace and normalized(args.trace),
        plot_path=args.plot and normalized(args.plot),
        checkpoint=args.checkpoint and normalized(args.checkpoint),
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
    )
    return 0


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 or value > 10**9:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step count from 1 to 10**9")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0 or value > 1000:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count from 0 to 1000")
    return value


def _on_this_machines_cpu(pc) -> bool:
    """Whether the run's devices are this machine's CPU (not GPUs, not another cluster's)."""
    import jax

    if pc.pipeline.backend == "ray" and pc.run.address is not None:
        return False
    return jax.config.jax_platforms in (None, "", "cpu") and jax.default_backend() == "cpu"


def _compile_cache(where: str | None) -> str | None:
    """Turn on JAX's persistent compilation cache (identical stage programs, e.g. of schedule
    variants or of the previous run, then load instead of compiling)."""
    import os

    import jax

    if where == "off":
        return None
    if where is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        where = os.path.join(base, "jaxreshard", "xla")
    jax.config.update("jax_compilation_cache_dir", where)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return where


def add_profile_parser(commands: argparse._SubParsersAction, extra: Sequence[str] = ()) -> None:
    """The `profile` command, with a sub-command per built-in model and per model of the
    user's in `extra` (references, see [Note: user models] in `models/_user.py`)."""
    from jaxreshard.models import MODEL_NAMES, get_model
    from jaxreshard.profiler import RunConfig
    from jaxreshard.profiler._config import PROFILE_PIPELINE
    from jaxreshard.runtime._config import PipelineConfig

    profile = commands.add_parser(
        "profile",
        help="train GPT, U-Transformer or your own model as a pipeline and profile it end to end",
        description="Train a model on synthetic data with parallelize and report step time, "
        "throughput, per-stage compute/blocked/bubble, and every boundary tensor's transfer. "
        "MODEL is gpt, utransformer, or your own model: path/to/model.py or package.module "
        "(docs/profile.md, 'Your own model').",
    )
    models = profile.add_subparsers(dest="model", required=True, metavar="MODEL")
    for name in (*MODEL_NAMES, *extra):
        spec = get_model(name)
        sub = models.add_parser(
            name,
            help=f"profile {name} (presets: {', '.join(spec.presets)})",
            description=f"Profile {name} training. Settings come from defaults < --preset < "
            "--config FILE.toml ([model], [run], [pipeline] tables) < flags.",
        )
        sub.add_argument("--config", default=None, metavar="FILE.toml", help="profile config")
        out = sub.add_argument_group("outputs and comparisons")
        out.add_argument("--json", default=None, metavar="OUT", help="write the profile JSON")
        out.add_argument("--trace", default=None, metavar="TRACE.json", help="Chrome trace")
        out.add_argument("--plot", default=None, metavar="PNG", help="measured timeline PNG")
        out.add_argument(
            "--compare-schedules",
            action="store_true",
            help="1f1b vs eager_1f1b vs eager_1f1b + weight delay vs zb_h1, with the "
            "signal-only bound",
        )
        out.add_argument(
            "--compare-resharding",
            action="store_true",
            help="send_recv vs allgather vs broadcast resharding, with the signal-only bound",
        )
        out.add_argument(
            "--bound",
            action="store_true",
            help="also time signal-only steps (the bound with free transfers; local backend)",
        )
        out.add_argument(
            "--auto",
            action="store_true",
            help="search stage meshes, cuts, model stages per mesh, schedules and micro-batch "
            "counts by the calibrated simulator, measure the best few (--auto-top) beside plain "
            "data parallelism, report the fastest",
        )
        out.add_argument(
            "--auto-top",
            type=_positive,
            default=3,
            metavar="N",
            help="with --auto: how many of the best predictions to measure (default 3)",
        )
        out.add_argument(
            "--auto-meshes",
            choices=("search", "keep"),
            default="search",
            help="with --auto: also search the stage meshes (every uniform mesh over the "
            "layout's devices, each calibrated by a few steps; default) or keep the configured",
        )
        out.add_argument(
            "--auto-mixed",
            type=_count,
            default=2,
            metavar="N",
            help="with --auto and the mesh search: also calibrate the N mixes of stage meshes "
            "(stages on meshes of different shapes) that the uniform layouts' calibrations "
            "estimate fastest (default 2; 0: uniform meshes only)",
        )
        out.add_argument(
            "--auto-refine",
            type=_count,
            default=3,
            metavar="N",
            help="with --auto: calibrate up to N more points where the best predictions' "
            "micro-batch counts lie outside their layout's calibrated ones, so that the "
            "shortlist rests on interpolated costs (default 3; 0: none)",
        )
        out.add_argument(
            "--auto-cuts",
            choices=("search", "keep"),
            default="search",
            help="with --auto: on each layout, let partition='auto' choose the cut from a "
            "candidate after every layer (default), or keep the configured cut",
        )
        out.add_argument(
            "--auto-virtual",
            choices=("search", "keep"),
            default="search",
            help="with --auto: also calibrate each layout with 2 model stages per mesh "
            "(interleaved 1F1B, ZB-V, DualPipeV; default), or keep the configured count "
            "(half the calibration runs)",
        )
        out.add_argument(
            "--auto-toml",
            default=None,
            metavar="FILE.toml",
            help="with --auto: write the winner as a profile config",
        )
        out.add_argument("--no-progress", action="store_true", help="no progress bar")
        ckpt = sub.add_argument_group("checkpoints (any layout can resume any other's)")
        ckpt.add_argument(
            "--checkpoint",
            default=None,
            metavar="DIR",
            help="save the training state to DIR/step_<n> at the end (and every N steps)",
        )
        ckpt.add_argument(
            "--checkpoint-every",
            type=_positive,
            default=None,
            metavar="N",
            help="also save every N training steps (warm-up included), asynchronously",
        )
        ckpt.add_argument(
            "--resume",
            action="store_true",
            help="start from the newest checkpoint in --checkpoint DIR, in this run's layout",
        )
        out.add_argument(
            "--compile-cache",
            default=None,
            metavar="DIR|off",
            help="JAX's persistent compilation cache (default ~/.cache/jaxreshard/xla)",
        )
        model_group = sub.add_argument_group(
            f"[model] ({name}; each field's default is the preset's value)"
        )
        model_group.add_argument(
            "--preset",
            dest="model__preset",
            default=None,
            metavar="NAME",
            help=f"the model's size: {', '.join(spec.presets)} (default: {spec.default_preset})",
        )
        model_docs = field_docs(spec.config_type)
        for f in dataclasses.fields(spec.config_type):
            if not f.init:
                continue  # (computed by the config itself)
            try:
                _field_flag(model_group, "model", f.name, model_docs.get(f.name, f.name), None)
            except argparse.ArgumentError as e:  # (a user model's field named like a flag)
                raise ValueError(
                    f"model {name!r}: its config field {f.name!r} makes the flag "
                    f"--{f.name.replace('_', '-')}, which the command already has ({e}); "
                    "rename the field in the model"
                ) from None
        run_group = sub.add_argument_group("[run] (RunConfig)")
        run_docs = field_docs(RunConfig)
        for f in dataclasses.fields(RunConfig):
            _field_flag(run_group, "run", f.name, run_docs[f.name], _default(f, {}))
        pipe_group = sub.add_argument_group("[pipeline] (PipelineConfig)")
        pipe_docs = field_docs(PipelineConfig)
        for f in dataclasses.fields(PipelineConfig):
            if f.name == "emulate_network_gbps":
                pipe_group.add_argument(
                    "--emulate-network",
                    "--emulate-network-gbps",
                    dest="pipeline__emulate_network_gbps",
                    default=None,
                    metavar="GBPS",
                    help="delay every transfer between hosts as a NIC of GBPS gigabytes/s "
                    "would (the paper's 10 Gbit/s is 1.25); each stage is its own host unless "
                    "--devices-per-host says otherwise (default: none)",
                )
                continue
            default = _default(f, PROFILE_PIPELINE)
            _field_flag(pipe_group, "pipeline", f.name, pipe_docs[f.name], default)
        sub.set_defaults(run=_profile)


def _default(f: dataclasses.Field, overrides: dict[str, object]) -> str:
    if f.name in overrides:
        value = overrides[f.name]
    elif f.default is not dataclasses.MISSING:
        value = f.default
    else:
        return "-"
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value).lower() if isinstance(value, bool) else str(value)


def _field_flag(
    group: argparse._ArgumentGroup, table: str, name: str, doc: str, default: str | None
) -> None:
    flag = "--" + name.replace("_", "-")
    dest = f"{table}__{name}"
    # argparse formats help with %: a literal % in a docstring must not read as a placeholder.
    text = doc.rstrip(".").replace("%", "%%")
    text += f" (default: {default})" if default is not None else ""
    if name in ("weight_delay",):
        group.add_argument(
            flag, dest=dest, default=None, action=argparse.BooleanOptionalAction, help=text
        )
        return
    group.add_argument(flag, dest=dest, default=None, metavar="V", help=text)
