"""FedSA-LoRA's split of a LoRA adapter (pure NumPy over peft's state-dict names, no Flower).

Guo et al. (ICLR 2025, "Selective Aggregation for Low-Rank Adaptation in Federated Learning") find that LoRA's A
matrices learn what is common to the clients and its B matrices what is specific to each: A is shared (averaged
by the server), B is private (kept by each client). A layer's A is ``...<module>.lora_A.weight``, its B
``...<module>.lora_B.weight`` (``common.adapters.lora.ranks.layers``).
"""

from __future__ import annotations

import numpy as np

from common.adapters.lora.ranks import layers

Arrays = dict[str, np.ndarray]


def split(arrays: Arrays) -> tuple[Arrays, Arrays]:
    """(shared A matrices, private B matrices) of a whole LoRA adapter; every layer must have both, and nothing
    else may be in it (an array that is neither would otherwise travel, or stay home, unnoticed)."""
    pairs = layers(arrays)
    shared = {a: arrays[a] for a, _ in pairs.values()}
    private = {b: arrays[b] for _, b in pairs.values()}
    other = sorted(set(arrays) - set(shared) - set(private))
    if other:
        raise ValueError(f"fedsa-lora: arrays that are neither a LoRA A nor a LoRA B: {other[:3]}")
    return shared, private


def shared_part(arrays: Arrays) -> Arrays:
    """The A matrices: what is sent and averaged."""
    return split(arrays)[0]


def private_part(arrays: Arrays) -> Arrays:
    """The B matrices: what stays on the client."""
    return split(arrays)[1]


def merge(shared: Arrays, private: Arrays, reference: Arrays) -> Arrays:
    """The whole adapter from the global A matrices and a client's own B matrices, which together must have
    exactly ``reference``'s names and shapes (a B that is sent, or an A that is kept, is an error)."""
    for part, names, expected in (("A", shared, shared_part(reference)), ("B", private, private_part(reference))):
        if set(names) != set(expected):
            raise ValueError(
                f"fedsa-lora: the {part} matrices differ from the adapter's: missing "
                f"{sorted(set(expected) - set(names))[:3]}, extra {sorted(set(names) - set(expected))[:3]}"
            )
        wrong = [k for k in expected if np.shape(names[k]) != np.shape(expected[k])]
        if wrong:
            raise ValueError(
                f"fedsa-lora: {part} matrix {wrong[0]}: shape {np.shape(names[wrong[0]])} != "
                f"{np.shape(expected[wrong[0]])}"
            )
    return {**shared, **private}
