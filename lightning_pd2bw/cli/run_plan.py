"""The plan of a run, read from its configuration on the meta device (no memory, no GPU): the stages the planner
cuts, each stage's parameters and estimated memory (with a warning and its fixes where a stage would not fit the
cluster's device), the batch layout and the data. ``pd2bw-train`` prints it at start-up and, with
``dry_run=true``, only it; ``pd2bw-plan`` profiles the model the same way (``model_profile.py``).
"""

from __future__ import annotations

import torch

from .model_profile import analytic_model_profile, sparsity_config


def plan_text(cfg, layout, model) -> str:
    """What matters at start-up (and all a dry run prints): stages, layers, parameters, batches, memory.

    Stages are cut as the planner cuts them (balanced by estimated time, not parameter count) and
    memory per stage comes from its cost model with the analytic transformer profile.
    """
    from ..engine.options import recomputed_layers
    from ..lightning.contract import pipeline_layers_of
    from ..planner.hardware import GiB

    layers = pipeline_layers_of(model)
    if cfg.strategy.mode == "interleaved":  # each stage's chunks: cli/run_plan_interleaved.py
        from .run_plan_interleaved import interleaved_lines

        cluster = cluster_of(cfg) if cfg.get("cluster") else None
        lines = interleaved_lines(cfg, layout, model, candidate_of(cfg, layout), cluster)
        return "\n".join([*header_lines(cfg, layout, model, layers), *lines])
    profile, stages, memories = stage_plan(cfg, layout, model)
    lines = header_lines(cfg, layout, model, layers)
    if (sparsity := sparsity_config(cfg)) is not None:
        masks = [memory.get("masks", 0.0) for memory in memories]
        grouped = "n" in sparsity and "m" in sparsity  # N:M semi-structured
        fraction = 1 - sparsity.n / sparsity.m if grouped else sparsity.sparsity
        kind = (
            _semi_structured_time(cfg, sparsity)
            if grouped
            else "unstructured: fewer FLOPs on paper, no GPU time saved (dense kernels multiply the zeros)"
        )
        lines.append(
            f"sparsity: {sparsity._target_.rsplit('.', 1)[-1]} to {fraction:.0%} of the targets; masks "
            f"{max(masks) / 2**20:,.1f} MiB on the fullest stage (one byte per targeted weight); {kind}"
        )
    recompute = layout.run.options.recompute
    for stage, (span, memory) in enumerate(zip(stages, memories)):
        params = sum(profile.layers[i].parameters for i in span)
        terms = ", ".join(f"{name} {value / GiB:.2f}" for name, value in memory.items())
        again = recomputed_layers(recompute, stage, len(span))
        rebuilt = f", the first {again} recomputed" if again and not isinstance(recompute, bool) else ""
        fullest = " of its fullest replica" if layout.run.width > 1 else ""  # owners step whole tensors (candidate.py)
        lines.append(
            f"  stage {stage}: layers {span.start}..{span.stop - 1}{rebuilt}, {params:,} parameters, est. memory"
            f"{fullest} {sum(memory.values()) / GiB:.2f} GiB ({terms})"
        )
    fewest = fewest_recomputed_for(cfg, layout, profile, stages, memories)
    lines += memory_warnings(cfg, layout.run, memories, fewest, stages)
    step_s = planned_step_s(cfg, layout, profile, stages)
    if step_s is not None:
        lines.append(throughput_text(cfg, layout, model, step_s, profile))
    start = planned_start(cfg, layout, profile, stages)
    if cfg.strategy.mode == "2bw":
        lines.append(sync_start_text(cfg, start, step_s))
    cost = checkpoint_cost(cfg, layout, profile, stages, memories, step_s)
    lines += [cost.describe(), cost.preemption_text()] if step_s is not None else [cost.describe()]
    lines.append(training_cost_text(cfg, layout, step_s, start))
    return "\n".join(lines)


