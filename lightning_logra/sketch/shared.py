"""One projection per input: matrices that read the same tensor share A, and x·Aᵀ is computed and saved once.

In a decoder layer q_proj, k_proj and v_proj are fed the same normed hidden state, and gate_proj and up_proj
another. With a projection per matrix (the paper's setting, the default) each of them computes x·A_iᵀ (n×r) in
the forward pass and saves it for the backward. Under `sketch.share_projection` the matrices of one input share
one A (one seed per group, named after the group): the first member the forward pass reaches computes z = x·Aᵀ,
the others are handed the same tensor, so the group costs one r-wide GEMM and one saved (n, r) tensor.

What sharing changes: each sketch is still exactly S_i = G_i·Aᵀ (E[AᵀA] = I, so S_i·A reconstructs G_i as well as
a projection of its own does), but the sketches of one group are taken through the same A, so their errors are
correlated; and every seed differs from the per-matrix setting's, so runs and checkpoints of the two settings are
not comparable step for step.

Groups are found by name (siblings under one parent, named as `SHARED_INPUTS` lists: Llama, Qwen2, Mistral and
the architectures that copy their module names), because the seeds must be fixed when the sketches are installed,
before any forward pass. Whether the members really receive the same tensor is checked on every call: the same
object, not modified in place since (its version counter). A member that receives another tensor computes its
own x·Aᵀ with the shared A: the sketches stay exact (a shared A never needs equal inputs: S_i = G_i·Aᵀ whatever
G_i is), only the saving is lost, and a warning names the group once. Correctness never depends on the detection.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping

import torch
from torch import nn

log = logging.getLogger(__name__)

# Sibling linear layers that read one input, by the last component of their names.
SHARED_INPUTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SharedInput:
    """The matrices of one input: their shared A (cached once for all of them) and the x·Aᵀ of the current input.

    `name` is what the projection's seed is derived from (`<parent>.q_proj+k_proj+v_proj`), `members` the sketched
    layers' names. `computed` and `reused` count the x·Aᵀ products computed and handed on (for tests and benches).
    """

    def __init__(self, name: str, members: tuple[str, ...]) -> None:
        self.name, self.members = name, members
        self.computed = self.reused = 0
        self._source: weakref.ref | None = None  # the input x of the pending z (weak: autograd decides its life)
        self._version = -1
        self._z: torch.Tensor | None = None  # (n, r)
        self._served: set[str] = set()
        self._warned = False
        self._projection: tuple[tuple, torch.Tensor] | None = None  # ((seed, device, dtype), A)

    def projection(self, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A (r, k) for `key` (its seed, device and dtype), made once for all members (each member's cached A is
        this same tensor)."""
        if self._projection is None or self._projection[0] != key:
            self._projection = (key, make())
        return self._projection[1]

    def project(self, member: str, x: torch.Tensor, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """z = x·Aᵀ (n, r) for `member`: the pending one if this member has not had it and x is the tensor it was
        computed from, else `compute()` (and it becomes the pending one)."""
        pending = self._z is not None and member not in self._served
        source = self._source() if self._source is not None else None
        if pending and source is x and x._version == self._version:
            self._served.add(member)
            self.reused += 1
            z = self._z
        else:
            if pending and source is not None:
                # A member that has not had this input's z was fed another tensor (or the same one, modified).
                self._warn(member)
            z = compute()
            self.computed += 1
            self._source, self._version, self._z, self._served = weakref.ref(x), x._version, z, {member}
        if self._served == set(self.members):
            self._source, self._z, self._served = None, None, set()  # every member has it: hold nothing
        return z

    def _warn(self, member: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "sketch.share_projection: %s did not receive the tensor the other matrices of %s received; it "
                "computes its own x·Aᵀ with the shared A (the sketches stay exact, but nothing is saved for it)",
                member, self.name,
            )


def find_groups(layers: Mapping[str, nn.Linear]) -> dict[str, SharedInput]:
    """{member name: its group} for every set of two or more `layers` that `SHARED_INPUTS` says read one input.

    An error (beginning "share_projection: ") when the members of a group differ in in_features: they cannot be
    reading the same tensor, so the name pattern does not describe this architecture."""
    groups: dict[str, SharedInput] = {}
    for parent in sorted({name.rpartition(".")[0] for name in layers}):
        prefix = f"{parent}." if parent else ""
        for children in SHARED_INPUTS:
            members = tuple(prefix + child for child in children if prefix + child in layers)
            if len(members) < 2:
                continue
            widths = {name: layers[name].in_features for name in members}
            if len(set(widths.values())) > 1:
                raise ValueError(f"share_projection: {widths} differ in in_features, so they cannot read the same "
                                 "input; set share_projection false for this model")
            group = SharedInput(prefix + "+".join(children), members)
            groups.update(dict.fromkeys(members, group))
    return groups
