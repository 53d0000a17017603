"""Base-model families: the server half shared by strategies that average one global set of arrays per base model.

LoRA's A and B have shapes that depend on the base model, so a federation of different models can only average
within a model family: one group, and one global set of arrays, per base model. ``FamilyMean`` is that server
half; a strategy says which part of a client's adapter is global (``shared``: FedAvg the whole LoRA, FedSA-LoRA
its A matrices) and what it saves at the end. In secure mode each family is one SecAgg+ group, so a family of
fewer than ``MIN_SECURE_GROUP`` clients is refused before round 1 (SecAgg+ among them would leak their updates).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import TYPE_CHECKING

from common.logs import get_logger

from .base import MIN_SECURE_GROUP, Arrays, ClientInfo, Group, GroupResult, Strategy

if TYPE_CHECKING:
    from common.config import RunConfig

log = get_logger("tessera.server")


_SAFE = re.compile(r"[A-Za-z0-9.-]")


def family_key(model: str) -> str:
    """A checkpoint-safe name for a base model's family ("global" state per family), one per model name: every
    character outside ``[A-Za-z0-9.-]``, ``_`` included, is written ``_<hex code>_``, so two names never share a key
    (``Qwen_X`` and ``Qwen/X`` did, and one node could then be the majority of the other's family)."""
    return "".join(ch if _SAFE.fullmatch(ch) else f"_{ord(ch):x}_" for ch in model)


class FamilyMean(Strategy):
    """The example-weighted mean of each client's ``shared`` arrays within its base-model family, one group (and
    one global set of arrays) per family; subclasses name the strategy and its final adapters.

    State: ``global`` (one family) or ``global-<model>`` (several) — the current global arrays of each family.
    A round whose group produced no mean (every reply rejected, or too few) keeps the previous arrays.
    """

    def __init__(self, secure: bool = False) -> None:
        self.secure = secure  # families become SecAgg+ groups: each needs at least MIN_SECURE_GROUP members
        self.family_of: dict[int, str] = {}  # node id -> family
        self.model_of_family: dict[str, str] = {}  # family -> the base model's name as the clients gave it
        self.global_arrays: dict[str, Arrays] = {}  # family -> the global arrays (``shared`` of an adapter)

    @classmethod
    def from_config(cls, cfg: RunConfig) -> FamilyMean:
        return cls(secure=cfg.secure)

    def shared(self, initial: Arrays) -> Arrays:
        """The part of a client's adapter that is averaged and travels (default: all of it)."""
        return initial

    def initialise(self, clients: dict[int, ClientInfo]) -> None:
        if self.secure:  # before round 1, not as a group skipped every round
            sizes = Counter(self.family_of.values()) + Counter(family_key(i.model) for i in clients.values())
            small = {family: n for family, n in sorted(sizes.items()) if n < MIN_SECURE_GROUP}
            if small:
                raise ValueError(
                    f"secure=true: model families {small} have fewer than {MIN_SECURE_GROUP} clients; SecAgg+ "
                    f"would leak their updates ({self.name} averages per base model: see model.partition-models)"
                )
        for nid, info in sorted(clients.items()):
            family = family_key(info.model)
            self.family_of[nid] = family
            self.model_of_family.setdefault(family, info.model)
            self.global_arrays.setdefault(family, {k: v.copy() for k, v in self.shared(info.initial).items()})
        if len(self.global_arrays) > 1:
            log.info(
                "%s: %d model families, averaged separately: %s",
                self.name,
                len(self.global_arrays),
                sorted(self.global_arrays),
            )

    def train_groups(self, server_round: int, node_ids: list[int]) -> list[Group]:
        groups: dict[str, Group] = {}
        for nid in node_ids:
            family = self.family_of.get(nid)
            if family is None:
                log.warning(
                    "round %d: node %d joined after round 0; it is not trained until the run restarts",
                    server_round,
                    nid,
                )
                continue
            groups.setdefault(family, Group(family, {})).start[nid] = self.global_arrays[family]
        return list(groups.values())

    def update(self, server_round: int, results: list[GroupResult]) -> None:
        for result in results:
            if result.mean is not None:
                self.global_arrays[result.name] = result.mean

    def eval_arrays(self, node_id: int) -> Arrays:
        return self.global_arrays[self.family_of[node_id]]

    def state_dict(self) -> dict[str, Arrays]:
        if len(self.global_arrays) == 1:
            (arrays,) = self.global_arrays.values()
            return {"global": arrays}
        return {f"global-{family}": arrays for family, arrays in self.global_arrays.items()}

    def load_state_dict(self, state: dict[str, Arrays]) -> None:
        if "global" in state and len(self.global_arrays) <= 1:
            family = next(iter(self.global_arrays), "global")
            self.global_arrays = {family: state["global"]}
            return
        for family in self.global_arrays:
            if f"global-{family}" not in state:
                raise ValueError(
                    f"resume: the checkpoint has no adapter for model family '{family}' (has {sorted(state)})"
                )
            self.global_arrays[family] = state[f"global-{family}"]
