"""A hostile SecAgg+ member, as a ClientApp mod around ``secaggplus_mod``: what one member can do to its group that
Flower's protocol does not stop (tests only; the product ships no attack code).

Attacks, applied in the stage where the member sends its masked vector:
- ``shift``: adds 4 x quantization_range to every masked coordinate (far outside what honest members can sum);
- ``nudge``: adds a quarter of the quantization range (inside the box, beyond the norm members clip to);
- ``long`` / ``scalar`` / ``short``: a masked update of one extra coordinate, of shape (1,), or missing;
- ``dropout``: raises instead of sending its masked vector (after the share-keys stage: its masks must be removed).
"""

from __future__ import annotations

import io
from collections.abc import Callable

import numpy as np
from flwr.app import Context, Message
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

from common.core_sections import MODULUS_RANGE, SecAggSection

ATTACKS = ("shift", "nudge", "long", "scalar", "short", "dropout")


def _array(blob: bytes) -> np.ndarray:
    return np.load(io.BytesIO(blob), allow_pickle=False)


def _bytes(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array, allow_pickle=False)
    return out.getvalue()


def tamper(payload: list[bytes], attack: str, quantization_range: int) -> list[bytes]:
    """The masked reply (factor, update) as the attack rewrites it."""
    factor, update = payload
    vector = _array(update)
    if attack in ("shift", "nudge"):
        offset = 4 * quantization_range if attack == "shift" else quantization_range // 4
        return [factor, _bytes((vector + offset) % MODULUS_RANGE)]
    if attack == "long":
        return [factor, _bytes(np.concatenate([vector, vector[:1]]))]
    if attack == "scalar":
        return [factor, _bytes(vector[:1].copy())]
    if attack == "short":
        return [factor]
    raise ValueError(f"unknown attack {attack!r}")


def hostile_mod(plan: Callable[[int, str], str | None]) -> Callable:
    """A mod that attacks as ``plan(partition_id, group_id)`` says (None: honest); group_id is the server round."""

    def mod(msg: Message, context: Context, call_next) -> Message:
        configs = msg.content.config_records.get(RECORD_KEY_CONFIGS)
        attack = plan(int(context.node_config["partition-id"]), msg.metadata.group_id)
        if configs is None or attack is None or configs.get(Key.STAGE) != Stage.COLLECT_MASKED_VECTORS:
            return call_next(msg, context)
        if attack == "dropout":
            raise RuntimeError("hostile member: dropping out after the share-keys stage")
        reply = call_next(msg, context)
        out = reply.content.config_records[RECORD_KEY_CONFIGS]
        out[Key.MASKED_PARAMETERS] = tamper(
            list(out[Key.MASKED_PARAMETERS]), attack, SecAggSection().quantization_range
        )
        return reply

    return mod


# Attacks on what a member REPLIES (before SecAgg+ masks it, so in both transports): each passes the box and norm
# checks; the server must refuse it where replies or sums are checked, and the run must go on.
REPLY_ATTACKS = ("metric", "vote", "mask")
MASK_EPSILON = 0.02


def tamper_reply(arrays: dict[str, np.ndarray], metrics: dict, attack: str, members: int) -> tuple[dict, dict]:
    """A train reply's (arrays, metrics) as ``attack`` rewrites them:

    - ``metric``: values the server once converted unchecked (``secagg_clipped="x"`` crashed the row builder);
    - ``vote``: a VEMoE birth vote of 8 (honest: 0 or 1), a birth of its own candidate every round;
    - ``mask``: an ATLAS rank mask of -(members - 1) + e on slot 0 (honest: 1), shrinking the group's mean mask
      there to about e / members, which ``slot_average`` divides by."""
    from common.adapters.lora import ranks as lora_ranks
    from strategies.vemoe.pool import VOTE

    if attack == "metric":
        return arrays, {**metrics, "secagg_clipped": "x", "vemoe_top": "1,nan", "beta": "lots"}
    if attack == "vote":
        return {**arrays, VOTE: np.full_like(arrays[VOTE], 8.0)}, metrics
    if attack == "mask":
        out = dict(arrays)
        for name in arrays:
            if name.startswith(lora_ranks.MASK_PREFIX):
                out[name] = arrays[name].copy()
                out[name][0] = -(members - 1) + MASK_EPSILON
        return out, metrics
    raise ValueError(f"unknown reply attack {attack!r}")
