"""``openrecipes plan``: predict peak memory per stage, fit, tokens/s/GPU and MFU before a run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


_LAYOUT_OPTIONS = ("tp", "pp", "pp_first_stage_layers", "pp_last_stage_layers", "cp", "ep", "etp", "dp")
# The training settings and their defaults, the same in both modes: a setting given is used as given; one left out
# takes its default when one layout is planned, and a ranking tries each value in its sweep (the default among them).
DEFAULTS: dict[str, Any] = {"max_tokens_per_gpu": 8192, "recompute": "full", "optimizer": "adam",
                            "offload_fraction": 0.0}
SWEEPS: dict[str, tuple[Any, ...]] = {"max_tokens_per_gpu": (4096, 8192, 16384),
                                      "recompute": ("none", "selective", "full"),
                                      "optimizer": ("adam", "precision-aware"),
                                      "offload_fraction": (0.0, 0.5, 1.0)}
DEFAULT_ENGINE = "auto"


def _setting_help(name: str, what: str) -> str:
    return (f"{what} (default: {DEFAULTS[name]} for one layout; a ranking tries "
            f"{', '.join(map(str, SWEEPS[name]))})")


def register(subparsers: Any) -> None:
    from openrecipes.config.hardware import add_gpus_option
    from openrecipes.config.recompute_names import RECOMPUTE_GRANULARITIES

    p = subparsers.add_parser("plan", help="predict memory and throughput of a layout, or rank layouts",
                              description=__doc__ + " Any layout flag plans that one layout; none ranks every layout "
                              "that fits.")
    p.add_argument("model", help="registered model name (see `openrecipes models`)")
    add_gpus_option(p, required=True, help="how many GPUs of which type, e.g. 8xH200 (types: config/hardware.yaml)")
    p.add_argument("--gpu-memory-gib", type=float, help="override the GPU memory in GiB (default: the hardware table's)")
    layout_defaults = {"pp_first_stage_layers": "an even split", "pp_last_stage_layers": "an even split",
                       "dp": "GPUs / (tp*pp*cp)"}
    for name in _LAYOUT_OPTIONS:
        p.add_argument("--" + name.replace("_", "-"), type=int, dest=name, metavar="N",
                       help=f"layout {name} (default when one layout is planned: {layout_defaults.get(name, 1)})")
    p.add_argument("--sequence-parallel", action="store_true", default=None,
                   help="sequence parallelism with tp > 1 (plans one layout)")
    p.add_argument("--max-tokens-per-gpu", type=int, help=_setting_help("max_tokens_per_gpu", "tokens per GPU per "
                                                                          "microbatch"))
    p.add_argument("--rows-per-microbatch", type=int,
                   help="rows per microbatch (plans one layout; default: as many as --max-tokens-per-gpu holds)")
    p.add_argument("--recompute", choices=RECOMPUTE_GRANULARITIES,
                   help=_setting_help("recompute", "activation recompute (attention_core and experts: one layout "
                                      "only)"))
    p.add_argument("--optimizer", choices=SWEEPS["optimizer"], help=_setting_help("optimizer", "optimizer state"))
    p.add_argument("--offload-fraction", type=float,
                   help=_setting_help("offload_fraction", "share of the optimizer state kept on the CPU"))
    p.add_argument("--global-batch-tokens", type=int, default=128 * 8192,
                   help="tokens per optimizer step (default 128 rows x 8192, both modes)")
    p.add_argument("--engine", choices=[DEFAULT_ENGINE, "openrecipes", "megatron"], default=DEFAULT_ENGINE,
                   help="whose memory and speed to predict, in both modes: openrecipes (this engine: FSDP2 sharding, "
                        "speed calibrated on our H200 runs; a ranking keeps only the layouts it runs), megatron (the "
                        "generic model: Megatron-LM as the seed cards ran it), or auto (default: openrecipes for a "
                        "layout this engine runs, else the generic model; the output says which)")
    p.add_argument("--lora-rank", type=int,
                   help="plan LoRA fine-tuning with adapters of this rank on a frozen base (no weight gradients "
                        "or optimizer state for the base; default: no LoRA)")
    p.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj",
                   help="with --lora-rank: comma-separated targets, as the recipe's lora.targets "
                        "(default: q_proj,k_proj,v_proj,o_proj)")
    p.add_argument("--hardware", help="planner YAML: efficiencies and overheads, optionally extra gpus entries "
                                      "(default: the packaged plan/planner.yaml)")
    price = p.add_mutually_exclusive_group()
    price.add_argument("--usd-per-gpu-hour", type=float, metavar="P",
                       help="price of one GPU-hour for $/1M tokens (default: the GPU's default instance in "
                            "config/hardware.yaml; none there: no price)")
    price.add_argument("--instance", metavar="NAME", help="take the price of this instance from the hardware table")
    p.add_argument("--recipes", type=Path, default=Path("recipes"),
                   help="card catalog a ranking's top layout is compared with (same model and GPUs; default: "
                        "./recipes, skipped when absent)")
    p.add_argument("--bench-results", type=Path, default=Path("bench/results"),
                   help="results of bench/engine_speed.py: with this engine's cards under --recipes, the layouts "
                        "it has run on GPUs; a ranked layout outside them is flagged (default: ./bench/results)")
    p.add_argument("--top", type=int, default=10, help="rows of the ranking to show")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from openrecipes.config.hardware import load_hardware as load_price_table, parse_gpus, resolve_price
    from openrecipes.models.registry import get_config
    from openrecipes.plan.enumerate import capped_note, search
    from openrecipes.plan.gpu_runs import engine_gpu_runs
    from openrecipes.plan.hardware import load_hardware
    from openrecipes.plan.shape import model_shape

    count, gpu_type = parse_gpus(args.gpus)
    hw = load_hardware(gpu_type, path=args.hardware, memory_gib=args.gpu_memory_gib)
    price = resolve_price(load_price_table(), hw.gpu.name, usd_per_gpu_hour=args.usd_per_gpu_hour,
                          instance=args.instance)
    shape = model_shape(get_config(args.model), name=args.model)
    if args.top < 1:
        raise ValueError(f"--top: must be at least 1, got {args.top}")
    for name in (*_LAYOUT_OPTIONS, "max_tokens_per_gpu", "rows_per_microbatch"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be at least 1, got {value}")
    lora = None
    if args.lora_rank is not None:
        from openrecipes.plan.lora import LoraSetup

        targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
        if not targets:  # as a recipe's lora.targets: at least one
            raise ValueError(f"--lora-targets: name at least one module, got {args.lora_targets!r}")
        lora = LoraSetup(rank=args.lora_rank, targets=targets)
    given = {k: getattr(args, k) for k in _LAYOUT_OPTIONS if getattr(args, k) is not None}
    settings = {k: getattr(args, k) for k in DEFAULTS if getattr(args, k) is not None}
    if given or args.sequence_parallel or args.rows_per_microbatch is not None:  # a layout's own field: that layout
        return _one_layout(args, given, settings, count=count, hw=hw, price=price, shape=shape, lora=lora)
    sweep = {k: [settings[k]] if k in settings else list(SWEEPS[k]) for k in DEFAULTS}
    plans, evaluated, valid = search(
        shape, count, hw, max_tokens=sweep["max_tokens_per_gpu"], recompute=sweep["recompute"],
        optimizers=sweep["optimizer"], offloads=sweep["offload_fraction"],
        global_batch_tokens=args.global_batch_tokens, engine=args.engine, lora=lora)
    top = plans[:args.top]
    gaps = _published_gaps(args.recipes, shape, hw, count, plans)
    runs = engine_gpu_runs(args.bench_results, args.recipes)
    ran = [runs.ran(p.layout) if runs.layouts else None for p in top]
    if args.json:
        print(json.dumps({"evaluated": evaluated, "valid": valid, "capped": capped_note(evaluated, valid),
                          "fitting": len(plans),
                          "ranked": [{**p.to_json(), **_price_json(p, price), "run_on_gpus_by_this_engine": r}
                                     for p, r in zip(top, ran)],
                          "published_cards": gaps, "gpu_runs_searched": runs.searched}, indent=2))
        return 0
    _print_ranked(args, top, ran, runs, gaps, evaluated=evaluated, valid=valid, fitting=len(plans), count=count,
                  hw=hw, price=price, shape=shape)
    return 0


def _one_layout(args: argparse.Namespace, given: dict[str, Any], settings: dict[str, Any], *, count: int, hw: Any,
                price: Any, shape: Any, lora: Any) -> int:
    """`plan` with a layout given: that layout's plan alone."""
    from pydantic import ValidationError

    from openrecipes.config.layout import LayoutConfig
    from openrecipes.plan.calibration import speed_error_line
    from openrecipes.plan.enumerate import engine_for, evaluate, offload_update_for
    from openrecipes.plan.memory import TrainingSetup

    tp, pp, cp = given.get("tp", 1), given.get("pp", 1), given.get("cp", 1)
    if "dp" not in given:
        if count % (tp * pp * cp):
            raise ValueError(f"--dp: {count} GPUs are not a multiple of tp*pp*cp = {tp * pp * cp}")
        given["dp"] = count // (tp * pp * cp)
    one = {**DEFAULTS, **settings}
    try:
        layout = LayoutConfig(**given, sequence_parallel=bool(args.sequence_parallel),
                              max_tokens_per_gpu=one["max_tokens_per_gpu"],
                              rows_per_microbatch=args.rows_per_microbatch)
    except ValidationError as error:  # the first problem, named by its flag
        item = error.errors()[0]
        raise ValueError(f"--{str(item['loc'][0]).replace('_', '-')}: {item['msg']}") from None
    if layout.world_size != count:
        raise ValueError(f"dp: tp*pp*cp*dp = {layout.world_size} must equal --gpus count {count}")
    engine = engine_for(layout, args.engine, shape.layout_model())
    setup = TrainingSetup(recompute=one["recompute"], optimizer=one["optimizer"],
                          offload_fraction=one["offload_fraction"], offload_update=offload_update_for(engine),
                          global_batch_tokens=args.global_batch_tokens, engine=engine, lora=lora)
    plan = evaluate(shape, layout, setup, hw)
    if args.json:
        print(json.dumps({**plan.to_json(), **_price_json(plan, price)}, indent=2))
    else:
        _print_plan(plan, shape.name, hw.gpu.name, args.engine, price)
        print(speed_error_line(str(args.bench_results), args.hardware))
    return 0


