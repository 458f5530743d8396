"""One checkpoint format, two writers: the Lightning strategy and ``PipelineEngine.save`` name every entry by the
module (the engine's ``root``), so each loads what the other wrote. ``torchrun --nproc-per-node=2 ... OUT``

1. Lightning trains the tiny GPT 3 steps (2BW, depth 2) and saves ``lightning.ckpt``.
2. A plain engine over ``GPTCore`` (the same module without Lightning, ``root=core``) loads it: its weights and
   AdamW moments are the Lightning stage's, exactly. It trains one more step and saves ``engine.ckpt``.
3. ``trainer.validate(ckpt_path="engine.ckpt")`` in a fresh Trainer: its stage holds the engine's weights.
Each rank writes ``OUT/rank{r}.pt`` with what the test compares.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402

from lightning_pd2bw import PipeDream2BWStrategy  # noqa: E402
from lightning_pd2bw.engine import PipelineEngine, PipelineOptions  # noqa: E402
from lightning_pd2bw.engine.materialize import parameters_on_meta  # noqa: E402
from lightning_pd2bw.models import GPTConfig, GPTCore  # noqa: E402
from tests.distributed.cases import SEQ_LEN, Case, build_model, dataloader, replica_batch  # noqa: E402
from tests.distributed.harness import quiet_trainer  # noqa: E402

CASE = Case("checkpoint_names", mode="2bw", steps=3)


def strategy() -> PipeDream2BWStrategy:
    return PipeDream2BWStrategy(num_stages=2, num_microbatches=2, delay_correction=None)


def moments(engine: PipelineEngine) -> dict[str, torch.Tensor]:
    """AdamW's first moments by parameter name."""
    names = engine.parameter_names()
    return {
        names[id(p)][0]: state["exp_avg"].clone()
        for optimizer in engine.optimizers
        for p, state in optimizer.state.items()
    }


def weights(engine: PipelineEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.stage_state_dict().items()}


def main() -> None:
    out = Path(sys.argv[1])
    pl.seed_everything(0)
    trainer = quiet_trainer(strategy(), max_steps=CASE.steps, limit_val_batches=0)
    trainer.fit(build_model(CASE), dataloader(CASE))
    trainer.save_checkpoint(out / "lightning.ckpt")
    written = {"weights": weights(trainer.strategy.engine), "moments": moments(trainer.strategy.engine)}
    trainer.strategy.teardown()

    with parameters_on_meta():
        core = GPTCore(GPTConfig(n_layer=3, n_head=2, n_embd=16, block_size=SEQ_LEN))
    engine = PipelineEngine(
        core.pipeline_layers(),
        PipelineOptions(num_stages=2, num_microbatches=2, delay_correction=None),
        core.pipeline_inputs,
        core.pipeline_loss,
        device="cpu",
        init_layer=core.init_pipeline_layer,
        root=core,
    )
    engine.start(torch.optim.AdamW(engine.parameters(), lr=3e-3, weight_decay=0.01))
    engine.load(out / "lightning.ckpt")
    loaded = {"weights": weights(engine), "moments": moments(engine)}
    engine.train_batch(replica_batch(CASE, CASE.steps, 0, 1))
    engine.drain()
    engine.save(out / "engine.ckpt")
    saved = weights(engine)
    engine.close()

    validator = quiet_trainer(strategy())
    validator.validate(build_model(CASE), dataloader(CASE), ckpt_path=out / "engine.ckpt")
    validated = weights(validator.strategy.engine)
    rank = validator.global_rank
    torch.save({"written": written, "loaded": loaded, "saved": saved, "validated": validated}, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
