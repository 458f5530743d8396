"""Greedy generation through ``trainer.predict`` on a 2-stage pipeline; every rank saves what it generated.

torchrun --nproc-per-node=2 run_predict.py OUT
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from lightning_pd2bw import PipeDream2BWStrategy
from tests.distributed.harness import quiet_trainer
from tests.distributed.predict_case import NEW_TOKENS, model, prompts


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    gpt = model()
    trainer = quiet_trainer(PipeDream2BWStrategy(num_stages=2, num_microbatches=2))
    tokens, logits = prompts(), []
    for _ in range(NEW_TOKENS):
        rows = [{"input_ids": row} for row in tokens]
        predictions = trainer.predict(gpt, torch.utils.data.DataLoader(rows, batch_size=4))
        last = torch.cat([p[:, -1] for p in predictions])
        logits.append(last)
        tokens = torch.cat([tokens, last.argmax(-1, keepdim=True)], dim=1)
    torch.save({"tokens": tokens, "logits": torch.stack(logits)}, out / f"generated-rank-{rank}.pt")


if __name__ == "__main__":
    main()