def _print_ranked(args: argparse.Namespace, top: list[Any], ran: list[bool | None], runs: Any, gaps: list[dict],
                  *, evaluated: int, valid: int, fitting: int, count: int, hw: Any, price: Any, shape: Any) -> None:
    """The ranked table: each layout's prediction, its error on this GPU, its price, whether it ran on GPUs."""
    from openrecipes.plan.calibration import speed_error, speed_error_line
    from openrecipes.plan.enumerate import capped_note
    from openrecipes.plan.published import engine_name

    engines = sorted({p.setup.engine for p in top})
    print(f"{shape.name} on {count}x{hw.gpu.name} ({hw.gpu.memory_gib} GiB): {evaluated:,} valid layout settings, "
          f"{fitting:,} fit; best {len(top)} by predicted tokens/s/GPU "
          f"({'; '.join(f'{e}: {_basis(e)}' for e in engines) or _basis(args.engine)})")
    if capped_note(evaluated, valid):
        print(capped_note(evaluated, valid))
    print(_price_line(price, hw.gpu.name))
    header = f"{'#':>3}  {'layout':<32} {'tok/GPU':>7} {'recompute':<9} {'optimizer':<15} {'offl':>4} " \
             f"{'peak GiB':>8} {'tok/s/GPU':>10} {'error':>6} {'MFU':>6} {'$/1M tok':>8} {'engine':<11} {'on GPUs':<7}"
    print(header)
    measured_error = speed_error(str(args.bench_results), hw.gpu.name, args.hardware)
    for rank, (p, r) in enumerate(zip(top, ran), 1):
        usd = _price_json(p, price)["usd_per_million_tokens"]
        # the engine's worst held-out error on this GPU; the generic model's is not measured
        error = measured_error if p.setup.engine == "openrecipes" else None
        print(f"{rank:>3}  {p.layout.label():<32} {p.layout.max_tokens_per_gpu:>7} {p.setup.recompute:<9} "
              f"{p.setup.optimizer:<15} {p.setup.offload_fraction:>4.1f} {p.peak_memory_gib:>8.1f} "
              f"{p.throughput.tokens_per_s_per_gpu:>10,.1f} {'?' if error is None else f'±{error:.0%}':>6} "
              f"{p.throughput.mfu:>6.1%} "
              f"{'-' if usd is None else f'${usd:.2f}':>8} {engine_name(p.setup.engine):<11} "
              f"{'?' if r is None else 'run' if r else 'never':<7}")
    print(_gpu_runs_line(runs, ran))
    print(speed_error_line(str(args.bench_results), args.hardware))
    for gap in gaps:
        print(gap["why"])


