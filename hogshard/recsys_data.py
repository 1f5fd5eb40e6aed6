"""Click-prediction data for DLRM: the Open Bandit Dataset logs, and Criteo-shaped synthetic data.

Both give a :class:`RecsysDataset`: float32 dense features, one int64 id per categorical
feature (single-hot), float32 0/1 labels and a seeded train/test split.

- :func:`load_open_bandit` reads ``../shared/data/open-bandit-dataset`` (see its README,
  section 2): all six (policy, campaign) logs pooled; categorical features item id (per
  campaign), position, user features 0..3, item features 1..3 (joined from item_context.csv),
  hashed to unbounded int64 ids; dense features price, the shown item's affinity, the summed
  affinities (log1p); a stratified split.
- :func:`synthetic_criteo`: 13 dense and 26 categorical features, ids drawn over large
  vocabularies by :func:`zipf_ranks` (default: p(rank k) ~ k^-1.1, a few ids covering most
  samples, as in Criteo's categorical features) or log-uniformly (``id_dist="loguniform"``),
  then scattered over the id range by a hash (the hot ids are not the small integers); labels
  drawn from a fixed hidden model (a linear term on the dense features plus a hashed weight
  per (feature, id)), so ``oracle_auc`` (the hidden model's own AUC on the test split) is a
  known ceiling.

Example::

    >>> data = synthetic_criteo(2000, seed=0, vocab=1000)
    >>> data.dense.shape, data.sparse.shape, data.vocab[:2]
    ((2000, 13), (2000, 26), [1000, 1000])
    >>> 0.5 < data.oracle_auc < 1.0
    True
    >>> ranks = zipf_ranks(np.random.default_rng(0), 100_000, vocab=10**6, exponent=1.1)
    >>> round(float((ranks < 10_000).mean()), 2)      # the top 1 % of ids: 82 % of samples
    0.82
"""

from __future__ import annotations

import csv
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hogshard.datasets import SHARED_DATA, DatasetError
from hogshard.proto.hashing import hash_strings, name_key, splitmix64, uniform01

log = logging.getLogger(__name__)

OPEN_BANDIT = SHARED_DATA / "open-bandit-dataset"
OBD_LOGS = [(p, c) for p in ("random", "bts") for c in ("all", "men", "women")]
#: How ``synthetic_criteo`` draws a feature's id ranks.
ID_DISTS = ("zipf", "loguniform")
#: The default Zipf exponent: the top 1 % of 10^6 ids take 82 % of the samples, the top
#: 0.1 % 69 % (heavy-tailed, as Criteo's large categorical features: a few ids, most samples).
DEFAULT_ZIPF_EXPONENT = 1.1


