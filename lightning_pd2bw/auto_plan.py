"""``plan="auto"`` (a mixin of ``PipeDream2BWStrategy``): profile at start-up, plan, adopt the layout,
and re-batch each replica's dataloader to its share of the global batch."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from .compat import train_dataloader
from .pipeline.grid import ProcessGrid


class AutoPlan:
    def _plan_automatically(self, trainer: pl.Trainer, layers: list[nn.Module]) -> list[range]:
        """Profile, plan and adopt the fastest configuration that fits (``plan="auto"``)."""
        from .planner.auto import plan_on_world
        from .planner.profile import bytes_per_element
        from .planner.search import format_table

        loader = train_dataloader(trainer)
        sample = next(iter(loader))
        if self.global_batch_size is None:
            self.global_batch_size = getattr(loader, "batch_size", None) and loader.batch_size * self.world_size
        if not self.global_batch_size:
            raise ValueError("plan='auto' needs PipeDream2BWStrategy(global_batch_size=...) for this dataloader")
        module = self.lightning_module
        best, cluster, ranked = plan_on_world(
            layers,
            sample,
            module.pipeline_inputs,
            module.pipeline_loss,
            device=self.root_device,
            num_nodes=self.num_nodes,
            global_batch=self.global_batch_size,
            mode=self.mode,
            weight_bytes=bytes_per_element(str(self.precision_plugin.precision))[0],
            autocast=self.precision_plugin.train_step_context,
        )
        chosen = best.candidate
        self.planned = best
        self._requested_stages = chosen.depth
        self._requested_microbatches = best.num_microbatches
        self.recompute = chosen.recompute
        self.grid = ProcessGrid(self.global_rank, self.world_size, self.num_stages)
        rank_zero_info(
            f"pd2bw plan=auto on {cluster.name}: global batch {self.global_batch_size}; chosen width {chosen.width} x "
            f"depth {chosen.depth}, micro_batch_size {chosen.micro_batch_size}, {best.num_microbatches} microbatches, "
            f"recompute={chosen.recompute}; predicted {best.throughput:.2f} samples/s\n{format_table(ranked, limit=5)}"
        )
        if trainer.logger is not None:
            trainer.logger.log_hyperparams(
                {
                    "plan": {
                        "num_stages": chosen.depth,
                        "data_parallel_size": chosen.width,
                        "micro_batch_size": chosen.micro_batch_size,
                        "num_microbatches": best.num_microbatches,
                        "recompute": chosen.recompute,
                        "predicted_samples_per_sec": best.throughput,
                        "stage_layers": [[r.start, r.stop] for r in best.stages],
                    }
                }
            )
        return list(best.stages)

    def _rebatch(self, dataloader: Any) -> Any:
        from .data.resume import rebuild

        per_replica = self.global_batch_size // self.data_parallel_size
        if dataloader.batch_size == per_replica:
            return dataloader
        if dataloader.batch_size is None:
            raise ValueError("plan='auto' re-batches the dataloader and needs a DataLoader built with batch_size=...")
        return rebuild(dataloader, batch_size=per_replica)
