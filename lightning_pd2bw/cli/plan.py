"""``pd2bw-plan recipe=NAME cluster=NAME [overrides...]``: the planner's table, no GPU needed.

Same recipes and overrides as ``pd2bw-train``; ``cluster`` selects ``conf/cluster/NAME.yaml`` (its
fields can be overridden: ``cluster.num_nodes=16``). The model is built on the meta device (exact
parameter counts, no memory) and profiled analytically for the cluster's device.
"""

from __future__ import annotations

import sys

from .model_profile import analytic_model_profile, build_model_on_meta, planned_run
from .run_plan import cluster_of  # noqa: F401  (re-exported)
from .train import CONF, RECIPES, _select_recipe, recipe_names, setup_hydra


def cluster_names() -> list[str]:
    return sorted(p.stem for p in (CONF / "cluster").glob("*.yaml"))


def _select_cluster(argv: list[str]) -> list[str]:
    out = []
    for arg in argv:
        if arg.startswith("cluster="):
            name = arg.split("=", 1)[1]
            if name not in cluster_names():
                raise SystemExit(f"cluster={name!r} is not a cluster preset; valid: {', '.join(cluster_names())}")
            arg = "+" + arg
        out.append(arg)
    return out


def search_plans(cfg, model, mode: str | None = None, fastest_only: bool = False, top: int | None = None):
    """(those that fit, fastest first; those that do not) for the run's own options (its mode, lookahead and
    delay correction's buffers: ``Candidate.of``) on the configured cluster; ``mode``: that mode at its best plan
    (Flush without a lookahead; the gradients and the placement as the planner weighs them, ``search.gradient_choices``
    and ``placement_choices``, whatever the run set: a recipe's are chosen for its own mode); ``fastest_only``: the
    fastest plan is all that is read, ``top``: the ``top`` fastest (``search``). One search per options and model."""
    from ..planner.candidate import planning_run
    from ..planner.search import search

    run = planned_run(cfg)
    if mode is not None:
        options = run.options
        lookahead = options.lookahead if mode == options.mode or mode == "2bw" else 0
        changed = options.replace(mode=mode, lookahead=lookahead, shard_gradients=None, placement=None)
        run = planning_run(changed, run.precision)
    searched = model.__dict__.setdefault("_pd2bw_searches", {})  # this model's and cfg's, by options
    whole, fastest = (repr(run.options), False, top), (repr(run.options), True, None)
    key = whole if whole in searched or not fastest_only else fastest
    if key not in searched:
        profiles = searched.setdefault("profiles", {})  # one profile per micro size

        def profile_for(micro: int):  # noqa: ANN202
            if micro not in profiles:
                profiles[micro] = analytic_model_profile(cfg, model, micro, run)
            return profiles[micro]

        predicted = searched.setdefault("predicted", {})  # one simulation per candidate and cut
        searched[key] = search(
            profile_for,
            cluster_of(cfg),
            cfg.global_batch_size,
            run,
            fastest_only=key[1],
            predicted=predicted,
            top=key[2],
        )
    return searched[key]


def plan(cfg, limit: int = 10) -> str:
    from ..planner.search import format_table

    cluster, options = cluster_of(cfg), cfg.strategy
    model = build_model_on_meta(cfg)
    total = sum(p.numel() for p in model.parameters())
    fits, too_big = search_plans(cfg, model, top=limit)
    best = fits[0]
    chosen = best.candidate
    lines = [
        f"model: {cfg.model.config.name}, {total / 1e9:.2f}B parameters; sequence {cfg.data.seq_len}; global batch "
        f"{cfg.global_batch_size}; mode={options.mode}; delay_correction={options.delay_correction}; lookahead="
        f"{options.lookahead}; precision={cfg.trainer.precision}",
        f"cluster: {cluster.describe()}",
        f"{len(fits)} configurations fit (of {len(fits) + len(too_big)}), fastest first:",
        format_table(fits, limit),
    ]
    if too_big:
        lines += ["closest that do not fit:", format_table(too_big, 3, fits=False)]
    lines += [
        f"best: width {chosen.width} x depth {chosen.depth}, micro_batch_size {chosen.micro_batch_size}, "
        f"{best.num_microbatches} microbatches, recompute {chosen.recompute}: {best.throughput:.1f} samples/s "
        f"predicted, {best.peak_memory / 2**30:.1f} GiB on the fullest stage",
        f"stages (layers): {' '.join(f'{r.start}-{r.stop - 1}' for r in best.stages)}",
        update_line(cfg, model, best),
        f"train it: pd2bw-train {train_overrides(cluster, best)}",
        mode_choice(cfg, model, options.mode, best.throughput),
    ]
    return "\n".join(lines)


