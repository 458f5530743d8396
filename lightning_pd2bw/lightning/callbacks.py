"""Run metrics for the progress bar and any logger: tokens/s, samples/s, MFU, learning rate, memory per stage, and
the graphs ``torch.compile`` built (``strategy.compile``)."""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops
from lightning.pytorch.callbacks import Callback

from ..engine.precision import Precision


def peak_memory_bytes(device: torch.device) -> float:
    """Peak allocated bytes on a GPU, else this process's peak resident set size."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is KiB on Linux, bytes on macOS
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale)


def compile_counters(trainer: pl.Trainer) -> list[float] | None:
    """This rank's ``[graphs, recompiles after warm-up]`` when the strategy compiles its layers, else None."""
    engine = getattr(trainer.strategy, "engine", None)
    meter = getattr(engine, "compile_meter", None)
    return [float(meter.graphs), float(meter.recompiles_after_warmup)] if meter is not None else None


class RunMetrics(Callback):
    """Logs ``tokens_per_sec`` (progress bar), ``samples_per_sec``, ``mfu``, ``lr`` and peak memory per stage; with
    ``strategy.compile``, ``compile/graphs`` and ``compile/recompiles_after_warmup`` summed over ranks (also at the
    end of each training epoch, so that the run's summary holds the final counts).

    Rates come from Lightning's ``Throughput`` over the steps since the previous log, counted once per
    *pipeline*: every stage of a pipeline works on the same samples, so Throughput's world size is the
    data-parallel width and a "device" is one pipeline of ``num_stages`` devices (its peak FLOP/s is the
    stages' sum). MFU is logged when the model counts its FLOPs (``flops_per_token()``) and the device's
    peak is known (``get_available_flops``, or ``peak_flops`` given here for one device, e.g. a CPU).

    Args:
        global_batch_size: samples per optimizer step over all replicas.
        seq_len: tokens per sample.
        peak_flops: one device's peak FLOP/s in the run's compute dtype (default: Lightning's table for the GPU;
            none on a CPU, so no MFU there unless given).
    """

    def __init__(self, global_batch_size: int, seq_len: int, peak_flops: float | None = None) -> None:
        self.global_batch_size, self.seq_len = global_batch_size, seq_len
        self.peak_flops = peak_flops
        self.throughput: Throughput | None = None
        self._width = 1
        self._flops_per_step: float | None = None  # one replica's pipeline, one optimizer step
        self._start: tuple[float, int] | None = None  # (time, global step) of the first timed step
        self._updated_at = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stages = getattr(trainer.strategy, "num_stages", 0) or 1
        self._width = max(1, trainer.world_size // stages)
        device = trainer.strategy.root_device
        peak = self.peak_flops
        if peak is None and device.type == "cuda":
            peak = get_available_flops(device, Precision.of(trainer.precision).compute_dtype)
        per_token = getattr(pl_module, "flops_per_token", None)
        tokens = self.global_batch_size // self._width * self.seq_len
        self._flops_per_step = per_token() * tokens if callable(per_token) else None
        self.throughput = Throughput(
            available_flops=peak * stages if peak else None, world_size=self._width, window_size=2
        )
        self._start = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._start is None and self.throughput is not None:
            self._start = (time.perf_counter(), trainer.global_step)
            self._updated_at = trainer.global_step
            self._update(trainer.global_step)

    def _update(self, step: int) -> None:
        assert self.throughput is not None and self._start is not None
        done = step - self._start[1]
        samples = done * (self.global_batch_size // self._width)  # one replica's (every stage's) samples
        elapsed = step - self._updated_at
        self._updated_at = step
        self.throughput.update(
            time=time.perf_counter() - self._start[0],
            batches=done,
            samples=samples,
            lengths=samples * self.seq_len,
            flops=self._flops_per_step * elapsed if self._flops_per_step is not None else None,
        )

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step % max(1, trainer.log_every_n_steps) != 0 or self._start is None or step <= self._updated_at:
            return
        self._update(step)
        assert self.throughput is not None
        rates = self.throughput.compute()
        metrics = {  # Throughput's device rates are one replica's pipeline; x width: the whole job's
            "samples_per_sec": rates["device/samples_per_sec"] * self._width,
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
        }
        if "device/mfu" in rates:
            metrics["mfu"] = rates["device/mfu"]
        device = trainer.strategy.root_device  # the collective's device: NCCL groups take only GPU tensors
        compiled = compile_counters(trainer)
        values = torch.tensor([peak_memory_bytes(device) / 1024**3, *(compiled or [])], device=device)
        gathered = trainer.strategy.all_gather(values).reshape(-1, len(values))
        per_rank = gathered[:, 0].tolist()
        stages = getattr(trainer.strategy, "num_stages", 0)
        if stages:  # pd2bw: ranks 0..d-1 are replica 0's stages
            metrics |= {f"memory/stage{stage}_gib": per_rank[stage] for stage in range(stages)}
        else:
            metrics |= {f"memory/rank{rank}_gib": value for rank, value in enumerate(per_rank)}
        if compiled is not None:
            metrics |= _compile_metrics(gathered[:, 1:])
        tokens = rates["device/items_per_sec"] * self._width
        pl_module.log("tokens_per_sec", tokens, prog_bar=True, on_step=True, on_epoch=False)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        compiled = compile_counters(trainer)
        if compiled is None:
            return
        values = torch.tensor(compiled, device=trainer.strategy.root_device)
        gathered = trainer.strategy.all_gather(values).reshape(-1, len(values))
        pl_module.log_dict(_compile_metrics(gathered), on_step=False, on_epoch=True, sync_dist=False)


def _compile_metrics(per_rank: torch.Tensor) -> dict[str, float]:
    """``[graphs, recompiles]`` per rank -> the job's totals."""
    graphs, recompiles = per_rank.sum(dim=0).tolist()
    return {"compile/graphs": graphs, "compile/recompiles_after_warmup": recompiles}


class ProgressLog(pl.Callback):
    """Progress for logs, where no terminal shows a progress bar: every ``every`` steps rank 0 says one line (step
    of max, train loss, tokens/s, learning rate), and after each validation its loss. ``say`` prints it (and
    ``pd2bw-train`` also writes it to the run's ``train.log``)."""

    KEYS = (("train_loss", "train_loss {:.4f}"), ("tokens_per_sec", "tokens/s {:,.0f}"), ("lr", "lr {:.2e}"))

    def __init__(self, every: int = 10, say: Callable[[str], None] = print) -> None:
        self.every, self.say = max(1, every), say
        self.started = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started = time.monotonic()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if trainer.is_global_zero and step % self.every == 0:
            metrics = trainer.callback_metrics
            shown = [text.format(float(metrics[key])) for key, text in self.KEYS if key in metrics]
            total = f"/{trainer.max_steps}" if trainer.max_steps and trainer.max_steps > 0 else ""
            elapsed = time.monotonic() - self.started
            self.say(f"step {step}{total}  " + "  ".join(shown) + f"  ({elapsed:.0f} s)")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        metrics = trainer.callback_metrics
        if trainer.is_global_zero and not trainer.sanity_checking and "val_loss" in metrics:
            self.say(f"step {trainer.global_step}  val_loss {float(metrics['val_loss']):.4f}")
