"""The partition contract (docs/models.md): how a module offers its layers, inputs and loss to the pipeline."""

from __future__ import annotations

from torch import nn

CONTRACT = ("pipeline_layers", "pipeline_inputs", "pipeline_loss")


def pipeline_layers_of(module: nn.Module) -> list[nn.Module]:
    """The partition contract (docs/models.md), or an error naming what is missing."""
    layers_fn = getattr(module, "pipeline_layers", None)
    sequential = getattr(module, "layers", None)
    missing = [name for name in CONTRACT[1:] if not callable(getattr(module, name, None))]
    if not callable(layers_fn) and not isinstance(sequential, nn.Sequential):
        missing.insert(0, "pipeline_layers (or an nn.Sequential attribute named layers)")
    if missing:
        raise TypeError(
            f"{type(module).__name__} does not implement the pd2bw partition contract: missing "
            f"{', '.join(missing)}. Define pipeline_layers() -> ordered layers, pipeline_inputs(batch) -> first "
            "layer's input and pipeline_loss(output, batch) -> loss (see docs/models.md, 'The partition contract')"
        )
    layers = list(layers_fn() if callable(layers_fn) else sequential)
    owned = {id(p) for layer in layers for p in layer.parameters()}
    outside = [name for name, p in module.named_parameters() if id(p) not in owned]
    if outside:
        raise ValueError(
            f"{type(module).__name__} has parameters outside pipeline_layers(): {', '.join(outside[:5])}"
            f"{' ...' if len(outside) > 5 else ''}. The stage that runs a layer owns its parameters (double-buffers, "
            "averages, clips, checkpoints them); a parameter in no layer has no owner. Move it into the layer that uses "
            "it (e.g. an input scale into the first layer, a loss temperature into the last one and read it there), "
            "or register it as a buffer if it is not trained"
        )
    return layers