def update_line(cfg, model, best) -> str:
    """What the update (its collectives, the optimizer's step, the gradient reads) adds to the best plan's step, by
    kind (``timing.update_cost``): where the pipeline's own bubble hides it, nothing."""
    from ..planner.timing import update_cost

    profile = analytic_model_profile(cfg, model, best.candidate.micro_batch_size, best.candidate.run)
    added = update_cost(profile, best.candidate, cluster_of(cfg), best.stages, best.num_microbatches)
    step, total = added.pop("step"), added.pop("all")
    kinds = ", ".join(f"{name} {seconds:.3f}" for name, seconds in added.items() if seconds > 0.0005)
    return f"update: it adds {total:.3f} s to the {step:.3f} s step ({total / step:.1%}){': ' * bool(kinds)}{kinds}"


def mode_choice(cfg, model, mode: str, rate: float) -> str:
    """2BW's best planned rate and each synchronous schedule's (Flush, ZB-H1: each at its best plan whatever the run's
    mode, its ``shard_gradients`` and its ``placement``), and the step overhead at which 2BW and the fastest
    synchronous one reach a loss at the same time; a line more where the run's own choices plan its mode slower than
    its best (``rate``: the run's best)."""
    from ..planner.interleaved import VIRTUAL_CHOICES
    from ..planner.search import NoPlanFits
    from ..planner.step_overhead import SYNCHRONOUS, choice_text

    fixed = {
        key: cfg.strategy.get(key) for key in ("shard_gradients", "placement") if cfg.strategy.get(key) is not None
    }
    rates, best = {} if fixed else {mode: rate}, {}  # the run's best is its mode's best
    for each in ("2bw", *SYNCHRONOUS):
        try:
            best[each] = search_plans(cfg, model, each, fastest_only=True)[0][0]
            rates.setdefault(each, best[each].throughput)
        except NoPlanFits:
            if each == mode:
                rates.setdefault(each, rate)
    if "2bw" not in rates or not set(rates) & set(SYNCHRONOUS):
        return (
            f"2BW or a synchronous schedule: no {'2bw' if '2bw' not in rates else 'synchronous'} plan fits this cluster"
        )
    synchronous = {each: rates[each] for each in SYNCHRONOUS if each in rates}
    names = dict(SYNCHRONOUS)
    interleaved = interleaved_at(cfg, model, [best[each] for each in ("flush", "zb_h1", "2bw") if each in best])
    if interleaved is not None and interleaved[1]:
        synchronous["interleaved"], names["interleaved"] = interleaved[0].throughput, INTERLEAVED_NAME
    fastest = max(synchronous, key=synchronous.get)
    text = "synchronous plans: " + ", ".join(
        f"{names[each]} {value:.1f} samples/s" for each, value in synchronous.items()
    )
    if interleaved is not None:
        plan, fits = interleaved
        text += (
            f"\n  {INTERLEAVED_NAME}: {len(plan.stages) // plan.candidate.depth} chunks a rank at width {plan.candidate.width} x depth "
            f"{plan.candidate.depth}, micro {plan.candidate.micro_batch_size} (the fastest of the other plans' layouts "
            f"at {', '.join(map(str, VIRTUAL_CHOICES))} chunks), "
            f"{plan.throughput:.1f} samples/s, {plan.peak_memory / 2**30:.1f} GiB on the fullest rank"
            f"{'' if fits else ' (does not fit: left out)'}"
        )
    text += "\n" + choice_text(
        rates["2bw"], synchronous[fastest], start_rate(cfg, model, best.get("2bw")), names[fastest]
    )
    if rates[mode] > rate * 1.001:
        given = " ".join(f"strategy.{key}={str(value).lower()}" for key, value in fixed.items())
        text += (
            f"\n  this run's {given} plans {mode} at {rate:.1f} samples/s, its best at {rates[mode]:.1f}: "
            f"{' '.join(f'strategy.{key}=null' for key in fixed)} lets the planner choose"
        )
    return text


