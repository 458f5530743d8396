"""Single-process references, written without the engine.

Flush: plain gradient accumulation over every microbatch of every replica, one update per batch.
2BW:   the same averaged gradient, but evaluated at the weights of version max(t-1, 0) counted
       from the last drain, and applied to the newest weights: W(t+1) = W(t) - lr * grad f(W(t-1)).
Delay correction (error feedback): with D(t) the optimizers' update of step t, the weights become
       W(t) + E(t), E(t) = D(t) + (D(t) - D(t-1)) when step t's gradient was stale (not the first step after a
       drain). Predictive error feedback corrects the corrected updates once more: W(t) + E(t) + (E(t) - E(t-1)),
       with E = D at the first step after a drain.
Several optimizers: each steps its own parameters with its own schedule.
"""

from __future__ import annotations

import torch
from torch.func import functional_call

from lightning_pd2bw.engine.partition import balanced_partition, layer_parameter_counts
from lightning_pd2bw.models.optim import scale_learning_rates

from .cases import Case, build_model, mask_for, replica_batch, sparsity_callback


def _split(batch: dict[str, torch.Tensor], count: int) -> list[dict[str, torch.Tensor]]:
    size = len(next(iter(batch.values()))) // count
    return [{k: v[j * size : (j + 1) * size] for k, v in batch.items()} for j in range(count)]