def header_lines(cfg, layout, model, layers) -> list[str]:
    """The dry run's model, layout, batch and data lines."""
    total = sum(p.numel() for p in model.parameters())
    return [
        f"model: {type(model).__name__} {cfg.model.config.name}: {total:,} parameters ({total / 1e9:.2f}B), "
        f"{len(layers)} pipeline layers",
        f"layout: {layout.world_size} processes = {layout.num_stages} stages x {layout.data_parallel_size} replicas; "
        f"mode={cfg.strategy.mode}{_lookahead(cfg)} recompute={cfg.strategy.recompute} precision={cfg.trainer.precision}",
        f"batch: global {layout.global_batch_size} = {layout.data_parallel_size} replicas x "
        f"{layout.num_microbatches} microbatches x {layout.micro_batch_size} sequences; "
        f"tokens per step = {layout.global_batch_size} x {layout.seq_len} = {layout.tokens_per_step:,}",
        data_text(cfg),
    ]


def sync_start_text(cfg, start: tuple[int, float | None], step_s: float | None) -> str:
    """``sync start:`` 2BW's first steps, each drained after its update (``start``: their count and their planned
    time, simulated as the engine runs them in 2BW's own layout), their share of the run and, with a cluster, their
    time against 2BW's."""
    (steps, start_s), total = start, cfg.trainer.get("max_steps")
    share = f" of {total:,} ({steps / total:.2%})" if total and total > 0 else ""
    text = f"sync start: {steps:,} steps{share} at Flush's rule (strategy.sync_steps; 0: none), each drained"
    if step_s is None or start_s is None or not steps:
        return text + "; their time needs a cluster (+cluster=NAME)" if steps else text
    extra = steps * (start_s - step_s)
    return (
        f"{text}: {start_s:.2f} s a step in this layout against 2BW's {step_s:.2f} s, {extra / 3600:,.2f} hours "
        "more than 2BW from the first step (planned)"
    )


def planned_start(cfg, layout, profile, stages) -> tuple[int, float | None]:
    """2BW's synchronous start: its steps (0 under another mode) and, on a cluster, one step's planned seconds."""
    from .run_length import sync_steps_of

    steps = sync_steps_of(cfg) if cfg.strategy.mode == "2bw" else 0
    if not steps or not cfg.get("cluster"):
        return steps, None
    from ..planner.timing import timing

    candidate = candidate_of(cfg, layout)
    m = candidate.num_microbatches(layout.global_batch_size)
    return steps, timing(profile, candidate, cluster_of(cfg), stages, m, synchronous=True).step_time


def training_cost_text(cfg, layout, step_s: float | None, start: tuple[int, float | None] = (0, None)) -> str:
    """``cost:`` the whole run at ``trainer.max_steps``: its tokens, the tokenized corpus one epoch of them needs
    (``pd2bw-prepare-data``'s ids: uint16 up to 65,536 words, else uint32) and, with a cluster, the planned days and
    GPU-hours."""
    from .checks import vocab_of

    steps = cfg.trainer.get("max_steps")
    if not steps or steps < 0:
        return "cost: trainer.max_steps is not set (epochs): the run's length, and so its cost, is the data's"
    tokens = steps * layout.tokens_per_step
    data = f"{tokens / 1e9:,.2f}B tokens" if tokens >= 1e9 else f"{tokens:,} tokens"
    if str(cfg.data.get("_target_", "")).endswith("TokenDataModule"):
        corpus = tokens * (2 if vocab_of(cfg.model) <= 1 << 16 else 4)
        data += f", {corpus / 1e9:,.1f} GB tokenized for one epoch" if corpus >= 1e9 else f", {corpus / 1e6:,.1f} MB"
    if step_s is None:
        return f"cost: {steps:,} steps (trainer.max_steps) = {data}; the time needs a cluster (+cluster=NAME)"
    fresh, start_s = start
    fresh = min(fresh, steps) if start_s is not None else 0
    seconds = (steps - fresh) * step_s + fresh * (start_s or 0.0)
    started = f"; its sync start's {fresh:,} at {start_s:.2f} s" if fresh else ""
    return (
        f"cost: {steps:,} steps (trainer.max_steps{started}) x {step_s:.2f} s = {seconds / 86400:,.1f} days on "
        f"{layout.world_size} devices, {seconds * layout.world_size / 3600:,.0f} device-hours (planned, never run); "
        f"{data}"
    )


def planned_step_s(cfg, layout, profile, stages) -> float | None:
    """The planner's step time for this run on the configured cluster (``+cluster=NAME``), else None."""
    if not cfg.get("cluster"):
        return None
    from ..planner.cost import predict

    candidate = candidate_of(cfg, layout)
    return predict(profile, candidate, cluster_of(cfg), layout.global_batch_size, stages).batch_time