def _gpu_runs_line(runs: Any, ran: list[bool | None]) -> str:
    """What the "on GPUs" column means and what it rests on."""
    if not runs.layouts:
        where = ", ".join(runs.searched) or "no bench results or cards found (--bench-results, --recipes)"
        return f"on GPUs ?: no record of this engine's GPU runs ({where}); no layout checked"
    never = sum(1 for r in ran if r is False)
    return (f"on GPUs: 'never' marks a layout not run on GPUs by this engine ({never} of {len(ran)} shown); its "
            f"GPU runs ({', '.join(runs.searched)}): {', '.join(runs.labels())}")


def _price_json(plan: Any, price: Any) -> dict[str, Any]:
    from openrecipes.config.hardware import usd_per_million_tokens

    if price is None or plan.throughput.tokens_per_s_per_gpu <= 0:
        return {"usd_per_million_tokens": None, "usd_per_gpu_hour": None, "price_source": None}
    return {"usd_per_million_tokens": round(usd_per_million_tokens(price.usd_per_gpu_hour,
                                                                   plan.throughput.tokens_per_s_per_gpu), 4),
            "usd_per_gpu_hour": price.usd_per_gpu_hour, "price_source": price.source}


def _price_line(price: Any, gpu: str) -> str:
    if price is None:
        return (f"$/1M tokens: no public price of {gpu} in config/hardware.yaml: give --usd-per-gpu-hour P (or "
                "--instance NAME)")
    return f"$/1M tokens at {price.usd_per_gpu_hour:g} USD/GPU-hour ({price.source})"


