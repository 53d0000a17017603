"""LoRA adapters of different per-layer ranks as named arrays: which arrays form a layer, the rank of each layer,
and resizing to other ranks (zero-padded or truncated rank slots).

A LoRA layer's rank slots are A's rows and B's columns; slot i of every client of a layer is the same slot, so
adapters of different ranks are summed slot by slot after zero-padding (what ATLAS's clusters do; SecAgg+ only
sums arrays of one shape). Pure NumPy over peft's state-dict names.
"""

from __future__ import annotations

import numpy as np

Arrays = dict[str, np.ndarray]
PEFT_PREFIX = "base_model.model."
MASK_PREFIX = "rank-mask."  # a member's slot mask travels beside its padded layer: 1 for the slots it trained


def layers(arrays: Arrays) -> dict[str, tuple[str, str]]:
    """Module path -> (A's name, B's name), e.g. ``model.layers.3.self_attn.q_proj`` (the key peft's
    ``rank_pattern`` matches) for ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``."""
    found: dict[str, dict[str, str]] = {}
    for name in arrays:
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in name:
                path = name.split(marker)[0].removeprefix(PEFT_PREFIX)
                found.setdefault(path, {})[part] = name
    incomplete = [p for p, parts in found.items() if len(parts) != 2]
    if incomplete:
        raise ValueError(f"LoRA layers without both A and B: {incomplete[:3]}")
    return {path: (parts["lora_A"], parts["lora_B"]) for path, parts in sorted(found.items())}


def ranks(arrays: Arrays) -> dict[str, int]:
    """Each layer's rank (A's rows)."""
    return {path: int(arrays[a].shape[0]) for path, (a, _) in layers(arrays).items()}


def resize(arrays: Arrays, target: dict[str, int]) -> Arrays:
    """Every layer at the target rank: extra slots zero (A rows and B columns), missing slots cut off. Arrays that
    are not LoRA layers (slot masks) are left out."""
    out: Arrays = {}
    for path, (a_name, b_name) in layers(arrays).items():
        a, b, r = arrays[a_name], arrays[b_name], target[path]
        new_a = np.zeros((r, a.shape[1]), dtype=np.float32)
        new_b = np.zeros((b.shape[0], r), dtype=np.float32)
        keep = min(r, a.shape[0])
        new_a[:keep], new_b[:, :keep] = a[:keep], b[:, :keep]
        out[a_name], out[b_name] = new_a, new_b
    return out


def masks(own: dict[str, int], wire: dict[str, int]) -> Arrays:
    """Slot masks: per layer, 1 for the ``own`` rank's slots and 0 up to the ``wire`` rank."""
    out: Arrays = {}
    for path, width in wire.items():
        if not 1 <= own[path] <= width:
            raise ValueError(f"{path}: rank {own[path]} outside 1..{width}")
        out[MASK_PREFIX + path] = (np.arange(width) < own[path]).astype(np.float32)
    return out


def without_masks(arrays: Arrays) -> Arrays:
    return {k: v for k, v in arrays.items() if not k.startswith(MASK_PREFIX)}


def seeded_slots(arrays: Arrays, start: dict[str, int], seed: int) -> Arrays:
    """``arrays`` with A's rows from ``start[path]`` on drawn as peft initialises them (Kaiming-uniform,
    a = sqrt(5): U(-1/sqrt(fan_in), 1/sqrt(fan_in))) from a generator seeded by ``seed`` and the layer, B's columns
    left as they are (zero for fresh slots, so the adapter's output is unchanged). Every party that calls this
    with the same seed draws the same slots: fresh rank slots start alike on every client."""
    out = dict(arrays)
    for index, (path, (a_name, _)) in enumerate(layers(arrays).items()):
        a = arrays[a_name].copy()
        first = start.get(path, a.shape[0])
        if first < a.shape[0]:
            rng = np.random.default_rng([seed, index])
            bound = 1.0 / np.sqrt(a.shape[1])
            a[first:] = rng.uniform(-bound, bound, size=(a.shape[0] - first, a.shape[1]))
        out[a_name] = a.astype(np.float32)
    return out
