"""The convergence benchmark's settings (name -> Hydra overrides), its sweep suffixes and its named sweeps: the data
``benchmarks/convergence.py`` runs, apart from how it runs them."""

from __future__ import annotations

import re

SPARSE_BASE = [  # 75% gradual magnitude pruning as Zhu & Gupta: cubic from step 0 to 60% of the run, uniform
    "sparsity=gradual",
    "sparsity.sparsity=0.75",
    "sparsity.start_step=0",
    "sparsity.end_step=@0.6",
    "sparsity.allocation=uniform",
    "sparsity.shape=cubic",
]
SPARSE_VARIANTS = {  # what each variant changes of SPARSE_BASE
    "": [],
    "+win": ["sparsity.start_step=@0.25", "sparsity.end_step=@0.75"],  # Jin et al.'s window (the default 0.4.1-0.5.0)
    "+erk": ["sparsity.allocation=erk"],
    "+global": ["sparsity.allocation=global"],
    "+win+global": ["sparsity.start_step=@0.25", "sparsity.end_step=@0.75", "sparsity.allocation=global"],
    "+linear": ["sparsity.shape=linear"],
    "+global+linear": ["sparsity.allocation=global", "sparsity.shape=linear"],
}
SETTINGS = {  # name -> Hydra overrides
    "flush": ["strategy.mode=flush"],
    "2bw": ["strategy.mode=2bw", "strategy.delay_correction=null"],  # the plain rule (the default corrects)
    "2bw+ef": ["strategy.mode=2bw", "strategy.delay_correction=error_feedback"],
    # error feedback on the corrected updates: the weights one applied change ahead (PipeOptim's prediction)
    "2bw+pef": ["strategy.mode=2bw", "strategy.delay_correction=predictive_error_feedback"],
    # tried, not a default: the update extrapolated two steps ahead (--settings flush,2bw+ef2)
    "2bw+ef2": [
        "strategy.mode=2bw",
        "strategy.delay_correction=error_feedback",
        "strategy.delay_correction_strength=2",
    ],
    # the correction search of issue 33 (--settings flush,2bw+ef,2bw+ef0.5,2bw+b1,2bw+ef+b1,flush+b1)
    "2bw+ef0.5": [
        "strategy.mode=2bw",
        "strategy.delay_correction=error_feedback",
        "strategy.delay_correction_strength=0.5",
    ],
    # less explicit momentum: a stale gradient acts as implicit momentum (Mitliagkas et al. 2016, arXiv 1605.09774)
    "2bw+b1": ["strategy.mode=2bw", "strategy.delay_correction=null", "model.betas=[0.8,0.95]"],
    "2bw+ef+b1": ["strategy.mode=2bw", "strategy.delay_correction=error_feedback", "model.betas=[0.8,0.95]"],
    "flush+b1": ["strategy.mode=flush", "model.betas=[0.8,0.95]"],
    # issue 33 item 5: 75% gradual sparsity under the default 2BW against dense (--settings 2bw+ef+dense,2bw+ef+s75)
    "2bw+ef+dense": ["strategy.mode=2bw", "strategy.delay_correction=error_feedback", "sparsity=none"],
    "2bw+dense": ["strategy.mode=2bw", "strategy.delay_correction=null", "sparsity=none"],  # issue 50: the plain rule
    "2bw+ef+s75": ["strategy.mode=2bw", "strategy.delay_correction=error_feedback", "sparsity.sparsity=0.75"],
    # issue 50: 75% sparsity under the product's defaults (2BW, its default correction) against dense
    # (--baseline dense --settings dense,s75,s75+win,s75+erk,s75+global,rigl75,spdf75)
    "dense": ["sparsity=none"],
    "flush+dense": ["strategy.mode=flush", "sparsity=none"],
    **{
        f"{mode}s75{name}": [*mode_keys, *SPARSE_BASE, *extra]
        for mode, mode_keys in (("", []), ("flush+", ["strategy.mode=flush"]))
        for name, extra in SPARSE_VARIANTS.items()
    },
    "static75": ["sparsity=static", "sparsity.sparsity=0.75"],  # a random mask from step 0 (gpt13b_sparse's)
    "static75+erk": ["sparsity=static", "sparsity.sparsity=0.75", "sparsity.allocation=erk"],
    "rigl75": ["sparsity=rigl", "sparsity.sparsity=0.75"],
    # SμPar (sparsity.density_scaling): init x 1/sqrt(density), AdamW's rate x 1/density, per layer
    "static75+supar": ["sparsity=static", "sparsity.sparsity=0.75", "sparsity.density_scaling=true"],
    "rigl75+supar": ["sparsity=rigl", "sparsity.sparsity=0.75", "sparsity.density_scaling=true"],
    "spdf75": ["sparsity=spdf", "sparsity.sparsity=0.75"],
    # issue 80 item 4: 2:4 semi-structured (its recipe: dense -> 3:4 -> 2:4 over 25%-50%, then fixed) against 50%
    # unstructured at the same density, by the gradual default's schedule and by 2:4's window (--settings
    # dense,s50,s50+to0.5,semi24)
    "s50": ["sparsity=gradual", "sparsity.sparsity=0.5"],
    "semi24": ["sparsity=semi_structured"],
    "semi24t": ["sparsity=semi_structured", "sparsity.transposable=true"],  # 2 of 4 along rows and columns (kernels')
}
OPTIMIZERS = ("adamw", "muon")
SPARSE_SWEEP = "s75,s75+erk,s75+global,s75+linear,s75+win,s75+win+global," + ",".join(
    f"s75+global+from{a}+to{b}" for a, b in ((0.1, 0.6), (0.25, 0.9), (0.25, 0.95), (0.5, 0.9))
)
DEFAULT_SPARSE = "s75+global+from0.25+to0.95"  # conf/sparsity/gradual.yaml at 75%: the sweep's best since 0.5.2
PREVIOUS_DEFAULT = "s75+global+from0.25+to0.9"  # 0.5.1's: the held-out rows were run with it
GPT_SMALL_WINDOWS = "s75+win+global,s75+global+from0.1+to0.5,s75+global+from0.5+to0.9," + ",".join(
    f"s75+global+from0.25+to{end}"
    for end in (0.9, 0.95, 1.0)  # 1.0: the last update at the run's last 5%
)
GPT_SMALL_METHODS = (  # allocation, shape, regrowth, SPDF's dense phase and the re-warm-up (10 steps after each update)
    "s75+from0.25+to0.9,s75+erk+from0.25+to0.9,s75+global+linear+from0.25+to0.95,rigl75,spdf75,"
    f"{DEFAULT_SPARSE}+rewarm10"
)
# Jin et al.'s comparator (benchmarks/comparator.py): the dense width of the default 75%'s average parameters (mean
# density 0.59) and of the methods sparse from step 0 (0.25), per model
COMPARATORS = {"gpt_tiny": "dense+width48,dense+width32", "gpt_small": "dense+width192,dense+width128"}
SWEEP_JOB = {"steps": 1000, "val_every": 250, "seeds": 2, "optimizers": "adamw", "baseline": "dense"}
SWEEPS = {  # --sweep NAME: the runs of one measurement, each a set of this script's arguments
    # issue 50 (docs/sparsity.md): 75% sparsity against dense under the product's defaults (2BW, AdamW)
    "sparsity": [
        {
            **SWEEP_JOB,
            "model": model,
            "corpora": corpora,
            "settings": settings,
            "horizons": horizons,
        }
        for model, corpora, settings, horizons in (
            (  # the tiny GPT: every schedule, allocation and method
                "gpt_tiny",
                "packages",
                f"dense,{SPARSE_SWEEP},s75+win+global+rewarm10,s75+win+global+rewarm25,static75,static75+erk,rigl75,"
                f"spdf75,{COMPARATORS['gpt_tiny']}",
                "",
            ),
            (
                "gpt_tiny",
                "stdlib,copyrights",
                f"dense,s75,s75+win+global,{PREVIOUS_DEFAULT},{DEFAULT_SPARSE},dense+width48",
                "",
            ),
            (
                "gpt_small",
                "packages",
                f"dense,{GPT_SMALL_WINDOWS},{GPT_SMALL_METHODS},{COMPARATORS['gpt_small']}",
                "",
            ),  # GPT small's sweep
            (
                "gpt_small",
                "stdlib,copyrights",
                f"dense,{DEFAULT_SPARSE},dense+width192",
                "",
            ),  # the second corpus; the held-out one
            ("gpt_small", "packages", f"dense,{DEFAULT_SPARSE}", "1,1.25"),  # GPT small's steps to dense's loss
        )
    ],
}
MODELS = {"gpt_tiny": 64, "gpt_small": 128}  # model preset -> sequence length (the small one's context)


