"""Training cases shared by the distributed runner and the single-process reference.

A case fixes the model, optimizer, data and schedule; the runner trains it with
``Trainer(strategy=PipeDream2BWStrategy(...))`` over real processes, the reference
(``reference.py``) computes the expected weights in one process without the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader

from lightning_pd2bw.data import LMDataset, MLMDataset, read_corpus
from lightning_pd2bw.engine.sync_start import sync_start_steps
from lightning_pd2bw.models import BERT, GPT, BERTConfig, GPTConfig

SEQ_LEN = 16
MICRO_BATCH = 2


@dataclass(frozen=True)
class Case:
    """One training run; ``bf16_update`` cases are compared at bf16 tolerance (see ``test_equivalence``)."""

    name: str
    model: str = "gpt"  # gpt | bert
    mode: str = "flush"
    num_stages: int = 2
    num_microbatches: int = 2
    virtual_stages: int | None = None  # interleaved: chunks a stage (None: 2)
    width: int = 1  # data-parallel replicas: the case runs on num_stages x width processes
    optimizer: str = "adamw"
    momentum: float = 0.0
    steps: int = 4
    clip: float | None = None
    clip_algorithm: str = "norm"  # Lightning's gradient_clip_algorithm: "norm" (over the whole model) or "value"
    schedule: bool = False  # warm-up + cosine learning-rate schedule
    recompute: bool | tuple[int, ...] = False  # per stage: its first layers recomputed
    checkpoint_every: int | None = None  # drain + checkpoint every N steps (2BW restarts its versions)
    mask: bool = False  # a fixed sparsity mask applied by an optimizer step post-hook
    steps_per_epoch: int | None = None  # limit_train_batches: epochs restart the sampler's shuffle
    sparsity: str | None = None  # a key of SPARSITY: a lightning_pd2bw.sparsity callback
    micro_batch: int = MICRO_BATCH  # samples per microbatch (the reference groups its gradients the same way)
    plan: str | None = None  # "auto": the planner picks depth, width, microbatches (global batch = the loader's)
    poison_step: int | None = None  # this batch's loss is NaN; on_nonfinite="skip" drops its update everywhere
    precision: str = "32-true"  # "bf16-mixed": CPU autocast; the reference autocasts each microbatch alike
    # under bf16-mixed, "auto": the weights' versions in bfloat16 over a float32 master (None: autocast casts them)
    weight_dtype: str | None = "auto"
    val_every: int | None = None  # validate (2 batches) every N steps: the pipeline drains, then evaluates
    correction: str | None = (
        None  # the delay_correction (2BW), e.g. "error_feedback": W(t+1) = W(t) + D(t) + (D(t) - D(t-1))
    )
    async_checkpoint: bool = False  # checkpoints written in the background (DCP async_save over a gloo group)
    lookahead: int = 0  # more forwards in flight before the last stage: same update rule, one more stash each
    compile: bool = False  # compile={"backend": "aot_eager"}: dynamo + AOTAutograd per layer (inductor: test_compile)
    # width > 1: each gradient reduced to its owner (engine/updates/grad_buckets.py); None: the strategy's default (on)
    shard_gradients: bool | None = None
    sync_steps: int | None = 0  # 2BW's synchronous start: N first steps drained; None: engine/sync_start.py's rule
    epochs: int | None = None  # the trainer bounded by max_epochs (max_steps=-1): steps = epochs x steps_per_epoch
    placement: str = "pipeline"  # "replicas": a stage's replicas on consecutive ranks (layout.Placement)
    resume_mode: str | None = None  # the resume (``checkpoint_every``) runs this schedule instead of ``mode``

    @property
    def bf16_update(self) -> bool:
        """bf16 arithmetic inside the update: autocast. (Muon was one until 2026-11-24: torch's Newton-Schulz runs in
        bfloat16, where a float32 rounding difference in a gradient can flip a bf16 rounding; the models' Muon now
        iterates in float32 on the CPU, so its cases are held to float32's tolerance.)"""
        return self.precision != "32-true"

    @property
    def world(self) -> int:
        return self.num_stages * self.width

    @property
    def start(self) -> int:
        """The synchronous start's steps: ``sync_steps``, or the default rule at the run's length."""
        return sync_start_steps(self.steps) if self.sync_steps is None else self.sync_steps

    @property
    def periodic_drains(self) -> tuple[int, ...]:
        """The steps after which validation or a checkpoint drains the pipeline."""
        every = self.checkpoint_every or self.val_every
        return tuple(range(every, self.steps, every)) if every else ()

    @property
    def drains(self) -> tuple[int, ...]:
        """The steps that follow a drain (their gradient is of the newest weights)."""
        started = range(1, min(self.start, self.steps - 1) + 1)  # after each of the first sync_steps steps
        return tuple(sorted({*self.periodic_drains, *started}))


PREDICTIVE = "predictive_error_feedback"


def blocks_of(case: Case) -> int:
    """The GPT's blocks: 3 (5 pipeline layers), 6 where interleaved 1F1B needs more than 5 chunks."""
    return 6 if case.mode == "interleaved" and case.num_stages * (case.virtual_stages or 2) > 5 else 3


def build_model(case: Case, epochs_bounded: bool = False):
    """``epochs_bounded``: the model as a Lightning user builds it for a run bounded by epochs (``max_steps=-1``: the
    schedule's length from the trainer); the reference passes the count."""
    optim = dict(
        optimizer=case.optimizer,
        lr=0.05 if case.optimizer == "sgd" else 3e-3,
        momentum=case.momentum,
        weight_decay=0.01,
        warmup_steps=2 if case.schedule else 0,
        max_steps=(-1 if epochs_bounded else case.steps) if case.schedule else None,
    )
    n_layer = blocks_of(case)
    if case.model == "gpt":
        return GPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=16, block_size=SEQ_LEN), **optim)
    return BERT(BERTConfig(n_layer=n_layer, n_head=2, n_embd=16, block_size=SEQ_LEN), **optim)


