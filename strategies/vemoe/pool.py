"""VEMoE's server-side math as pure functions (NumPy in, NumPy out; no Flower): the one flat payload every client
sends, the experts recovered from its sum, and the open-world pool decisions (prune, merge, birth).

Server-oblivious aggregation (seed 002): client i sends, for EVERY slot k of the pool (K_max of them, so that
SecAgg+ sums vectors of one shape), r_ik * theta_ik (its trained expert k weighted by its responsibility; zeros
where r_ik = 0) and r_ik itself, plus a birth vote v_i in {0, 1}. A voter puts its candidate expert into the free
slot the server named for births (where every r_ik is 0, so nothing else is there), so the payload keeps the
shape of the pool. From the sum over clients alone the server sets theta_k = sum_i r_ik theta_ik / sum_i r_ik,
learns each expert's total responsibility sum_i r_ik and the newborn sum_i v_i c_i / sum_i v_i, never which
client uses which expert or voted. The expert ratios hold for group MEANS too (the common 1/n cancels); the vote
count needs the sum. Beside them each client sends its probe's loss gaps between live experts and each expert's
move from the base model, whose sums give the functional distance a merge can be judged by.

A LoRA expert is a dict of peft arrays (``...lora_A.weight`` / ``...lora_B.weight`` per layer).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from common.adapters.experts.adapter import slot_prefix
from common.adapters.lora.ranks import layers

from .wire import GAP, MOVE, RESPONSIBILITY, VOTE

Arrays = dict[str, np.ndarray]


def slot_key(slot: int, name: str) -> str:
    """A slot's array on the wire: the expert-pool adapter's naming (``common.adapters.experts.adapter``)."""
    return f"{slot_prefix(slot)}{name}"


def client_payload(
    trained: dict[int, Arrays],
    r: np.ndarray,
    template: Arrays,
    birth_slot: int | None = None,
    candidate: Arrays | None = None,
    probe: tuple[np.ndarray, float] | None = None,
) -> Arrays:
    """One client's payload: r_k * theta_k for every slot (``trained`` holds the experts it trained, by slot; any
    other slot is zeros), r and the vote; a voter (``candidate`` given) puts its candidate into ``birth_slot``, a
    slot where r is 0; ``probe`` (each slot's probe loss, NaN where free; the loss with no expert) gives
    ``probe_report``'s gaps and moves (zeros without). Every array has ``template``'s names and shapes, so every
    payload has the same length."""
    r = np.asarray(r, dtype=np.float64)
    if r.ndim != 1 or np.any(r < 0) or not np.isclose(r.sum(), 1.0):
        raise ValueError(f"responsibilities must be >= 0 and sum to 1, got {r.tolist()}")
    if missing := [k for k, value in enumerate(r) if value > 0 and k not in trained]:
        raise ValueError(f"slots {missing} carry responsibility but no trained expert")
    if candidate is not None and (birth_slot is None or not 0 <= birth_slot < len(r) or r[birth_slot] != 0):
        raise ValueError(f"a candidate goes into a free slot (r = 0) the server named, not {birth_slot}")
    out: Arrays = {}
    for slot in range(len(r)):
        expert = trained.get(slot)
        for name, shape in ((n, np.shape(a)) for n, a in template.items()):
            if slot == birth_slot and candidate is not None:
                value = np.asarray(candidate[name])
            elif expert is None or r[slot] == 0:
                value = np.zeros(shape)
            else:
                value = r[slot] * np.asarray(expert[name])
            out[slot_key(slot, name)] = np.asarray(value, dtype=np.float32)
    out[RESPONSIBILITY] = r.astype(np.float32)
    out[VOTE] = np.array([0.0 if candidate is None else 1.0], dtype=np.float32)
    out |= probe_report(np.full(len(r), np.nan) if probe is None else probe[0], np.nan if probe is None else probe[1])
    return out


GAP_MAX = 4.0  # nats per answer token: a gap or move is capped here, inside SecAgg+'s clipping range (8 by default)


def probe_report(losses: np.ndarray, base: float) -> Arrays:
    """A client's share of the functional distance: |L_k - L_l| for every pair of slots with a probe loss (K x K,
    flattened) and |L_base - L_k| per slot, ``L_base`` its probe loss with no expert routed; capped at ``GAP_MAX``
    (so one member moves a mean by at most GAP_MAX / n), 0 where a slot has no loss (free, or no probe)."""
    losses = np.asarray(losses, dtype=np.float64)
    probed = np.isfinite(losses)
    if not np.isfinite(base):
        probed[:] = False
    filled = np.where(probed, losses, 0.0)
    gaps = np.where(probed[:, None] & probed[None, :], np.abs(filled[:, None] - filled[None, :]), 0.0)
    moves = np.where(probed, np.abs(base - filled) if np.isfinite(base) else 0.0, 0.0)
    return {
        GAP: np.minimum(gaps, GAP_MAX).ravel().astype(np.float32),
        MOVE: np.minimum(moves, GAP_MAX).astype(np.float32),
    }


def functional_distance(gap_sum: np.ndarray, move_sum: np.ndarray, min_move: float = 1e-3) -> np.ndarray:
    """d_kl = sum_i |L_ik - L_il| / ((sum_i |L_base,i - L_ik| + sum_i |L_base,i - L_il|) / 2) from the payload sums:
    how differently two experts serve the clients' probe batches, relative to how far each moved them from the base
    model (0: the same function on every client's data; 1: they differ as much as either differs from the base).
    Scale-free, whatever each slot's random A: measured delta-W cosines are 0.01-0.1 whether two experts serve one
    category or different ones (each lives in its own subspace); this distance was 0.9-1.3 between the oracle's
    category experts and 0.01-0.2 between experts every category shared (``ni-categories``). NaN (never merged)
    where either expert moved the clients' probe losses by less than ``min_move`` in all: fresh experts (B = 0) tie
    exactly, which is not similarity."""
    moves = np.asarray(move_sum, dtype=np.float64)
    k = len(moves)
    gaps = np.asarray(gap_sum, dtype=np.float64).reshape(k, k)
    scale = (moves[:, None] + moves[None, :]) / 2
    moved = (moves[:, None] > min_move) & (moves[None, :] > min_move)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(moved, gaps / np.where(moved, scale, 1.0), np.nan)


SUM_TOLERANCE = 1e-3  # per member: float32 sums and SecAgg+'s quantisation (about 4e-6 a value with its defaults)


def sum_problem(total: Arrays, members: int, live: np.ndarray, tolerance: float = SUM_TOLERANCE) -> str | None:
    """Why a payload sum cannot come from ``members`` honest clients (None if it can). Each sends responsibilities
    >= 0 summing to 1 over the live slots and a vote of 0 or 1, so the slot totals lie in [0, n], are 0 on free
    slots and sum to n, and the votes are a whole number in [0, n]. The box and norm checks let through a member
    that votes 8 (a birth of its own candidate every round) or sends a responsibility of -8 (a slot's mass
    negative: every other expert pruned); the server divides by these totals, so it checks them first."""
    slack = tolerance * members
    totals = np.asarray(total[RESPONSIBILITY], dtype=np.float64)
    votes = float(np.asarray(total[VOTE], dtype=np.float64).reshape(-1)[0])
    if not np.all(np.isfinite(totals)) or not np.isfinite(votes):
        return "the responsibility totals or the votes are not finite"
    if not -slack <= votes <= members + slack or abs(votes - round(votes)) > slack:
        return f"{votes:.4g} birth votes from {members} members (each votes 0 or 1)"
    if totals.min() < -slack or totals.max() > members + slack:
        return f"a slot's responsibility total is outside [0, {members}] ({totals.min():.4g} .. {totals.max():.4g})"
    free = ~np.asarray(live, dtype=bool)
    if free.any() and totals[free].max() > slack:
        return f"free slot(s) {np.flatnonzero(free & (totals > slack)).tolist()} carry responsibility"
    if abs(totals.sum() - members) > slack:
        return f"the responsibility totals sum to {totals.sum():.4g}, not to the {members} members (each sums to 1)"
    for key in (GAP, MOVE):  # what a merge is judged by: each member's share is in [0, GAP_MAX]
        values = np.asarray(total[key], dtype=np.float64)
        if not np.all(np.isfinite(values)) or values.min() < -slack or values.max() > members * GAP_MAX + slack:
            return f"the probe {key.split('-')[1]} sums are outside [0, {members} x {GAP_MAX}]"
    return None


def experts_from_sum(
    total: Arrays, previous: Sequence[Arrays], min_responsibility: float = 1e-6
) -> tuple[list[Arrays], np.ndarray]:
    """theta_k = sum_i r_ik theta_ik / sum_i r_ik for every slot, and sum_i r_ik (the slot totals), from a payload
    sum (or mean). A slot whose total is at most ``min_responsibility`` keeps ``previous[k]``: nobody trained it."""
    totals = np.asarray(total[RESPONSIBILITY], dtype=np.float64)
    if len(totals) != len(previous):
        raise ValueError(f"{len(totals)} slot totals for a pool of {len(previous)} slots")
    experts = []
    for slot, kept in enumerate(previous):
        if totals[slot] <= min_responsibility:
            experts.append(kept)
            continue
        experts.append(
            {
                name: (np.asarray(total[slot_key(slot, name)], dtype=np.float64) / totals[slot]).astype(np.float32)
                for name in kept
            }
        )
    return experts, totals


def newborn(total: Arrays, votes: float, slot: int, template: Arrays) -> Arrays:
    """The mean of the voters' candidates, sum_i v_i c_i / sum_i v_i, from the birth slot of a payload SUM with
    ``votes`` voters."""
    if votes <= 0:
        raise ValueError("no votes, no newborn")
    return {name: (np.asarray(total[slot_key(slot, name)]) / votes).astype(np.float32) for name in template}


def prune(
    totals: np.ndarray, live: np.ndarray, low_rounds: np.ndarray, threshold: float, patience: int
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Count, per live slot, the consecutive rounds its share of the round's responsibility mass was below
    ``threshold``; free the slots that reach ``patience`` (never the last live one: the one with the largest
    share stays). Returns (live, low_rounds, pruned slots)."""
    totals = np.asarray(totals, dtype=np.float64)
    live = np.asarray(live, dtype=bool).copy()
    mass = totals[live].sum()
    share = np.where(live, totals / mass if mass > 0 else 0.0, 0.0)
    low = np.where(live & (share < threshold), np.asarray(low_rounds) + 1, 0)
    pruned = [int(k) for k in np.flatnonzero(live & (low >= patience))]
    if len(pruned) == int(live.sum()):  # keep the most used one
        pruned.remove(int(np.argmax(np.where(live, share, -1.0))))
    live[pruned] = False
    low[pruned] = 0
    return live, low, pruned


def delta_w(expert: Arrays) -> np.ndarray:
    """The expert's weight change, every layer's B @ A flattened and concatenated (the scale alpha / r is common
    to every expert, so it does not change a cosine)."""
    parts = [_product(expert, a, b).ravel() for _, (a, b) in sorted(layers(expert).items())]
    return np.concatenate(parts) if parts else np.zeros(0)


def merge_pairs(
    experts: Sequence[Arrays],
    live: np.ndarray,
    threshold: float,
    distance: np.ndarray | None = None,
    max_distance: float = 0.0,
) -> list[tuple[int, int, dict[str, float]]]:
    """Pairs of live slots that compute nearly the same thing: delta-W cosine above ``threshold``, or (``distance``
    from ``functional_distance``, ``max_distance`` > 0) a functional distance below ``max_distance``; closest first
    (by 1 - cosine or the distance, whichever is smaller), each slot in at most one pair: (kept slot, merged slot,
    the pair's measures), the kept one the lower slot."""
    slots = [int(k) for k in np.flatnonzero(np.asarray(live, dtype=bool))]
    vectors = {k: delta_w(experts[k]) for k in slots}
    norms = {k: float(np.linalg.norm(v)) for k, v in vectors.items()}
    scored = []
    for i, a in enumerate(slots):
        for b in slots[i + 1 :]:
            if not (norms[a] > 0 and norms[b] > 0):
                continue
            measures = {"cosine": float(vectors[a] @ vectors[b] / (norms[a] * norms[b]))}
            if distance is not None and np.isfinite(distance[a, b]):
                measures["distance"] = float(distance[a, b])
            near = max_distance > 0 and measures.get("distance", np.inf) < max_distance
            if measures["cosine"] > threshold or near:
                gap = min(1 - measures["cosine"], measures.get("distance", np.inf))
                scored.append((gap, a, b, measures))
    pairs, used = [], set[int]()
    for _, a, b, measures in sorted(scored, key=lambda t: (t[0], t[1], t[2])):
        if a not in used and b not in used:
            pairs.append((a, b, measures))
            used |= {a, b}
    return pairs


def merge(kept: Arrays, merged: Arrays, r_kept: float, r_merged: float) -> Arrays:
    """An expert that computes the responsibility-weighted mean of what the two compute (both weights 0: the plain
    mean): per layer dW = w B_kept A_kept + (1 - w) B_merged A_merged, factored back at the slot's rank r by a
    truncated SVD (B = U_r sqrt(S_r), A = sqrt(S_r) V_r^T). Exact when that mean has rank <= r (e.g. experts that
    share A), else the closest rank-r dW (Eckart-Young). Averaging A and B array by array is not the mean dW: each
    slot starts from its own random A (a toy pair's merge was 0.72 of the true mean's norm, cosine 0.73)."""
    w = np.array([r_kept, r_merged], dtype=np.float64)
    w = w / w.sum() if w.sum() > 0 else np.array([0.5, 0.5])
    out: Arrays = {}
    for a_name, b_name in layers(kept).values():
        mean = w[0] * _product(kept, a_name, b_name) + w[1] * _product(merged, a_name, b_name)
        rank = np.asarray(kept[a_name]).shape[0]
        u, sv, vt = np.linalg.svd(mean, full_matrices=False)
        root = np.sqrt(sv[:rank])
        out[b_name] = (u[:, :rank] * root).astype(np.float32)
        out[a_name] = (root[:, None] * vt[:rank]).astype(np.float32)
    return {name: out[name] for name in kept}


def _product(expert: Arrays, a_name: str, b_name: str) -> np.ndarray:
    return np.asarray(expert[b_name], dtype=np.float64) @ np.asarray(expert[a_name], dtype=np.float64)


def free_slot(live: np.ndarray) -> int | None:
    """The slot a newborn expert would take (the lowest free one); None when every slot is taken (the pool never
    exceeds K_max)."""
    free = np.flatnonzero(~np.asarray(live, dtype=bool))
    return int(free[0]) if free.size else None


def birth_slot(votes: float, live: np.ndarray, min_votes: int) -> int | None:
    """The free slot a newborn expert takes (``free_slot``), when at least ``min_votes`` clients voted; None when too
    few voted or every slot is taken."""
    return free_slot(live) if votes >= min_votes else None
