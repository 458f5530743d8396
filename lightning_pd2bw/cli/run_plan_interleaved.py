"""The dry run of an interleaved 1F1B run (``strategy.mode=interleaved``): each stage's chunks, layers, parameters
and memory (``planner/interleaved.py``'s rank memory), and with a cluster its planned step and cost."""

from __future__ import annotations


def chunk_cut(cfg, layout, model, profile) -> list[range]:
    """The chunks pd2bw-train runs: ``strategy.layers_per_stage`` (one entry per chunk), else the layers cut into
    ``num_stages x strategy.virtual_stages`` chunks balanced by time (``planner.interleaved.chunks_of``)."""
    from ..engine.layout import ranges_of
    from ..planner.interleaved import chunks_of

    if cfg.strategy.get("layers_per_stage"):
        return ranges_of(list(cfg.strategy.layers_per_stage), len(model.pipeline_layers()))
    return chunks_of(profile, layout.num_stages * layout.run.options.chunks)


def interleaved_lines(cfg, layout, model, candidate, cluster) -> list[str]:
    """The dry run's stage lines and, with ``cluster`` (or None), its step line (see the module's docstring);
    ``candidate``: the planner's for this run (``run_plan.candidate_of``)."""
    from ..planner.hardware import GiB
    from ..planner.interleaved import predict_interleaved, rank_memory
    from .model_profile import analytic_model_profile

    profile = analytic_model_profile(cfg, model, layout.micro_batch_size, layout.run)
    chunks = chunk_cut(cfg, layout, model, profile)
    d, m, virtual = layout.num_stages, layout.num_microbatches, layout.run.options.chunks
    lines = []
    for stage in range(d):
        mine = [chunks[v] for v in range(stage, len(chunks), d)]
        memory = rank_memory(profile, candidate, chunks, stage, m, virtual)
        params = sum(profile.layers[i].parameters for span in mine for i in span)
        spans = ", ".join(f"{span.start}..{span.stop - 1}" for span in mine)
        terms = ", ".join(f"{name} {value / GiB:.2f}" for name, value in memory.items())
        lines.append(
            f"  stage {stage}: chunks of layers {spans}, {params:,} parameters, est. memory "
            f"{sum(memory.values()) / GiB:.2f} GiB ({terms})"
        )
    if cluster is not None:
        planned = predict_interleaved(profile, candidate, cluster, layout.global_batch_size, virtual)
        if planned is not None:
            lines.append(f"plan: {planned.throughput:.1f} samples/s, {planned.batch_time:.3f} s a step (planned)")
    return lines