def dataset(case: Case):
    data = read_corpus(max_bytes=50_000)
    return LMDataset(data, SEQ_LEN) if case.model == "gpt" else MLMDataset(data, SEQ_LEN, seed=3)


def dataloader(case: Case) -> DataLoader:
    return DataLoader(dataset(case), batch_size=case.micro_batch * case.num_microbatches, shuffle=False, drop_last=True)


def replica_batch(case: Case, step: int, replica: int, width: int) -> dict[str, torch.Tensor]:
    """Replica ``replica``'s batch of ``step``, dealt as the DistributedSampler that Lightning injects for
    training does: a permutation seeded by the epoch (seed 0 + epoch), padded, every ``width``-th index."""
    data = dataset(case)
    epoch, step = divmod(step, case.steps_per_epoch) if case.steps_per_epoch else (0, step)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch)).tolist()
    total = -(-len(order) // width) * width
    shard = (order + order[: total - len(order)])[replica:total:width]
    size = case.micro_batch * case.num_microbatches
    items = [data[i] for i in shard[step * size : (step + 1) * size]]
    return {k: torch.stack([item[k] for item in items]) for k in items[0]}


def mask_for(name: str, param: torch.Tensor) -> torch.Tensor | None:
    """The fixed mask of the hook-order test: every other entry of each block's fc weight."""
    if ".fc.weight" not in name:
        return None
    mask = torch.ones_like(param, dtype=torch.bool)
    mask.view(-1)[::2] = False
    return mask


def sparsity_callback(case: Case):
    """A fresh sparsity callback for the case (the runner's and the reference's are built alike)."""
    from lightning_pd2bw.sparsity import GradualMagnitudeSparsity, RigL, SemiStructuredSparsity, StaticSparsity

    builders = {
        # global threshold across stages, pruning while 2BW versions are in flight, the rate re-warmed after each
        "gmp_global": lambda: GradualMagnitudeSparsity(
            0.6, start_step=1, end_step=4, update_interval=2, allocation="global", rewarmup_steps=2
        ),
        "gmp_uniform": lambda: GradualMagnitudeSparsity(
            0.6, start_step=0, end_step=5, update_interval=1, shape="linear"
        ),
        "rigl_erk": lambda: RigL(0.5, end_step=5, update_interval=2, drop_fraction=0.3, allocation="erk"),
        "static_random": lambda: StaticSparsity(0.75, init="random", seed=7),
        # SμPar: per-layer densities (ERK), each layer's own AdamW group at rate / density, init / sqrt(density)
        "static_supar": lambda: StaticSparsity(0.75, init="random", seed=7, allocation="erk", density_scaling=True),
        # the dense phase with its own learning-rate schedule (dense_lr), the rate re-warmed on top
        "spdf": lambda: StaticSparsity(0.5, init="magnitude", dense_from_step=3, rewarmup_steps=2, dense_lr=2.0),
        # mask changes within two updates of each other: the delay correction's history must restart at each
        # (a weight dropped and grown again, or pruned and made dense, restarts from zero, not from its old value)
        "rigl_every_step": lambda: RigL(0.5, end_step=5, update_interval=1, drop_fraction=0.3, allocation="erk"),
        # 2:4 by magnitude, gradually (3 of 4 at step 1, 2 of 4 from step 2), while 2BW's versions are in flight
        "n_of_m": lambda: SemiStructuredSparsity(n=2, m=4, start_step=1, end_step=3, update_interval=1),
        # the same, transposable (2 of 4 in each row and column of every 4 x 4 tile: the kernels' masks)
        "n_of_m_transposable": lambda: SemiStructuredSparsity(
            start_step=1, end_step=3, update_interval=1, transposable=True
        ),
        "dense_right_after_pruning": lambda: GradualMagnitudeSparsity(
            0.6, start_step=0, end_step=2, update_interval=1, dense_from_step=3
        ),
    }
    return builders[case.sparsity]() if case.sparsity else None


CASES = {
    c.name: c
    for c in [
        Case("gpt_flush_sgd", optimizer="sgd"),
        Case("gpt_flush_adamw_clip_sched", num_microbatches=4, clip=0.5, schedule=True),
        Case("bert_flush_adamw", model="bert"),
        Case("gpt_2bw_sgd_momentum", mode="2bw", optimizer="sgd", momentum=0.9, steps=5),
        Case("gpt_2bw_adamw_clip_sched", mode="2bw", num_microbatches=4, clip=0.5, schedule=True, steps=5),
        Case("bert_2bw_adamw", mode="2bw", model="bert", steps=5),
        Case("gpt_2bw_recompute", mode="2bw", recompute=True, steps=5),
        Case("gpt_2bw_recompute_per_stage", mode="2bw", recompute=(2, 1), steps=5, clip=0.5),
        Case("gpt_2bw_mask", mode="2bw", optimizer="sgd", momentum=0.9, mask=True, steps=5),
        Case("gpt_2bw_drain", mode="2bw", steps=6, checkpoint_every=3, steps_per_epoch=3),
        Case("gpt_flush_d4_sgd", num_stages=4, num_microbatches=4, optimizer="sgd"),
        Case("gpt_2bw_d4_adamw", mode="2bw", num_stages=4, num_microbatches=4, steps=5, clip=0.5),
        Case("gpt_flush_d2w2_adamw", width=2, schedule=True),
        Case("gpt_2bw_d2w2_adamw", width=2, mode="2bw", steps=5, clip=0.5),
        Case("gpt_2bw_d2w2_replicas_together", width=2, mode="2bw", steps=5, clip=0.5, placement="replicas"),
        Case("gpt_2bw_sparse_gmp_global", mode="2bw", steps=5, clip=0.5, sparsity="gmp_global"),
        Case("gpt_flush_sparse_rigl_erk", optimizer="sgd", momentum=0.9, steps=5, sparsity="rigl_erk"),
        Case("gpt_2bw_sparse_spdf", mode="2bw", steps=5, sparsity="spdf", schedule=True),
        Case(
            # SGD: grown weights move by their gradients (AdamW's first step from zero is lr x sign for every grown
            # weight: equal magnitudes, whose order at the next drop rounding would decide)
            "gpt_2bw_sparse_rigl_every_step_pef",
            mode="2bw",
            optimizer="sgd",
            momentum=0.9,
            steps=6,
            sparsity="rigl_every_step",
            correction=PREDICTIVE,
        ),
        Case(
            "gpt_2bw_sparse_dense_after_pruning_ef",
            mode="2bw",
            steps=6,
            sparsity="dense_right_after_pruning",
            correction="error_feedback",
        ),
        Case(
            "gpt_2bw_sparse_resume", mode="2bw", steps=6, checkpoint_every=3, steps_per_epoch=3, sparsity="gmp_uniform"
        ),
        Case("gpt_2bw_d2w2_sparse_static", width=2, mode="2bw", steps=5, sparsity="static_random"),
        Case("gpt_2bw_sparse_2of4", mode="2bw", steps=5, clip=0.5, sparsity="n_of_m", correction=PREDICTIVE),
        Case("gpt_flush_sparse_2of4_resume", steps=7, checkpoint_every=3, sparsity="n_of_m", schedule=True),
        Case("gpt_2bw_d2w2_sparse_2of4", width=2, mode="2bw", steps=5, sparsity="n_of_m_transposable"),
        # a synchronous start: 3 fresh steps, then 2BW; checkpoints at steps 2 (inside it) and 4 (after the switch),
        # resumed from each; the predictive correction's history starts at the switch
        Case("gpt_2bw_sync_start", mode="2bw", steps=7, sync_steps=3, checkpoint_every=2, correction=PREDICTIVE),
        # issue 94: the default start (half of 8 steps) and the LR schedule of a run bounded by epochs; saved at step 4
        Case(
            "gpt_2bw_epochs_default_start",
            mode="2bw",
            steps=8,
            epochs=2,
            steps_per_epoch=4,
            sync_steps=None,
            schedule=True,
            checkpoint_every=4,
            correction=PREDICTIVE,
        ),  # fmt: skip
        # the default recipe's combination (a synchronous start, gradual pruning, the correction, the schedule, clipping):
        # masks updated inside the start (step 1) and after the switch (step 3), with 2BW's versions in flight
        Case(
            "gpt_2bw_sync_start_sparse",
            mode="2bw",
            steps=6,
            sync_steps=2,
            sparsity="gmp_global",
            correction=PREDICTIVE,
            schedule=True,
            clip=0.5,
        ),
        # the sharded optimizer with per-layer groups, under the predictive correction
        Case("gpt_2bw_d2w2_sparse_supar", width=2, mode="2bw", steps=5, sparsity="static_supar", correction=PREDICTIVE),
        Case("gpt_2bw_d4_sparse_rigl", mode="2bw", num_stages=4, num_microbatches=4, steps=5, sparsity="rigl_erk"),
        # checkpoints mid-epoch (no steps_per_epoch): the data position is restored from the checkpoint
        Case("gpt_2bw_resume_midepoch", mode="2bw", steps=7, checkpoint_every=3, sparsity="gmp_uniform", schedule=True),
        Case("gpt_flush_resume_midepoch", steps=7, checkpoint_every=3, sparsity="rigl_erk", schedule=True),
        Case("gpt_flush_nonfinite_skip", steps=5, poison_step=2, schedule=True),
        Case("gpt_2bw_nonfinite_skip", mode="2bw", steps=6, poison_step=2, clip=0.5, checkpoint_every=4),
        # the weight swaps of 2BW inside one autocast region, with recomputation (autocast's cast cache)
        Case("gpt_2bw_bf16_recompute", mode="2bw", recompute=True, steps=5, precision="bf16-mixed"),
        # bf16 weight versions over a float32 master: width 2 (sharded steps broadcasting the master; m = 4: STEP
        # beside the next batch, the broadcasts in flight until PUBLISH), the predictive correction (from the master,
        # not the rounded version), clipping, a drain and a checkpoint's resume;
        # and the per-microbatch casts of weight_dtype=None under flush
        Case(
            "gpt_2bw_d2w2_bf16_pef",
            width=2,
            mode="2bw",
            num_microbatches=4,
            steps=6,
            precision="bf16-mixed",
            correction=PREDICTIVE,
            clip=0.5,
            checkpoint_every=3,
            steps_per_epoch=3,
        ),
        Case("gpt_flush_bf16_casts", steps=5, precision="bf16-mixed", weight_dtype=None, sparsity="gmp_uniform"),
        # bf16 versions at width 2: each weight's float32 master on its owner alone; the masks decided alike everywhere
        Case("gpt_2bw_d2w2_bf16_gmp", width=2, mode="2bw", steps=5, precision="bf16-mixed", sparsity="gmp_global"),
        Case("gpt_2bw_validate", mode="2bw", num_microbatches=4, steps=5, val_every=2, clip=0.5),
        Case("gpt_2bw_plan_auto", mode="2bw", num_microbatches=4, steps=5, plan="auto"),
        # several optimizers (Muon for the blocks' matrices + AdamW for the rest, each with its schedule)
        Case("gpt_flush_muon", optimizer="muon", steps=5, schedule=True, clip=0.5),
        Case("gpt_2bw_muon", mode="2bw", optimizer="muon", steps=5, schedule=True),
        Case(
            "gpt_2bw_d2w2_muon_resume",
            width=2,
            mode="2bw",
            optimizer="muon",
            steps=7,
            checkpoint_every=3,
            schedule=True,
            async_checkpoint=True,  # replicas deduplicated by DCP; the resume reads the asynchronously written files
        ),
        Case("gpt_2bw_muon_sparse_static", mode="2bw", optimizer="muon", steps=5, sparsity="static_random", clip=0.5),
        # the error-feedback delay correction, with one optimizer and with two, at depth 2 and 4 and width 2
        Case("gpt_2bw_ef_adamw", mode="2bw", steps=6, correction="error_feedback", schedule=True),
        Case("gpt_2bw_ef_muon_drain", mode="2bw", optimizer="muon", steps=7, correction="error_feedback", val_every=3),
        Case(
            "gpt_2bw_d4_ef_adamw",
            mode="2bw",
            num_stages=4,
            num_microbatches=4,
            steps=6,
            correction="error_feedback",
            clip=0.5,
        ),
        Case(
            "gpt_2bw_d4_ef_muon",
            mode="2bw",
            optimizer="muon",
            num_stages=4,
            num_microbatches=4,
            steps=6,
            correction="error_feedback",
        ),
        Case(
            "gpt_2bw_d2w2_ef_muon",
            width=2,
            mode="2bw",
            optimizer="muon",
            steps=6,
            correction="error_feedback",
            clip=0.5,
        ),
        Case(
            "gpt_2bw_d2w2_ef_adamw_sparse",
            width=2,
            mode="2bw",
            steps=6,
            correction="error_feedback",
            sparsity="static_random",
        ),
        Case("bert_2bw_ef_muon", mode="2bw", model="bert", optimizer="muon", steps=5, correction="error_feedback"),
        # the predictive error feedback (two updates held): a drain (and the tied weight's deferred update), depth 4,
        # width 2
        Case("gpt_2bw_pef_adamw_drain", mode="2bw", steps=7, correction=PREDICTIVE, val_every=3, schedule=True),
        Case(
            "gpt_2bw_d4_pef_adamw",
            mode="2bw",
            num_stages=4,
            num_microbatches=4,
            steps=6,
            correction=PREDICTIVE,
            clip=0.5,
        ),
        Case("gpt_2bw_d2w2_pef_muon", width=2, mode="2bw", optimizer="muon", steps=6, correction=PREDICTIVE),
        # lookahead: one more forward in flight before the last stage; the same update rule (d = 4, m = 6 gives
        # stages 0-2 room under the m - 1 cap; width 2: the bucketed all-reduce after a batch's last backward)
        Case("gpt_2bw_d4_lookahead", mode="2bw", num_stages=4, num_microbatches=6, steps=5, lookahead=1, clip=0.5),
        Case("gpt_2bw_d2w2_lookahead", width=2, mode="2bw", num_microbatches=4, steps=5, lookahead=1, val_every=3),
        Case("gpt_flush_lookahead", num_microbatches=4, lookahead=1, schedule=True),
        # ZB-H1: the split backward (B, then the deferred W) trains as Flush does; resumed at another schedule
        Case("gpt_zb_h1_adamw_clip_sched", mode="zb_h1", num_microbatches=4, clip=0.5, schedule=True, steps=5),
        Case(
            "gpt_zb_h1_d4_sgd_momentum", mode="zb_h1", num_stages=4, num_microbatches=6, optimizer="sgd", momentum=0.9
        ),
        Case(
            "gpt_zb_h1_d2w2_shard_grads_sparse",
            width=2,
            mode="zb_h1",
            num_microbatches=4,
            steps=5,
            clip=0.5,
            shard_gradients=True,
            sparsity="gmp_global",
        ),
        Case("gpt_zb_h1_d2w2_muon_mask", width=2, mode="zb_h1", optimizer="muon", mask=True, steps=4),
        Case(
            "gpt_zb_h1_resume_as_flush",
            mode="zb_h1",
            steps=6,
            checkpoint_every=3,
            resume_mode="flush",
            sparsity="rigl_erk",
            schedule=True,
        ),
        Case("gpt_flush_resume_as_zb_h1", steps=6, checkpoint_every=3, resume_mode="zb_h1", recompute=(1, 0), clip=0.5),
        Case("gpt_zb_h1_bf16_validate", mode="zb_h1", steps=5, precision="bf16-mixed", val_every=2),
        # interleaved 1F1B: two chunks a stage on a ring (the tied embedding on stages 0 and d - 1), trains as Flush
        Case("gpt_interleaved_adamw_clip_sched", mode="interleaved", num_microbatches=4, clip=0.5, schedule=True),
        Case(
            "gpt_interleaved_d4_sgd_momentum",
            mode="interleaved",
            num_stages=4,
            num_microbatches=4,
            optimizer="sgd",
            momentum=0.9,
        ),
        Case(
            "gpt_interleaved_d2w2_shard_grads_sparse",
            width=2,
            mode="interleaved",
            num_microbatches=4,
            clip=0.5,
            shard_gradients=True,
            sparsity="gmp_global",
            val_every=2,
        ),
        Case("gpt_interleaved_resume_as_flush", mode="interleaved", steps=6, checkpoint_every=3, resume_mode="flush"),
        Case("gpt_zb_h1_resume_as_interleaved", mode="zb_h1", steps=6, checkpoint_every=3, resume_mode="interleaved"),
        # the optimizer sharded over 4 replicas (engine/updates/sharding.py; on by default): Muon's whole matrices and AdamW
        # assigned to owners, global clipping; 2BW with the predictive correction's buffers sharded and masks
        Case("gpt_flush_d1w4_muon", num_stages=1, width=4, optimizer="muon", clip=0.5, schedule=True),
        Case(
            "gpt_2bw_d2w4_pef_sparse",
            width=4,
            mode="2bw",
            steps=5,
            correction=PREDICTIVE,
            clip=0.5,
            sparsity="static_random",
        ),
        # sharded gradients (shard_gradients=True): each bucket's parts reduced to their owners; the clip norm and
        # the non-finite agreement summed over the owners first; Muon's whole matrices and global-magnitude masks
        # (m = 4: the owners' broadcasts in flight beside the next batch)
        Case(
            "gpt_2bw_d2w2_shard_grads",
            width=2,
            mode="2bw",
            num_microbatches=4,
            steps=5,
            clip=0.5,
            correction=PREDICTIVE,
            shard_gradients=True,
        ),
        Case("gpt_flush_d2w2_shard_grads_skip", width=2, steps=5, poison_step=2, schedule=True, shard_gradients=True),
        # 2BW keeps one bucket set and each batch's owners' share aside (bf16 versions: the masters sharded too)
        Case(
            "gpt_2bw_d2w2_shard_grads_bf16_skip",
            width=2,
            mode="2bw",
            steps=5,
            poison_step=2,
            precision="bf16-mixed",
            shard_gradients=True,
        ),
        Case(
            "gpt_flush_d1w4_shard_grads_muon_sparse",
            num_stages=1,
            width=4,
            optimizer="muon",
            steps=5,
            clip=0.5,
            sparsity="gmp_global",
            shard_gradients=True,
        ),
        # compiled layers under the Trainer: 2BW's version swaps with bf16-mixed, recomputation and validation;
        # width 2 with the delay correction and sparsity masks (foreach AdamW; the reference steps per tensor)
        Case(
            "gpt_2bw_compile_bf16",
            mode="2bw",
            recompute=True,
            steps=5,
            precision="bf16-mixed",
            val_every=2,
            compile=True,
        ),
        Case(
            "gpt_2bw_d2w2_compile_ef_sparse",
            width=2,
            mode="2bw",
            steps=6,
            correction="error_feedback",
            sparsity="static_random",
            compile=True,
        ),
    ]
}
