"""SketchModelSummary: the model summary at the start of fit, counting what a sketched run really trains.

Lightning's summary counts parameters by `requires_grad`. With sketches that is backwards: the sketched weights,
which the run trains, are frozen to autograd (they get no `.grad`), and the only "trainable" tensors are the
stride-0 sketch carriers, whose 4 bytes it counts as their d×r broadcast shape ("Trainable params: 90.1 K" on the
embedded model, none of them a weight). This summary leaves the carriers out and says what is trained: the
sketched matrices (how many, their parameters, the rank), the parameters trained densely, and the frozen rest. The
command line uses it unless the config names a summary of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_summary import get_human_readable_count, summarize
from torch import nn

from lightning_logra.sketch.install import sketch_carriers, sketched_layers


@dataclass(frozen=True)
class TrainedCounts:
    matrices: int  # sketched weight matrices
    sketched: int  # their parameters, Σ d·k
    ranks: tuple[int, ...]  # the sketch ranks in use, ascending
    sketch_numbers: int  # Σ d·r: what the sketches hold instead of Σ d·k gradient entries
    dense: int  # parameters trained densely (requires_grad, carriers excepted)
    frozen: int  # the rest
    megabytes: float  # the weights' storage, carriers excepted

    @property
    def total(self) -> int:
        return self.sketched + self.dense + self.frozen


def trained_counts(model: nn.Module) -> TrainedCounts:
    """What `model` trains, by kind; each parameter counted once (tied weights too)."""
    layers = list(sketched_layers(model).values())
    carriers, sketched = sketch_carriers(model), {id(layer.weight) for layer in layers}
    dense = frozen = nbytes = 0
    for param in model.parameters():  # de-duplicated
        if id(param) in carriers:
            continue
        nbytes += param.numel() * param.element_size()
        if id(param) in sketched:
            continue
        if param.requires_grad:
            dense += param.numel()
        else:
            frozen += param.numel()
    return TrainedCounts(
        matrices=len(layers),
        sketched=sum(layer.weight.numel() for layer in layers),
        ranks=tuple(sorted({layer.rank for layer in layers})),
        sketch_numbers=sum(layer.out_features * layer.rank for layer in layers),
        dense=dense,
        frozen=frozen,
        megabytes=nbytes / 1e6,
    )


def _count(number: int) -> str:
    return f"{get_human_readable_count(number):<10}"


def format_summary(model: nn.Module, max_depth: int = 1) -> str:
    """The table of `model`'s modules to `max_depth` (name, type, parameters without carriers, mode), then the
    counts of `trained_counts`."""
    layers = summarize(model, max_depth=max_depth)  # for the module names and types Lightning would list
    carriers = sketch_carriers(model)
    params = [sum(p.numel() for p in model.get_submodule(name).parameters() if id(p) not in carriers)
              for name in layers.layer_names]
    columns = [
        (" ", [str(i) for i in range(len(params))]),
        ("Name", layers.layer_names),
        ("Type", layers.layer_types),
        ("Params", [get_human_readable_count(n) for n in params]),
        ("Mode", ["train" if mode else "eval" for mode in layers.training_modes]),
    ]
    widths = [max(len(header), *(len(cell) for cell in cells)) for header, cells in columns]
    rule = "-" * (sum(widths) + 3 * len(widths))
    lines = [" | ".join(header.ljust(w) for (header, _), w in zip(columns, widths)), rule]
    lines += [" | ".join(cells[i].ljust(w) for (_, cells), w in zip(columns, widths)) for i in range(len(params))]
    counts = trained_counts(model)
    if counts.matrices:
        ranks = ", ".join(map(str, counts.ranks))
        sketched = (f"Trained params, sketched: {counts.matrices} matrices at rank {ranks} "
                    f"(their sketches hold {get_human_readable_count(counts.sketch_numbers)} numbers)")
    else:
        sketched = "Trained params, sketched: none (no sketches installed)"
    lines += [
        rule,
        _count(counts.sketched) + sketched,
        _count(counts.dense) + "Trained params, dense",
        _count(counts.frozen) + "Frozen params",
        _count(counts.total) + "Total params",
        f"{counts.megabytes:<10,.3f}Total estimated model params size (MB)",
    ]
    return "\n".join(lines)


class SketchModelSummary(ModelSummary):
    """Args: max_depth, as Lightning's `ModelSummary` (0 turns the summary off)."""

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._max_depth and trainer.is_global_zero:
            rank_zero_info("\n" + format_summary(pl_module, self._max_depth))