SUFFIXES = {
    "lr": "model.lr",
    "wu": "model.warmup_steps",
    "strength": "strategy.delay_correction_strength",
    "from": "sparsity.start_step",  # a fraction of the run's steps
    "to": "sparsity.end_step",  # a fraction of the run's steps
    "rewarm": "sparsity.rewarmup_steps",  # the learning rate re-warmed over N steps after each mask change
    "b1_": "model.betas",  # AdamW's beta1 (beta2 kept at the GPT presets' 0.95)
    "every": "sparsity.update_interval",  # steps between mask updates (RigL's drop-and-grow, gradual pruning)
    "denselr": "sparsity.dense_lr",  # SPDF's dense phase: its own peak rate (x the schedule's peak)
    "width": "model.config.n_embd",  # another width, depth and heads kept (Jin et al.'s comparator: dense+width48)
    "sync": "strategy.sync_steps",  # a synchronous start: the first N steps with fresh gradients, then 2BW
}
# a sweep suffix: its key in SUFFIXES, value
SUFFIX = re.compile(r"(lr|wu|strength|from|to|rewarm|b1_|every|denselr|width|sync)([0-9.e-]+)")


def overrides(setting: str) -> list[str]:
    """A setting's Hydra overrides: ``SETTINGS[name]``, then sweep suffixes: ``+lrX`` (``model.lr``), ``+wuN``
    (``model.warmup_steps``), ``+strengthX`` (``strategy.delay_correction_strength``), ``+fromF`` / ``+toF`` (the
    pruning window, as fractions of the run), ``+rewarmN`` (``sparsity.rewarmup_steps``), ``+b1_X`` (AdamW's
    ``model.betas=[X,0.95]``), ``+everyN`` (``sparsity.update_interval``), ``+denselrX`` (``sparsity.dense_lr``), ``+widthN`` (``model.config.n_embd``), ``+syncN`` (``strategy.sync_steps``), e.g. ``2bw+ef+lr1e-3+wu60``, ``s75+global+from0.5+to0.9``, ``dense+b1_0.85``."""
    parts, extra = setting.split("+"), []
    while parts and (suffix := SUFFIX.fullmatch(parts[-1])):
        parts.pop()
        fraction = "@" if suffix[1] in ("from", "to") else ""
        value = f"[{suffix[2]},0.95]" if suffix[1] == "b1_" else f"{fraction}{suffix[2]}"
        extra.insert(0, f"{SUFFIXES[suffix[1]]}={value}")
    name = "+".join(parts)
    if name not in SETTINGS:
        raise SystemExit(
            f"unknown setting {setting!r}: one of {sorted(SETTINGS)}, optionally +lrX, +wuN, +strengthX, +fromF, +toF, "
            "+rewarmN, +b1_X, +everyN, +denselrX, +widthN, +syncN"
        )
    return list({o.split("=")[0]: o for o in [*SETTINGS[name], *extra]}.values())  # the last value of a key wins


def flush_of(setting: str) -> str:
    """The Flush setting a setting is compared with: Flush at the same rate and warm-up (its ``+lrX``/``+wuN``
    suffixes; ``2bw+pef+lr6e-4@330`` -> ``flush+lr6e-4``), dense where the setting is (``2bw+dense`` ->
    ``flush+dense``)."""
    parts = setting.split("@")[0].split("+")
    schedule = [p for p in parts[1:] if (suffix := SUFFIX.fullmatch(p)) and suffix[1] in ("lr", "wu")]
    return "+".join(["flush", *(["dense"] if "dense" in parts else []), *schedule])  # "dense": 2BW, dense