def throughput_text(cfg, layout, model, step_s: float, profile) -> str:
    """``plan: N samples/s ...``: the planned rate, its MFU (model FLOPs per token as ``RunMetrics`` counts them) and
    its fraction of the ideal: every device computing the model's layers at the run's micro size, nothing else
    (no bubble, no communication, no update)."""
    cluster = cluster_of(cfg)
    samples = layout.global_batch_size / step_s
    flops = getattr(model, "flops_per_token", None)
    mfu = ""
    if flops is not None:
        achieved = samples * layout.seq_len * flops()
        mfu = f", {achieved / (layout.world_size * cluster.device.peak_flops):.1%} MFU"
    compute = sum(layer.forward_s + layer.backward_s for layer in profile.layers)
    ideal = layout.world_size * layout.micro_batch_size / compute
    device = cluster.device
    return (
        f"plan: {samples:.1f} samples/s ({step_s:.2f} s per step{mfu}, {samples / ideal:.2f} of the ideal "
        f"{ideal:.1f}) on {cluster.name}, the engine's actions simulated, each GEMM and memory pass on the device's "
        f"roofline ({device.efficiency:.0%} of peak FLOPs, {device.memory_efficiency:.0%} of the bandwidth; "
        "pd2bw-plan ranks the alternatives)"
    )


def cluster_of(cfg):
    """The configured ``cluster`` group as the planner's ``ClusterSpec``."""
    from ..planner.hardware import ClusterSpec, device_spec

    if not cfg.get("cluster"):
        raise ValueError("choose a cluster: cluster=NAME, NAME a file of conf/cluster/ (pd2bw-plan --help lists them)")
    c = cfg.cluster
    return ClusterSpec(
        device_spec(c.device),
        c.num_nodes,
        c.devices_per_node,
        c.intra_node_bandwidth,
        c.inter_node_bandwidth,
        c.latency,
        name=c.name,
    )


def checkpoint_cost(cfg, layout, profile, stages, memories, step_s: float | None = None):
    """What a save costs this run (``planner/checkpoint_cost.py``): each rank stages its float32 weights and its
    optimizer share; the step time is the planner's on the configured cluster, where there is one."""
    from ..planner.checkpoint_cost import CheckpointCost

    weight_bytes = profile.weight_bytes
    ranks = [
        sum(profile.layers[i].parameters for i in span) * weight_bytes + m["optimizer"]
        for span, m in zip(stages, memories)
    ]
    # the optimizer's bytes over a stage's replicas: sharded, one copy of the stage's states split among them
    # (``optimizer_share`` is 1/w); unsharded, each replica a whole copy
    candidate, width = candidate_of(cfg, layout), layout.data_parallel_size

    def states(span: range) -> float:  # the stage's optimizer states, once (a tensor the stage holds twice: once)
        params = sum(profile.layers[i].parameters for i in span)
        params -= sum(n for a, b, n in profile.shared if a in span and b in span)
        per_parameter = profile.states_of(span)
        return (profile.optimizer_states if per_parameter is None else per_parameter) * params * weight_bytes

    total = sum(
        r - m["optimizer"] + states(span) * candidate.optimizer_share * width
        for r, m, span in zip(ranks, memories, stages)
    )
    node = (cfg.get("callbacks") or {}).get("model_checkpoint")
    interval = node.get("every_n_train_steps") if node and cfg.trainer.get("enable_checkpointing", True) else None
    accelerator = cfg.trainer.get("accelerator", "auto")
    device = "cpu" if accelerator == "cpu" and not cfg.get("cluster") else "cuda"
    return CheckpointCost(
        max(ranks), total, layout.world_size, interval, step_s, bool(cfg.strategy.get("async_checkpoint")), device
    )


def stage_plan(cfg, layout, model):
    """(the analytic profile, the stages, each stage's memory terms) of this run, as the planner computes them for
    the same options (``candidate_of``): what ``pd2bw-plan`` predicts for the configuration it proposes."""
    from ..planner.cost import stage_memory

    profile = analytic_model_profile(cfg, model, layout.micro_batch_size, layout.run)
    candidate = candidate_of(cfg, layout)
    stages = planned_stages(cfg, layout, model, profile)
    memories = [stage_memory(profile, span, s, candidate, layout.num_microbatches) for s, span in enumerate(stages)]
    return profile, stages, memories


