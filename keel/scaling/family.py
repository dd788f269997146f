"""A scaling ladder's model family: what its predictions are for, so a run is compared like with
like. A sweep varies the width; the kind (dense or MoE), the depths and the vocabulary it keeps
are the family, recorded in ladder.json and checked against each compared run's model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from keel.model.config import ModelConfig


@dataclass(frozen=True)
class ModelFamily:
    """What a ladder's predictions are for: the kind, depths and vocabulary of its runs' models
    (widths vary along a ladder; these do not)."""

    kind: str
    """"dense" or "moe"."""
    depths: tuple[int, ...]
    """The n_layers values of the runs."""
    vocab_size: int

    @classmethod
    def of(cls, models: Sequence[ModelConfig]) -> ModelFamily:
        kinds = sorted({_kind(model) for model in models})
        vocab = sorted({model.vocab_size for model in models})
        return cls("/".join(kinds), tuple(sorted({m.n_layers for m in models})), vocab[0])

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ModelFamily | None:
        """The family as ladder.json keeps it (asdict); None for None (an older ladder.json)."""
        if data is None:
            return None
        return cls(str(data["kind"]), tuple(map(int, data["depths"])), int(data["vocab_size"]))

    def describe(self) -> str:
        depths = "/".join(map(str, self.depths))
        layers = "layer" if self.depths == (1,) else "layers"
        return f"{self.kind}, {depths} {layers}, {self.vocab_size:,} ids"

    def differences(self, model: ModelConfig) -> list[str]:
        """How `model` falls outside the family (empty: it belongs)."""
        found = []
        if _kind(model) != self.kind:
            found.append(f"{_kind(model)}, not {self.kind}")
        if model.n_layers not in self.depths:
            found.append(f"{model.n_layers} layers, not {'/'.join(map(str, self.depths))}")
        if model.vocab_size != self.vocab_size:
            found.append(f"{model.vocab_size:,} ids, not {self.vocab_size:,}")
        return found


def _kind(model: ModelConfig) -> str:
    return "moe" if model.is_moe else "dense"


def family_warning(family: ModelFamily | None, model: ModelConfig) -> str:
    """Why a ladder of `family` may not predict for `model` ("" when it does)."""
    if family is None:
        return (
            "this ladder does not record its model family (built by an older keel): rebuild it "
            "(keel scaling ladder) to check that it predicts for this run's kind of model"
        )
    differences = family.differences(model)
    if not differences:
        return ""
    return (
        f"the run's model ({', '.join(differences)}) is not of the ladder's family "
        f"({family.describe()}): its prediction is for another kind of model; compare "
        "with a ladder of this run's family (keel scaling sweep) for a like-with-like check"
    )
