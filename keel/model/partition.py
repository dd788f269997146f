"""Where each parameter lives on the mesh: one PartitionSpec per leaf, decided here only.

| leaf (shape)                                        | split over                              |
| --------------------------------------------------- | --------------------------------------- |
| embeddings `embed` [vocab, d], `unembed` [d, vocab]  | fsdp on the first axis                  |
| attention `wq wk wv` [L, d, h], `wo` [L, h, d]       | fsdp on the first axis after layers     |
| dense MLP and shared experts [L, d, f] / [L, f, d]  | fsdp on the first axis after layers     |
| router [L, d, E], latent projections [L, d, r]       | fsdp on the first axis after layers     |
| routed experts [L, E, d_e, f] / [L, E, f, d_e]       | expert on E, fsdp on the axis after E   |
| norm scales [L, d], `final_norm` [d]                 | replicated (a few KB)                   |

Every leaf but the routed experts is also split over `expert` together with `fsdp` (the axis
taken is split fsdp x expert ways): for them the expert axis is one more data-parallel axis,
so an expert-parallel mesh does not hold a whole copy of attention and embeddings per device.
The stacked layer axis L is never split: `lax.scan` walks it. Where the split does not divide
the axis named, the next axis that it divides is taken; failing that, fsdp alone; a leaf no
axis of which fsdp divides is replicated. Nothing is ever split over `data`: it only splits the
batch.
Gradients take their parameters' specs; optimizer state takes its parameters' specs (see
keel.train.state_layout).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from keel.model.sharding import EXPERT_AXIS, FSDP_AXIS, axis_size

STACKED = ("dense", "moe")
"""ModelParams fields whose leaves carry a leading layer axis."""


def param_specs(params: Any, mesh: Mesh | None) -> Any:
    """The ModelParams tree (arrays or ShapeDtypeStructs) -> the same tree of PartitionSpecs."""
    fsdp, expert = axis_size(mesh, FSDP_AXIS), axis_size(mesh, EXPERT_AXIS)

    def spec(path: tuple, leaf: Any) -> PartitionSpec:
        names = [getattr(entry, "name", None) for entry in path]
        axes: list[str | tuple[str, ...] | None] = [None] * leaf.ndim
        first = 1 if names[0] in STACKED else 0
        splits: list[tuple[tuple[str, ...], int]] = [((FSDP_AXIS,), fsdp)]
        if "experts" in names:
            axes[first] = EXPERT_AXIS
            first += 1
        elif expert > 1:
            splits.insert(0, ((FSDP_AXIS, EXPERT_AXIS), fsdp * expert))
        if str(names[-1]).endswith("norm"):
            return PartitionSpec(*axes)
        for mesh_axes, ways in splits:
            if ways == 1:
                continue
            divisible = [a for a in range(first, leaf.ndim) if leaf.shape[a] % ways == 0]
            if divisible:
                axes[divisible[0]] = mesh_axes if len(mesh_axes) > 1 else mesh_axes[0]
                break
        return PartitionSpec(*axes)

    return jax.tree_util.tree_map_with_path(spec, params)


def param_shardings(params: Any, mesh: Mesh, memory_kind: str | None = None) -> Any:
    """NamedShardings of `param_specs` on `mesh` (in `memory_kind`, e.g. "pinned_host")."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec, memory_kind=memory_kind),
        param_specs(params, mesh),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
