"""A run's model as the planner sees it, from its configuration on the meta device (no memory, no GPU): the model
built on ``meta``, its analytic per-layer profile with the activations counted from its own forward, its sparsity
masks' bytes and its dtypes. The dry run (``run_plan.py``), ``pd2bw-plan`` and the start-up report read it."""

from __future__ import annotations

from dataclasses import replace


def sparsity_config(cfg):
    """The sparsity group's node, or None for ``sparsity=none`` (a recipe's leftover keys without a
    ``_target_``, e.g. tiny's ``sparsity.sparsity: 0.5``, do not switch it on)."""
    node = cfg.get("sparsity")
    return node if node and "_target_" in node else None


def mask_bytes(cfg, model) -> tuple[float, ...]:
    """Each pipeline layer's sparsity masks, in bytes: one ``bool`` per weight the run's sparsity callback targets
    (``sparsity/masks.py``); empty without one."""
    from hydra.utils import instantiate

    from ..lightning.contract import pipeline_layers_of
    from ..sparsity.masks import select_targets

    sparsity = sparsity_config(cfg)
    if sparsity is None:
        return ()
    callback = instantiate(sparsity)
    targets = {id(p) for p in select_targets(model, callback.targets, callback.exclude).values()}
    return tuple(
        float(sum(p.numel() for p in dict.fromkeys(layer.parameters()) if id(p) in targets))
        for layer in pipeline_layers_of(model)
    )


def build_model_on_meta(cfg):
    """The whole model on the meta device: shapes and parameter counts, no memory."""
    import torch
    from hydra.utils import instantiate

    model = instantiate(cfg.model)
    with torch.device("meta"):
        model.configure_model()
    return model


def analytic_model_profile(cfg, model, micro_batch_size: int, run):
    """The planner's analytic profile of the configured model at ``micro_batch_size`` (FLOPs and bytes) under ``run``
    (its precision and dtypes: the dry run's ``Run``, ``planned_run``'s or a candidate's; None: ``planned_run``)."""
    import torch
    from hydra.utils import instantiate

    from ..engine.partition import layer_parameter_counts
    from ..lightning.contract import pipeline_layers_of
    from ..planner.auto import layer_tensors, shared_layers
    from ..planner.cost import NCCL_GROUP_BYTES, ModelProfile
    from ..planner.hardware import DEVICES
    from ..planner.profile import analytic_profile
    from ..planner.semi_sparse_speedup import speedup_for

    config = instantiate(cfg.model.config)
    layers = pipeline_layers_of(model)
    counts = layer_parameter_counts(layers)
    device = DEVICES[cfg.cluster.device] if cfg.get("cluster") else DEVICES["a100_80g"]
    run = run or planned_run(cfg)
    precision = run.precision
    weight_bytes = precision.parameter_bytes
    profiles = analytic_profile(
        num_blocks=len(layers) - 2,
        hidden=config.n_embd,
        heads=config.n_head,
        vocab=config.vocab_size,
        seq=cfg.data.seq_len,
        micro=micro_batch_size,
        device=device,
        precision=precision.name,
        embedding_parameters=counts[0],
        head_parameters=counts[-1],
        sparse_speedup=speedup_for(device.name) if (sparsity_config(cfg) or {}).get("kernels") else None,
    )
    counted = counted_activations(cfg, model, micro_batch_size, run)
    profiles = [  # what crosses (boundary_dtype) and what the stage keeps of its output (its own dtype)
        replace(layer, activation_bytes=float(c.saved), output_bytes=float(c.sent), kept_output_bytes=float(c.output))
        for layer, c in zip(profiles, counted)
    ]
    optimizer = cfg.model.optimizer
    states = 1 if optimizer == "sgd" else 2
    accelerator = cfg.trainer.get("accelerator", "auto")
    # the run's own devices: CPUs (gloo, foreach AdamW) unless a cluster is planned or a GPU will be used
    on_cpu = not cfg.get("cluster") and (
        accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    )
    layer_states: tuple[float, ...] = ()
    if optimizer == "muon":  # Muon (one state) for the blocks' matrices, AdamW (two) for the rest (models/optim.py)
        layer_states = tuple(
            _muon_states(layer) if 0 < index < len(layers) - 1 else 2.0 for index, layer in enumerate(layers)
        )
    # models/optim.py: fused AdamW on CUDA (no temporaries), foreach on the CPU (one weight-sized set); NAdamW foreach
    temporaries = 1.0 if (optimizer == "adamw" and on_cpu) or optimizer == "nadamw" else 0.0
    return ModelProfile(
        profiles,
        weight_bytes,
        states,
        shared_layers(layers),
        version_bytes=precision.version_bytes(run.weight_dtype),
        communicator_bytes=0.0 if on_cpu else NCCL_GROUP_BYTES,
        layer_states=layer_states,
        optimizer_temporaries=temporaries,
        layer_masks=mask_bytes(cfg, model),
        layer_tensors=layer_tensors(layers),
    )


def counted_activations(cfg, model, micro_batch_size: int, run):
    """Each pipeline layer's saved and output bytes for one microbatch of ``micro_batch_size`` x ``data.seq_len``
    tokens, counted from the model's own forward at ``run``'s precision and weight dtype (None: ``planned_run``;
    ``planner/saved_bytes.py``: fake tensors, nothing allocated). The batch is the project's text batch
    (``input_ids`` and ``labels``)."""
    import torch

    from ..lightning.contract import pipeline_layers_of
    from ..planner.saved_bytes import count_layers

    run = run or planned_run(cfg)
    precision = run.precision
    weight_dtype = precision.parameter_dtype or run.weight_dtype
    autocast = precision.autocast_dtype
    shape = (micro_batch_size, cfg.data.seq_len)

    def loss(output):
        tokens = torch.zeros(shape, dtype=torch.long)  # inside the counter's fake mode: nothing allocated
        return model.pipeline_loss(output, {"input_ids": tokens, "labels": tokens})

    # counted once per model and shape: pd2bw-plan searches each mode over the same micro sizes (a count at 13B takes
    # about a second)
    key = (shape, weight_dtype, autocast, run.boundary_dtype)
    cache = model.__dict__.setdefault("_pd2bw_counted", {})
    if key not in cache:
        first = model.pipeline_inputs({"input_ids": torch.zeros(shape, dtype=torch.long, device="meta")})
        cache[key] = count_layers(
            pipeline_layers_of(model),
            first,
            weight_dtype=weight_dtype,
            autocast_dtype=autocast,
            loss_fn=loss,
            boundary_dtype=run.boundary_dtype,
        )
    return cache[key]


def planned_run(cfg):
    """The run ``cfg`` configures, resolved once with its layout left to the planner (``candidate.planning_run``: its
    options checked, ``"auto"`` dtypes resolved under its precision, as the strategy resolves them)."""
    from ..planner.candidate import planning_run
    from .checks import check_options

    return planning_run(check_options(cfg.strategy), str(cfg.trainer.precision))


def _muon_states(block) -> float:
    """Optimizer states per parameter of a transformer block under ``model.optimizer=muon``: its matrices' one
    momentum buffer, AdamW's two for its norms and biases."""
    params = [p for p in block.parameters() if p.requires_grad]
    total = sum(p.numel() for p in params)
    matrices = sum(p.numel() for p in params if p.dim() == 2)
    return (matrices + 2 * (total - matrices)) / total if total else 0.0