def _published_gaps(recipes: Path, shape: Any, hw: Any, count: int, plans: list[Any]) -> list[dict[str, Any]]:
    """Each published card for this model and GPUs beside the planner: its exact recipe predicted against what it
    measured, and where its layout ranks (``why``: the text)."""
    from openrecipes.plan.published import compare_card, published_cards

    return [compare_card(card, plans, hw, shape) for card in published_cards(recipes, shape.name, hw.gpu.name, count)]


def _print_plan(plan: Any, model: str, gpu: str, asked_engine: str, price: Any) -> None:
    from openrecipes.plan.published import engine_name

    t = plan.throughput
    print(f"{model} on {plan.layout.world_size}x{gpu}: {plan.layout.label()}, {plan.layout.max_tokens_per_gpu} "
          f"tokens/GPU, recompute {plan.setup.recompute}, {plan.setup.optimizer}, offload "
          f"{plan.setup.offload_fraction}")
    print(f"{'stage':>5} {'layers':>6} {'in flight':>9} {'allocated GiB':>13} {'peak GiB':>9}")
    for s in plan.stages:
        print(f"{s.stage:>5} {s.layers:>6} {s.inflight_microbatches:>9} {s.allocated_gib:>13.1f} "
              f"{s.reserved_gib:>9.1f}")
    host = max(plan.stages, key=lambda s: s.host_gib)
    print(f"host memory per rank (stage {host.stage}): {host.host_gib:.1f} GiB ("
          + ", ".join(f"{k} {v:.1f}" for k, v in host.host_parts_gib.items()) + ")")
    verdict = "fits" if plan.fits else "does NOT fit"
    print(f"peak {plan.peak_memory_gib:.1f} GiB of {plan.capacity_gib} GiB: {verdict}")
    print(f"predicted {t.tokens_per_s_per_gpu:,.1f} tokens/s/GPU, MFU {t.mfu:.1%}, step {t.step_time_s:.2f} s, "
          f"{t.microbatches} microbatches, bubble {t.bubble_fraction:.1%} ({_basis(plan.setup.engine)})")
    usd = _price_json(plan, price)["usd_per_million_tokens"]
    print(_price_line(price, gpu) + ("" if usd is None else f": ${usd:.2f}"))
    reason = plan.engine_refusal
    if reason and plan.setup.engine == "openrecipes":
        print(f"openrecipes train cannot run this layout yet: {reason}")
    elif reason and asked_engine == "auto":
        print(f"engine: the generic model, as openrecipes train cannot run this layout yet: {reason}")
    else:
        print(f"engine: {engine_name(plan.setup.engine)}")


def _basis(engine: str) -> str:
    if engine == "openrecipes":
        return "estimates; this engine's TP/CP/offload costs fitted to our H200 runs, see docs/plan.md"
    return "estimates of the generic model, not calibrated for Megatron-LM"