def round_at_stage_boundaries(model: torch.nn.Module, num_stages: int) -> None:
    """Under bf16-mixed the pipeline sends activations (and their gradients) across a stage boundary in
    bfloat16: round the output of each stage's last layer alike (the cut is the strategy's default one)."""
    layers = list(model.pipeline_layers())
    cut = balanced_partition(layer_parameter_counts(layers), num_stages)

    def to_bf16(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output.to(torch.bfloat16) if output.is_floating_point() else output

    for span in cut[:-1]:
        layers[span[-1]].register_forward_hook(to_bf16)


def reference_weights(
    case: Case,
    width: int,
    device: str = "cpu",
    bf16_boundaries: bool = True,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    return reference_run(case, width, device, bf16_boundaries, dtype)[0]


ROUNDING_FACTOR = 4.0  # how much further from float64 a float32 run may be than the float32 reference is
ROUNDING_FLOOR = 1e-6  # float32's rounding of an O(1) weight after a few steps, where nothing amplifies it


def rounding_bounds(case: Case, width: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The rule computed in float64 (exact to far below float32's rounding) and, per tensor, how far a float32 run
    of the same rule may lie from it: ``ROUNDING_FACTOR`` x the float32 reference's own largest distance from it in
    that tensor, and at least ``ROUNDING_FLOOR``.

    Why this is a bound and not one machine's number: the pipeline and the float32 reference do the same float32
    operations in other orders (the stage cut, the replicas' all-reduce, another CPU's matmul kernels: AVX2 or
    AVX512), so their errors against float64 are two samples of one rounding. Where training amplifies rounding
    (AdamW divides a near-zero gradient by its own root mean square, turning its last bits into a step of up to
    ``lr``), both runs show it in the same tensor, and the bound there grows with it; elsewhere it stays at float32's
    scale. A wrong rule moves the weights by far more (each test checks that its wrong rules fail this bound)."""
    exact = reference_weights(case, width, dtype=torch.float64)
    single = reference_weights(case, width)
    bounds = {
        key: max(ROUNDING_FLOOR, ROUNDING_FACTOR * (single[key].double() - value).abs().max().item())
        for key, value in exact.items()
    }
    return exact, bounds


def assert_within_rounding(got: dict[str, torch.Tensor], exact: dict, bounds: dict, label: str = "") -> None:
    assert set(got) == set(exact), f"{label}: every parameter (tied ones under each stage's name) is present"
    for key, value in exact.items():
        distance = (got[key].double() - value).abs().max().item()
        assert distance <= bounds[key], f"{label} {key}: {distance:.3e} from the float64 rule (bound {bounds[key]:.3e})"


def outside_rounding(other: dict[str, torch.Tensor], exact: dict, bounds: dict, margin: float = 3.0) -> bool:
    """Whether weights ``other`` (a wrong rule's) lie clearly outside the bound: the bound tells the rules apart."""
    return any((other[k].double() - v).abs().max().item() > margin * bounds[k] for k, v in exact.items())


def reference_run(
    case: Case,
    width: int,
    device: str = "cpu",
    bf16_boundaries: bool = True,
    dtype: torch.dtype = torch.float32,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Final state dict (on the CPU) and sparsity masks (empty without sparsity); computed on ``device``.
    ``bf16_boundaries``: under bf16-mixed, round at the stage cuts as the pipeline's wire does. One CPU thread, as
    each pipeline rank runs: bfloat16 matmuls round by their summation order, which the thread count changes (a
    reference computed with the test process's threads was 2.7e-3 off in one bias of gpt_2bw_compile_bf16 when
    its test ran alone, and within tolerance after other tests had set one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_run(case, width, device, bf16_boundaries, dtype)
    finally:
        torch.set_num_threads(threads)


def _reference_run(
    case: Case, width: int, device: str, bf16_boundaries: bool, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = build_model(case)
    model.configure_model()  # initialised in float32 (as the pipeline is), then computed in ``dtype``
    model.to(device=device, dtype=dtype)
    if case.precision == "bf16-mixed" and bf16_boundaries:
        round_at_stage_boundaries(model, case.num_stages)
    configured = model.configure_optimizers()
    entries = configured if isinstance(configured, list) else [configured]
    optimizers = [e["optimizer"] if isinstance(e, dict) else e for e in entries]
    sparsity = sparsity_callback(case)  # its schedule and Sparsifier, driven here without Lightning
    if sparsity is not None and sparsity.density_scaling:  # the groups the model builds under a trainer (no schedule)
        params = dict(model.named_parameters())
        scales = {id(params[n]): f for n, f in sparsity.learning_rate_scales(model).items()}
        scale_learning_rates(optimizers, scales)
    for group in (g for optimizer in optimizers for g in optimizer.param_groups):
        # the per-tensor loop: the pipeline's models step with foreach (CPU) or fused (CUDA) kernels
        group.update({k: False for k in ("foreach", "fused") if group.get(k)})
    schedulers = [e["lr_scheduler"]["scheduler"] for e in entries if isinstance(e, dict)]
    names = dict(model.named_parameters())
    masks = {n: m for n, p in names.items() if case.mask and (m := mask_for(n, p)) is not None}

    def apply_masks() -> None:
        with torch.no_grad():
            for n, m in masks.items():
                names[n].mul_(m)

    apply_masks()
    # bf16-mixed with weight_dtype "auto": each version computed in bfloat16 (cast once from the float32 weights the
    # optimizer steps), its gradients added into float32; weight_dtype=None: autocast casts the float32 weights
    mixed = case.precision == "bf16-mixed" and case.weight_dtype is not None
    if sparsity is not None:
        sparsity.sparsifier = sparsity.build(model)
        if mixed and width > 1:  # each master on its owner alone: masks ranked on the bf16 weights every replica holds
            sparsity.sparsifier.score_dtype = torch.bfloat16
        sparsity.end_step_of_run = case.steps  # the runner's trainer.max_steps (SPDF's dense-phase schedule ends there)
        if (change := sparsity.change_at(0)) is not None:
            sparsity.sparsifier.update(0, change, optimizers)
        if sparsity.density_scaling:  # SμPar's initialisation: each masked layer x 1/sqrt(its density)
            with torch.no_grad():
                for name, mask in sparsity.sparsifier.masks.items():
                    names[name].mul_((mask.numel() / mask.sum().item()) ** 0.5)
    first_name = {id(p): n for n, p in names.items()}
    restarted: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # a mask change's positions and values, this step
    if sparsity is not None:  # the correction forgets the history of every entry a mask change set
        sparsity.sparsifier.on_change.append(
            lambda param, positions: restarted.__setitem__(
                first_name[id(param)], (positions, param.detach()[positions].clone())
            )
        )
    canonical = {n: first_name[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    history = [{n: p.detach().clone() for n, p in names.items()}]  # weights after each update
    drain_base = 0
    previous_update: dict[str, torch.Tensor] | None = None  # D(t-1) of the delay correction
    previous_corrected: dict[str, torch.Tensor] | None = None  # E(t-1) (predictive error feedback)
    for step in range(case.steps):
        if step in case.drains:
            drain_base = step
        relative = step - drain_base
        version = drain_base + (max(relative - 1, 0) if case.mode == "2bw" else relative)
        weights = {n: t.to(torch.bfloat16 if mixed else t.dtype, copy=True) for n, t in history[version].items()}
        weights = {n: t.requires_grad_() for n, t in weights.items()}
        if (
            mixed
        ):  # a tied weight's uses are leaves of their own (stages apart), their bfloat16 gradients added in float32
            weights = {n: weights[canonical[n]].detach().clone().requires_grad_() for n in canonical}
        grads = {n: torch.zeros_like(t) for n, t in history[version].items()}
        count = width * case.num_microbatches
        for replica in range(width):
            batch = replica_batch(case, step, replica, width)
            batch = {k: v.to(device, dtype if v.is_floating_point() else v.dtype) for k, v in batch.items()}
            for micro in _split(batch, case.num_microbatches):
                with torch.autocast(
                    torch.device(device).type, dtype=torch.bfloat16, enabled=case.precision == "bf16-mixed"
                ):
                    logits = functional_call(model, weights, (micro["input_ids"],), tie_weights=not mixed)
                    loss = model.pipeline_loss(logits, micro) / count
                for n, g in zip(weights, torch.autograd.grad(loss, list(weights.values()), allow_unused=True)):
                    if g is not None:
                        grads[canonical.get(n, n)] += g
        if step == case.poison_step:  # a NaN loss: the update is skipped, the weights stay, the schedule moves on
            for scheduler in schedulers:
                scheduler.step()
            history.append({n: p.detach().clone() for n, p in names.items()})
            continue
        for n, p in names.items():
            p.grad = grads[n]
        if sparsity is not None:
            sparsity.before_step(optimizers)
        if case.clip and case.clip_algorithm == "value":  # each entry clamped to [-clip, clip]
            torch.nn.utils.clip_grad_value_(model.parameters(), case.clip)
        elif case.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        for optimizer in optimizers:
            lrs = [group["lr"] for group in optimizer.param_groups]
            for group in optimizer.param_groups:  # a mask change's re-warm-up, SPDF's dense phase's own schedule
                if sparsity is not None:
                    group["lr"] = sparsity.learning_rate(
                        sparsity.step, group["lr"], group.get("initial_lr", group["lr"])
                    )
            optimizer.step()
            for group, lr in zip(optimizer.param_groups, lrs):
                group["lr"] = lr
        with torch.no_grad():
            update = {n: p - history[-1][n] for n, p in names.items()}
            for n, (positions, values) in restarted.items():  # D(t) from the values the mask change set, and
                update[n][positions] = names[n][positions] - values  # no history before it at those entries
                for earlier in (previous_update, previous_corrected):
                    if earlier is not None:
                        earlier[n] = earlier[n].masked_fill(positions, 0)
            restarted.clear()
            stale = case.correction and case.mode == "2bw" and relative >= 1 and previous_update is not None
            fed_back = {n: update[n] - previous_update[n] for n in names} if stale else {}  # E(t) - D(t)
            first = {n: update[n] + fed_back[n] for n in fed_back} if stale else update  # E(t)
            if stale and case.correction == "predictive_error_feedback":  # E(t) + (E(t) - E(t-1)) - D(t)
                fed_back = {n: fed_back[n] + (first[n] - previous_corrected[n]) for n in names}
            for n, p in names.items():
                if n in fed_back:
                    p += fed_back[n]
            previous_update, previous_corrected = update, first
        if sparsity is not None:
            sparsity.after_step(optimizers)
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        apply_masks()
        for scheduler in schedulers:
            scheduler.step()
        history.append({n: p.detach().clone() for n, p in names.items()})
    masks = dict(sparsity.sparsifier.masks) if sparsity is not None else {}
    return {k: v.cpu() for k, v in model.state_dict().items()}, masks
