"""Data-free geometric alignment of P/Q (orthogonal Procrustes on synthetic anchors). Pure numpy, no torch.

Clients with different base models train P/Q in their own r-dimensional coordinates. Before P/Q are mixed, a
client's outgoing P/Q can be rotated so that, on shared synthetic anchors in r-space (no client data involved),
its map z -> P z + Q lands as close as an orthogonal rotation allows to a reference map (the received global P/Q).
"""

from __future__ import annotations

import numpy as np


def synthetic_anchors(r: int, n: int, seed: int) -> np.ndarray:
    """``n`` x ``r`` standard Gaussian anchors from a seeded numpy Generator (identical on every client)."""
    if r < 1 or n < 1:
        raise ValueError(f"synthetic_anchors: r and n must be >= 1, got r={r}, n={n}")
    return np.random.default_rng(seed).standard_normal((n, r))


def procrustes_rotation(source: np.ndarray, target: np.ndarray) -> np.ndarray:
    """The orthogonal R (k x k) minimising ||source @ R - target||_F: R = U V^T from the SVD of source^T target."""
    source, target = np.asarray(source, dtype=np.float64), np.asarray(target, dtype=np.float64)
    if source.ndim != 2 or source.shape != target.shape:
        raise ValueError(f"procrustes_rotation: source {source.shape} and target {target.shape} must be equal n x k")
    u, _, vt = np.linalg.svd(source.T @ target)
    return u @ vt


def align_pq(P: np.ndarray, Q: np.ndarray, P_ref: np.ndarray, Q_ref: np.ndarray, anchors: np.ndarray):
    """Rotate one adapter's (P, Q) onto a reference (P_ref, Q_ref); returns (P', Q', error_before, error_after).

    This is the seed's heuristic: it rotates a client's OUTGOING P/Q output coordinates onto the reference
    frame. With anchors Z (n x r), F = Z P^T + Q and F_ref = Z P_ref^T + Q_ref; R = procrustes_rotation(F, F_ref);
    P' = R^T P and Q' = R^T Q, so that Z P'^T + Q' = F R. The frozen B is not rotated with it, so the aligned
    adapter is NOT the same function as the original one; the rotation only makes P/Q of different clients
    comparable before they are mixed. Errors are relative Frobenius errors ||F - F_ref|| / ||F_ref|| (before) and
    ||F R - F_ref|| / ||F_ref|| (after). error_after <= error_before always: Procrustes is optimal over all
    rotations, identity included, and if float rounding ever says otherwise the inputs are returned unchanged.
    If ||F_ref|| is ~0 (the reference is not trained yet) the inputs come back unchanged with both errors nan.
    """
    P64, Q64 = np.asarray(P, dtype=np.float64), np.asarray(Q, dtype=np.float64)
    Pr64, Qr64 = np.asarray(P_ref, dtype=np.float64), np.asarray(Q_ref, dtype=np.float64)
    Z = np.asarray(anchors, dtype=np.float64)
    r = P64.shape[0]
    if P64.shape != (r, r) or Pr64.shape != (r, r) or Q64.shape != (r,) or Qr64.shape != (r,):
        raise ValueError(
            f"align_pq: expected P, P_ref (r x r) and Q, Q_ref (r,), got {P64.shape}, {Pr64.shape}, "
            f"{Q64.shape}, {Qr64.shape}"
        )
    if Z.ndim != 2 or Z.shape[1] != r:
        raise ValueError(f"align_pq: anchors must be n x {r}, got {Z.shape}")

    unchanged = (np.array(P, copy=True), np.array(Q, copy=True))
    F = Z @ P64.T + Q64
    F_ref = Z @ Pr64.T + Qr64
    ref_norm = np.linalg.norm(F_ref)
    # Relative threshold: ~0 compared with the anchors' own scale (an untrained, all-zero reference).
    if ref_norm <= 1e-12 * max(1.0, float(np.linalg.norm(Z))):
        return unchanged[0], unchanged[1], float("nan"), float("nan")
    R = procrustes_rotation(F, F_ref)
    before = float(np.linalg.norm(F - F_ref) / ref_norm)
    after = float(np.linalg.norm(F @ R - F_ref) / ref_norm)
    if after > before:  # only possible through rounding when R ~ I: keep the inputs, keep the guarantee
        return unchanged[0], unchanged[1], before, before
    dtype = np.result_type(np.asarray(P).dtype, np.asarray(Q).dtype, np.float32)  # float out, even for int input
    return (R.T @ P64).astype(dtype), (R.T @ Q64).astype(dtype), before, after


def align_arrays(arrays: dict[str, np.ndarray], reference: dict[str, np.ndarray], anchors: np.ndarray):
    """``align_pq`` on every ``block{i}.{proj}`` whose ``.P`` and ``.Q`` are in both dicts.

    Returns (aligned arrays, {``block{i}.{proj}``: (error_before, error_after)}); other arrays pass through unchanged.
    """
    out = dict(arrays)
    errors: dict[str, tuple[float, float]] = {}
    for name in sorted(arrays):
        if not name.endswith(".P"):
            continue
        prefix = name[:-2]
        keys = (f"{prefix}.P", f"{prefix}.Q")
        if all(k in arrays and k in reference for k in keys):
            P, Q, before, after = align_pq(
                arrays[keys[0]], arrays[keys[1]], reference[keys[0]], reference[keys[1]], anchors
            )
            out[keys[0]], out[keys[1]] = P, Q
            errors[prefix] = (before, after)
    return out, errors