def fewest_recomputed_for(cfg, layout, profile, stages, memories) -> tuple[int, ...] | None:
    """Where a stage of this run does not fit its cluster's device and nothing recomputes: per stage, the fewest of
    its first layers to recompute that make every stage fit (``planner.search.fewest_recomputed``), or None."""
    from ..planner.hardware import DEVICES
    from ..planner.search import MEMORY_HEADROOM, fewest_recomputed

    if not cfg.get("cluster") or layout.run.options.recompute is not False:
        return None
    usable = DEVICES[cfg.cluster.device].memory_bytes * MEMORY_HEADROOM
    if all(sum(memory.values()) <= usable for memory in memories):
        return None
    chosen = fewest_recomputed(profile, candidate_of(cfg, layout), layout.num_microbatches, usable, stages)
    return chosen.recompute if chosen is not None else None  # type: ignore[return-value]


def memory_warnings(
    cfg,
    run,
    memories: list[dict[str, float]],
    per_stage: tuple[int, ...] | None = None,
    stages: list[range] | None = None,
) -> list[str]:
    """A warning, with the fix, for each stage whose estimate exceeds what the cluster's device offers
    (``run``: the resolved run, whose options say which correction applies; ``per_stage``: the fewest first layers
    per stage whose recomputation makes every stage fit with this cut, ``stages``, where some do; the fix names the
    cut too, since with recomputation the planner would cut anew)."""
    from ..engine.updates.delay_correction import buffers as correction_buffers
    from ..planner.hardware import DEVICES, GiB
    from ..planner.search import MEMORY_HEADROOM

    if not cfg.get("cluster"):
        return []
    device = DEVICES[cfg.cluster.device]
    usable = device.memory_bytes * MEMORY_HEADROOM
    out = []
    for stage, memory in enumerate(memories):
        need = sum(memory.values())
        if need > usable:
            held = correction_buffers(run.options.applied_delay_correction)
            buffer = memory.get("correction", 0.0) / held if held else 0.0
            fixes = ["more stages (strategy.num_stages)"]
            if per_stage is not None:  # the fewest that fit, first: recomputing less costs less time
                counts = ",".join(map(str, per_stage))
                cut = f"'strategy.layers_per_stage=[{','.join(str(len(r)) for r in stages)}]' " if stages else ""
                fixes.append(
                    f"{cut}'strategy.recompute=[{counts}]' (per stage, the fewest first layers that make it fit)"
                )
            fixes += [] if cfg.strategy.recompute else ["strategy.recompute=true"]
            fixes += ["a smaller micro_batch_size"] if cfg.get("micro_batch_size", 1) > 1 else []
            if held > 1:
                fixes.append(f"strategy.delay_correction=error_feedback (saves {buffer / GiB:.2f} GiB)")
            if held:  # its buffers and D(t) while updating
                fixes.append(f"strategy.delay_correction=null (saves {(held + 1) * buffer / GiB:.2f} GiB)")
            out.append(
                f"WARNING: stage {stage} needs an estimated {need / GiB:.2f} GiB, more than the {usable / GiB:.1f} GiB "
                f"usable on {device.name} ({MEMORY_HEADROOM:.0%} of {device.memory_bytes / GiB:.0f} GiB): it would "
                f"run out of memory. Fixes: {'; '.join(fixes)}"
            )
    return out


def data_text(cfg) -> str:
    """What the run reads, and for a tokenized corpus whether it is there and how to prepare it."""
    if not str(cfg.data.get("_target_", "")).endswith("TokenDataModule"):
        source = cfg.data.get("hf_dataset") or cfg.data.get("paths") or "the embedded corpus (bytes)"
        return f"data: {source}"
    from ..data.tokens import INDEX, read_index
    from .checks import vocab_of

    path = cfg.data.path
    vocab = vocab_of(cfg.model)
    try:
        index = read_index(path)
    except FileNotFoundError:
        return (
            f"data: a tokenized corpus at data.path={path} (not there: no {INDEX}). Prepare it with: "
            f"pd2bw-prepare-data {path} YOUR_TEXT_FILES_OR_DIRS --vocab-size {vocab} (or --tokenizer tokenizer.json)"
        )
    return (
        f"data: {index['tokens']:,} tokens at {path} ({index['dtype']}, vocabulary {index['vocab_size']:,}; the "
        f"model's {vocab:,})"
    )