INTERLEAVED_NAME = "interleaved 1F1B"


def interleaved_at(cfg, model, plans) -> tuple | None:
    """(interleaved 1F1B at the fastest of ``plans``' layouts where it fits, True), else (at the first, False), or
    None (no layout it can run). Each layout is run under Flush's rule (``predict_interleaved``)."""
    from ..planner.interleaved import VIRTUAL_CHOICES, predict_interleaved
    from ..planner.search import MEMORY_HEADROOM

    cluster, found, seen = cluster_of(cfg), [], set()
    for plan in plans:
        candidate = plan.candidate
        flush = candidate.replaced(mode="flush", lookahead=0)
        profile = analytic_model_profile(cfg, model, candidate.micro_batch_size, candidate.run)
        for virtual in VIRTUAL_CHOICES:
            if (repr(flush), virtual) in seen:
                continue
            seen.add((repr(flush), virtual))
            predicted = predict_interleaved(profile, flush, cluster, cfg.global_batch_size, virtual)
            if predicted is not None:
                found.append((predicted, predicted.peak_memory <= cluster.device.memory_bytes * MEMORY_HEADROOM))
    fitting = [item for item in found if item[1]]
    return max(fitting, key=lambda item: item[0].throughput) if fitting else (found[0] if found else None)


def start_rate(cfg, model, plan) -> float | None:
    """The rate of 2BW's synchronous start in 2BW's best plan: its steps simulated as the engine runs them (each
    drained at once: ``program.train_step``), for the verdict."""
    if plan is None:
        return None
    from ..planner.timing import timing

    candidate = plan.candidate
    profile = analytic_model_profile(cfg, model, candidate.micro_batch_size, candidate.run)
    clock = timing(profile, candidate, cluster_of(cfg), plan.stages, plan.num_microbatches, synchronous=True)
    return cfg.global_batch_size / clock.step_time


def recompute_value(recompute: bool | tuple[int, ...]) -> str:
    """``strategy.recompute``'s value as typed: ``true``, ``false`` or ``[3,1,0,0]``."""
    if isinstance(recompute, bool):
        return str(recompute).lower()
    return f"[{','.join(map(str, recompute))}]"


def train_overrides(cluster, best) -> str:
    """The ``pd2bw-train`` overrides that run prediction ``best`` on ``cluster`` (beside the plan's own)."""
    chosen = best.candidate
    gradients = chosen.options.shard_gradients  # chosen by the planner where the run left it to the default
    return (
        f"trainer.num_nodes={cluster.num_nodes} trainer.devices={cluster.devices_per_node} "
        f"strategy.num_stages={chosen.depth} micro_batch_size={chosen.micro_batch_size} "
        f"'strategy.recompute={recompute_value(chosen.recompute)}' "
        f"'strategy.layers_per_stage=[{','.join(str(len(r)) for r in best.stages)}]'"
        + (f" strategy.shard_gradients={str(gradients).lower()}" if gradients is not None else "")
        + (f" strategy.placement={chosen.options.placement}" if chosen.options.placement is not None else "")
    )


def main() -> None:
    import hydra

    from .usage import usage, wants_help

    if wants_help(sys.argv[1:]):
        print(usage("pd2bw-plan", CONF, recipe_names(), cluster_names()))
        return
    setup_hydra()
    sys.argv = [sys.argv[0], *_select_cluster(_select_recipe(sys.argv[1:]))]
    hydra.main(version_base="1.3", config_path=str(RECIPES), config_name="tiny")(_main)()


def _main(cfg) -> None:
    from ..planner.search import NoPlanFits

    try:
        print(plan(cfg))
    except NoPlanFits as error:
        raise SystemExit(f"pd2bw-plan: no plan fits: {error}") from None
    except ValueError as error:
        raise SystemExit(f"pd2bw-plan: {error}") from None


if __name__ == "__main__":
    main()