@dataclass
class RecsysDataset:
    """``dense`` (N, D) float32, ``sparse`` (N, F) int64 ids, ``labels`` (N,) float32;
    ``vocab[f]`` is feature f's id range (None: hashed ids anywhere in [0, 2^63))."""

    name: str
    dense: np.ndarray
    sparse: np.ndarray
    labels: np.ndarray
    train: np.ndarray
    test: np.ndarray
    vocab: list[int | None]
    oracle_auc: float | None = None

    @property
    def num_sparse(self) -> int:
        return int(self.sparse.shape[1])


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties get average ranks); nan if one class."""
    scores, labels = np.asarray(scores, np.float64), np.asarray(labels) > 0.5
    positives = int(labels.sum())
    negatives = labels.size - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(scores.size)
    ranks[order] = np.arange(1, scores.size + 1)
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ranks = (np.bincount(inverse, weights=ranks) / counts)[inverse]
    return float((ranks[labels].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def logloss(probs: np.ndarray, labels: np.ndarray) -> float:
    p = np.clip(np.asarray(probs, np.float64), 1e-7, 1 - 1e-7)
    y = np.asarray(labels, np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Seeded (train, test) index arrays with the same positive rate in both."""
    rng = np.random.default_rng([seed, 0x5EED])
    train, test = [], []
    for cls in (0, 1):
        members = rng.permutation(np.flatnonzero((labels > 0.5) == bool(cls)))
        cut = int(round(members.size * test_fraction))
        test.append(members[:cut])
        train.append(members[cut:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def zipf_ranks(rng: np.random.Generator, n: int, vocab: int, exponent: float) -> np.ndarray:
    """``n`` ranks in [0, vocab) with p(rank k) proportional to (k + 1)^-exponent (a Zipf
    law truncated at ``vocab``; any exponent > 0), by rejection-inversion (Hoermann and
    Derflinger, 1996): O(n) time, no table over the vocabulary, about 1.1 draws per rank."""
    if not (isinstance(exponent, (int, float)) and math.isfinite(exponent) and exponent > 0):
        raise ValueError(f"the Zipf exponent must be a finite number > 0; got {exponent!r}")
    if vocab < 1:
        raise ValueError(f"vocab must be >= 1; got {vocab}")
    s = float(exponent)

    def h_integral(x: np.ndarray | float) -> np.ndarray:  # integral of x^-s, shifted
        log_x = np.log(x)
        return _expm1_over(1.0 - s, log_x) * log_x

    def h_integral_inverse(y: np.ndarray) -> np.ndarray:
        t = np.maximum(y * (1.0 - s), -1.0 + 1e-16)
        return np.exp(_log1p_over(t) * y)

    lo, hi = float(h_integral(1.5)) - 1.0, float(h_integral(vocab + 0.5))
    squeeze = 2.0 - float(h_integral_inverse(np.array(h_integral(2.5) - 2.0 ** -s)))
    out = np.empty(n, np.int64)
    todo = np.arange(n)
    while todo.size:
        u = hi + rng.random(todo.size) * (lo - hi)
        x = h_integral_inverse(u)
        k = np.clip(np.floor(x + 0.5), 1, vocab)
        ok = (k - x <= squeeze) | (u >= h_integral(k + 0.5) - k ** -s)
        out[todo[ok]] = k[ok].astype(np.int64) - 1
        todo = todo[~ok]
    return out


def _expm1_over(a: float, x: np.ndarray) -> np.ndarray:
    """(exp(a x) - 1) / (a x), 1 at a x = 0."""
    ax = a * x
    safe = np.where(np.abs(ax) > 1e-8, ax, 1.0)
    return np.where(np.abs(ax) > 1e-8, np.expm1(safe) / safe, 1.0 + ax / 2.0)


def _log1p_over(t: np.ndarray) -> np.ndarray:
    """log1p(t) / t, 1 at t = 0."""
    safe = np.where(np.abs(t) > 1e-8, t, 1.0)
    return np.where(np.abs(t) > 1e-8, np.log1p(safe) / safe, 1.0 - t / 2.0)


def synthetic_criteo(
    n: int, seed: int = 0, vocab: int | list[int] = 1_000_000, num_dense: int = 13,
    num_sparse: int = 26, test_fraction: float = 0.2, id_weight: float = 0.6,
    bias: float = -1.0, hidden_seed: int = 1234, id_dist: str = "zipf",
    zipf_exponent: float | list[float] = DEFAULT_ZIPF_EXPONENT,
) -> RecsysDataset:
    """Criteo-shaped click data from a fixed hidden model (see the module docstring).

    ``vocab`` is one id range for every feature, or one per feature. ``id_dist``: ``zipf``
    (ranks by :func:`zipf_ranks` with ``zipf_exponent``, one for every feature or one per
    feature) or ``loguniform`` (p(rank r) ~ 1/(r+1) as a continuous law: most of a batch's ids
    are rare). The rank -> id scatter and the hidden model depend only on ``hidden_seed``, so
    data sets with different ``seed`` share their hot ids and their labelling."""
    vocabs = [int(vocab)] * num_sparse if isinstance(vocab, int) else [int(v) for v in vocab]
    if len(vocabs) != num_sparse or min(vocabs) < 1:
        raise ValueError(f"vocab must be a positive int or {num_sparse} positive ints")
    if id_dist not in ID_DISTS:
        raise ValueError(f"id_dist must be one of {', '.join(ID_DISTS)}; got {id_dist!r}")
    exponents = ([zipf_exponent] * num_sparse if isinstance(zipf_exponent, (int, float))
                 else list(zipf_exponent))
    if len(exponents) != num_sparse:
        raise ValueError(f"zipf_exponent must be one number or {num_sparse} numbers")
    rng = np.random.default_rng([seed, n])
    dense = rng.standard_normal((n, num_dense)).astype(np.float32)
    w_dense = np.random.default_rng(hidden_seed).normal(0.0, 0.4, num_dense)
    logits = dense.astype(np.float64) @ w_dense + bias
    sparse = np.empty((n, num_sparse), np.int64)
    for f, v in enumerate(vocabs):
        if id_dist == "zipf":
            ranks = zipf_ranks(rng, n, v, exponents[f])
        else:
            u = rng.random(n)
            ranks = np.minimum(np.floor(np.exp(u * np.log(v + 1.0))) - 1, v - 1).astype(np.int64)
        salt = np.uint64(name_key(f"feature{f}") ^ hidden_seed)
        sparse[:, f] = (splitmix64(ranks.view(np.uint64) ^ salt) % np.uint64(v)).astype(np.int64)
        key = np.uint64(name_key(f"weight{f}") ^ hidden_seed)
        logits += (uniform01(sparse[:, f].view(np.uint64) ^ key) * 2.0 - 1.0) * id_weight
    labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    train, test = stratified_split(labels, test_fraction, seed)
    shape = "loguniform" if id_dist == "loguniform" else f"zipf={_short(exponents)}"
    return RecsysDataset(f"synthetic-criteo(n={n},seed={seed},{shape})", dense, sparse, labels,
                         train, test, list(vocabs), oracle_auc=auc(logits[test], labels[test]))


def _short(values: list[float]) -> str:
    return f"{values[0]:g}" if len(set(values)) == 1 else "per-feature"


def _read_csv(path: Path) -> tuple[list[str], list[list[str]]]:
    try:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
    except OSError as err:
        raise DatasetError(f"cannot read {path}: {err}") from None
    if not rows:
        raise DatasetError(f"{path} is empty")
    return rows[0], rows[1:]


def load_open_bandit(root: Path = OPEN_BANDIT, test_fraction: float = 0.2, seed: int = 0
                     ) -> RecsysDataset:
    """All six Open Bandit logs pooled (60,000 impressions, about 0.5% clicks)."""
    if not root.is_dir():
        raise DatasetError(f"no Open Bandit Dataset at {root}")
    cats: list[list[str]] = [[] for _ in range(9)]
    dense_rows: list[list[float]] = []
    labels: list[float] = []
    for policy, campaign in OBD_LOGS:
        folder = root / policy / campaign
        head, rows = _read_csv(folder / f"{campaign}.csv")
        ihead, items = _read_csv(folder / "item_context.csv")
        col = {name: i for i, name in enumerate(head)}
        icol = {name: i for i, name in enumerate(ihead)}
        try:
            item_info = {r[icol["item_id"]]: r for r in items}
            first_aff = col["user-item_affinity_0"]
            for r in rows:
                item = item_info[r[col["item_id"]]]
                affinities = np.asarray(r[first_aff:], dtype=np.float64)
                values = [f"{campaign}/{r[col['item_id']]}", r[col["position"]]]
                values += [r[col[f"user_feature_{k}"]] for k in range(4)]
                values += [item[icol[f"item_feature_{k}"]] for k in (1, 2, 3)]
                for k, value in enumerate(values):
                    cats[k].append(value)
                shown = affinities[int(r[col["item_id"]])]
                dense_rows.append([float(item[icol["item_feature_0"]]), float(shown),
                                   float(np.log1p(affinities.sum()))])
                labels.append(float(r[col["click"]]))
        except (KeyError, ValueError, IndexError) as err:
            raise DatasetError(f"{folder}: unexpected format ({err!r})") from None
    dense = np.asarray(dense_rows, np.float64)
    dense = ((dense - dense.mean(0)) / (dense.std(0) + 1e-9)).astype(np.float32)
    sparse = np.stack([hash_strings(values, namespace=f"obd{k}")
                       for k, values in enumerate(cats)], axis=1)
    y = np.asarray(labels, np.float32)
    train, test = stratified_split(y, test_fraction, seed)
    log.info("open bandit: %d rows, %d clicks, %d categorical features", y.size, int(y.sum()),
             sparse.shape[1])
    return RecsysDataset("open-bandit", dense, sparse, y, train, test, [None] * sparse.shape[1])
