"""The slow tier's cases, run by ``run_cases.py`` like ``cases.CASES`` but outside both tiers' torchrun jobs."""

from __future__ import annotations

from .cases import PREDICTIVE, Case

# the slow tier's (``test_recipe_options_at_16.py``): the tiny GPT at 4 stages x 4 replicas with every option the
# gpt13b recipe sets (issue 95): 2BW after a synchronous start, gradients reduced to their owners, a stage's replicas
# on consecutive ranks, global clipping, Muon + AdamW, the predictive correction, an asynchronous checkpoint resumed
SLOW_CASES = {
    case.name: case
    for case in [
        Case(
            "gpt_2bw_d4w4_recipe_options",
            mode="2bw",
            num_stages=4,
            num_microbatches=4,
            width=4,
            optimizer="muon",
            steps=6,
            clip=0.5,
            schedule=True,
            checkpoint_every=3,
            async_checkpoint=True,
            correction=PREDICTIVE,
            sync_steps=2,
            placement="replicas",
        ),
    ]
}