def _lookahead(cfg) -> str:
    """`` lookahead=N`` where it is set (the dry run's layout line)."""
    lookahead = cfg.strategy.get("lookahead", 0)
    return f" lookahead={lookahead}" if lookahead else ""


def candidate_of(cfg, layout):
    """The planner's candidate for this run: its options (``Candidate.of``, as ``pd2bw-plan`` and ``plan="auto"``
    read them) on the layout's width, depth and microbatch size."""
    from ..planner import Candidate

    run = layout.run
    return Candidate.of(run, run.width, run.num_stages, layout.micro_batch_size)


def planned_stages(cfg, layout, model, profile=None) -> list[range]:
    """The stages pd2bw-train runs: ``strategy.layers_per_stage``, else the planner's cut balanced by time
    (``profile``: the model's analytic profile where the caller has it)."""
    from ..engine.layout import ranges_of
    from ..planner.search import partition

    if cfg.strategy.get("layers_per_stage"):
        return ranges_of(list(cfg.strategy.layers_per_stage), len(model.pipeline_layers()))
    profile = profile or analytic_model_profile(cfg, model, layout.micro_batch_size, layout.run)
    if cfg.strategy.mode == "interleaved":  # num_stages x 2 chunks
        from .run_plan_interleaved import chunk_cut

        return chunk_cut(cfg, layout, model, profile)
    stages = partition(profile, candidate_of(cfg, layout), layout.num_microbatches, float("inf"))
    if stages is None:  # check_run refuses this first; kept so that no caller iterates None
        raise ValueError(
            f"no cut of the model's {len(model.pipeline_layers())} pipeline layers into {layout.num_stages} stages "
            "leaves every stage a layer: use fewer strategy.num_stages or a deeper model"
        )
    return stages


def _semi_structured_time(cfg, sparsity) -> str:
    """What N:M sparsity saves of the step: with ``kernels``, the planned time at the measured factors."""
    from ..planner.semi_sparse_speedup import measured

    transposable = sparsity.get("kernels") if sparsity.get("transposable") is None else sparsity.get("transposable")
    pattern = f"{sparsity.n}:{sparsity.m} semi-structured{' (transposable)' if transposable else ''}"
    if not sparsity.get("kernels"):
        return f"{pattern}: fewer FLOPs on paper; GPU time is saved only with sparsity.kernels=true (the 2:4 kernels)"
    device = cfg.cluster.device if cfg.get("cluster") else None
    factors = measured(device) if device else {}
    timed = (
        f"planned at their speed-up measured on {device} for {len(factors)} GEMM shapes (1.0 for the others)"
        if factors
        else "planned at 1.0x: no speed-up measured (make gpu-sparse measures it)"
    )
    refused = _kernels_refused(cfg)
    return f"{pattern}: the final mask's forward and input-gradient GEMMs on the 2:4 kernels, {timed}" + (
        f"\nWARNING: the run refuses the 2:4 kernels here: {refused}; sparsity.kernels=false runs the masks alone"
        if refused
        else ""
    )


def _kernels_refused(cfg) -> str | None:
    """Why the run would refuse ``sparsity.kernels=true`` before its first step, where the configuration alone says
    (``sparsity/semi_sparse.py``'s refusal: a CUDA device and a 16-bit compute dtype)."""
    from ..engine.precision import Precision

    dtype = Precision.of(cfg.trainer.get("precision", "32-true")).compute_dtype
    if dtype not in (torch.bfloat16, torch.float16):
        return f"trainer.precision={cfg.trainer.get('precision')} computes in {dtype}; the kernels take bfloat16"
    on_gpu = cfg.get("cluster") is not None or (
        cfg.trainer.get("accelerator", "auto") in ("gpu", "cuda", "auto") and torch.cuda.is_available()
    )
    return None if on_gpu else "no CUDA device (a CPU run); the kernels need compute capability 8.0 or later"
