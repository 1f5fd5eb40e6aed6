"""Serving from an export (``hogshard export``): an ordinary torch model in one process, with
no hogshard servers. The format is :mod:`hogshard.proto.export_format`.

:func:`load_exported` reads a full export and, in order, any incremental ones on top of it
(every file checked against its manifest's size and SHA-256). Build the model as for training
with :meth:`ExportedModel.bag` in place of each ``RemoteEmbeddingBag`` (same name, dim and
mode), then :meth:`ExportedModel.load_dense` copies a dense table into the model's parameters,
each value into the parameter it came from, whatever the optimizer's parameter groups: the
export records where ``PSOptimizer`` laid each parameter out (:mod:`hogshard.worker.layout`
matches them to the model's, by name or by group and shape). An id
the export does not hold gets the table's deterministic initial row, as a server creates it on
first touch, so the model's outputs equal the cluster's for the same weights.

Example::

    exported = load_exported("export/")              # or load_exported(full, incremental)
    bags = [exported.bag(f"cat{f}", mode="sum") for f in range(26)]
    model = exported.load_dense(DLRM(13, bags, 16), table="dlrm-dense").eval()
    probs = torch.sigmoid(model(dense, sparse))
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hogshard.proto.errors import CheckpointError, ConfigError, ProtocolError
from hogshard.proto.export_format import DENSE_FILE, MANIFEST, check_export_manifest
from hogshard.proto.hashing import init_rows
from hogshard.proto.manifest import digest
from hogshard.proto.param_layout import check_param_layout
from hogshard.proto.tables import EmbeddingSpec
from hogshard.worker.layout import given_params, match_layout

INT64, FLOAT32 = np.dtype("<i8"), np.dtype("<f4")
M = TypeVar("M", bound=nn.Module)
log = logging.getLogger(__name__)


@dataclass
class ExportedTable:
    """One embedding table of an export: its spec and the rows it holds (sorted ids)."""

    spec: EmbeddingSpec
    ids: np.ndarray
    weights: np.ndarray

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """The rows of ``ids`` (int64), shape ``(len(ids), dim)``: exported or initial."""
        n = self.spec.num_embeddings
        if ids.size and (ids.min() < 0 or (n is not None and ids.max() >= n)):
            raise ProtocolError(f"table {self.spec.name!r}: ids must lie in "
                                f"[0, {n if n is not None else '2^63'}); got "
                                f"[{int(ids.min())}, {int(ids.max())}]")
        out = np.empty((ids.size, self.spec.dim), FLOAT32)
        pos = np.minimum(np.searchsorted(self.ids, ids), max(self.ids.size - 1, 0))
        found = (self.ids[pos] == ids) if self.ids.size else np.zeros(ids.size, bool)
        out[found] = self.weights[pos[found]]
        if not found.all():
            out[~found] = init_rows(self.spec.seed, self.spec.name, ids[~found],
                                    self.spec.dim, self.spec.scale)
        return out

    def update(self, newer: ExportedTable) -> None:
        """Take the rows of an incremental export (they replace the ones held)."""
        if newer.spec != self.spec:
            raise CheckpointError(f"table {self.spec.name!r}: the incremental export declares "
                                  f"{newer.spec.to_wire()}; the base {self.spec.to_wire()}")
        ids = np.concatenate([newer.ids, self.ids])
        weights = np.concatenate([newer.weights, self.weights])
        self.ids, first = np.unique(ids, return_index=True)  # the newer row wins
        self.weights = weights[first]


class ServingEmbeddingBag(nn.Module):
    """``nn.EmbeddingBag``-shaped lookup of an exported table (``mode`` as torch's: ``mean``
    by default, ``sum``, ``max``); like ``RemoteEmbeddingBag`` it holds no ``nn.Parameter``,
    and pools the unique ids' rows the same way (so the outputs match it bit for bit)."""

    def __init__(self, table: ExportedTable, mode: str = "mean") -> None:
        super().__init__()
        if mode not in ("sum", "mean", "max"):
            raise ConfigError(f"mode must be 'sum', 'mean' or 'max'; got {mode!r}")
        self.table, self.mode = table, mode
        self.embedding_dim = table.spec.dim

    def extra_repr(self) -> str:
        return f"{self.table.spec.name!r}, rows={self.table.ids.size}, mode={self.mode!r}"

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        flat = indices.detach().reshape(-1).to("cpu", torch.int64).numpy()
        ids, inverse = np.unique(flat, return_inverse=True)
        weight = torch.from_numpy(self.table.rows(ids))
        inv = torch.from_numpy(inverse.reshape(indices.shape).astype(np.int64))
        return F.embedding_bag(inv, weight, offsets, mode=self.mode,
                               per_sample_weights=per_sample_weights)


@dataclass
class ExportedModel:
    """The dense tables (flat float32) and embedding tables of one or more exports."""

    dense: dict[str, np.ndarray] = field(default_factory=dict)
    tables: dict[str, ExportedTable] = field(default_factory=dict)
    manifests: list[dict[str, Any]] = field(default_factory=list)
    #: Each dense table's parameter layout (proto/param_layout.py); None in an export written
    #: before exports recorded it.
    layouts: dict[str, list[list[Any]] | None] = field(default_factory=dict)

    def bag(self, name: str, mode: str = "mean") -> ServingEmbeddingBag:
        """A module serving embedding table ``name``."""
        if name not in self.tables:
            raise ConfigError(f"the export holds no embedding table {name!r}; it holds "
                              f"{sorted(self.tables)}")
        return ServingEmbeddingBag(self.tables[name], mode)

    def load_dense(self, module: M, table: str = "model", params: Iterable[Any] | None = None
                   ) -> M:
        """Copy dense table ``table`` into ``module``'s parameters, each value into the
        parameter it was trained as, and return ``module``. The export's layout says where
        each parameter lies; they are found in ``module`` by name where the optimizer had names
        (``named_parameters()``), else by parameter group and shape (ConfigError where that
        fits more than one way or none). ``params``: what the optimizer was given (parameters
        or parameter groups, built from ``module``), which says the order exactly. An export
        that records no layout is read in ``params``' order, else in
        ``module.named_parameters()`` order (right for an optimizer given
        ``model.parameters()`` or ``model.named_parameters()``, one group). Shapes or sizes
        that do not match are a ConfigError; nothing is copied then."""
        if table not in self.dense:
            raise ConfigError(f"the export holds no dense table {table!r}; it holds "
                              f"{sorted(self.dense)}")
        flat, layout = self.dense[table], self.layouts.get(table)
        if params is not None:
            targets = given_params(params)
            if layout is not None:
                for p, entry in zip(targets, layout, strict=False):
                    if list(p.shape) != list(entry[3]):
                        raise ConfigError(f"params= lists a parameter of shape "
                                          f"{tuple(p.shape)} where the table holds "
                                          f"{entry[0] or 'one'} of shape {tuple(entry[3])}")
        elif layout is not None:
            targets = [p for _, p in match_layout(module, layout)]
        else:
            log.warning("the export of table %r records no parameter layout (an older export): "
                        "loading it in named_parameters() order, right only where the optimizer "
                        "had one parameter group", table)
            targets = [p for p in module.parameters() if p.requires_grad]
        total = sum(p.numel() for p in targets)
        if total != flat.size or (layout is not None and len(targets) != len(layout)):
            raise ConfigError(f"dense table {table!r} holds {flat.size} values"
                              f"{f' in {len(layout)} parameters' if layout else ''}; the "
                              f"model's parameters take {total} in {len(targets)}")
        offset = 0
        with torch.no_grad():
            for p in targets:
                piece = torch.from_numpy(flat[offset:offset + p.numel()].reshape(p.shape))
                p.copy_(piece)
                offset += p.numel()
        return module


def _layouts(manifest: dict[str, Any], dense: dict[str, np.ndarray]
             ) -> dict[str, list[list[Any]] | None]:
    out: dict[str, list[list[Any]] | None] = {}
    for name, view in manifest["dense"].items():
        params = view.get("params")
        out[name] = None if params is None else check_param_layout(params, dense[name].size,
                                                                    name)
    return out


Read = tuple[dict[str, Any], dict[str, np.ndarray], dict[str, ExportedTable],
             dict[str, list[list[Any]] | None]]


def _read(path: Path) -> Read:
    try:
        manifest = check_export_manifest(json.loads((path / MANIFEST).read_text()))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read the export manifest {path / MANIFEST}: {err}") from None
    for entry in manifest["files"]:
        file = path / str(entry.get("file"))
        if not file.is_file():
            raise CheckpointError(f"export file {file} is missing")
        if digest(file) != (entry.get("bytes"), entry.get("sha256")):
            raise CheckpointError(f"export file {file} fails its size or SHA-256 check")
    try:
        with np.load(path / DENSE_FILE) as data:
            dense = {name: np.array(data[view["key"]], FLOAT32)
                     for name, view in manifest["dense"].items()}
        tables = {}
        for name, view in manifest["embeddings"].items():
            spec = EmbeddingSpec.from_wire(view["spec"])
            with np.load(path / view["file"]) as data:
                ids, weights = np.array(data["ids"], INT64), np.array(data["weights"], FLOAT32)
            if ids.ndim != 1 or weights.shape != (ids.size, spec.dim):
                raise CheckpointError(f"{path / view['file']}: ids {ids.shape} and weights "
                                      f"{weights.shape} do not match dim {spec.dim}")
            tables[name] = ExportedTable(spec, ids, weights)
        layouts = _layouts(manifest, dense)
    except (OSError, KeyError, ValueError, TypeError, ProtocolError) as err:
        raise CheckpointError(f"cannot read export {path}: {err!r}") from None
    return manifest, dense, tables, layouts


def load_exported(path: str | Path, *incremental: str | Path) -> ExportedModel:
    """Read the full export ``path``, then each incremental export in order on top of it."""
    manifest, dense, tables, layouts = _read(Path(path))
    if manifest["kind"] != "full":
        raise CheckpointError(f"{path} is an incremental export; load a full one first")
    model = ExportedModel(dense, tables, [manifest], layouts)
    for extra in incremental:
        manifest, dense, tables, layouts = _read(Path(extra))
        if manifest["kind"] != "incremental":
            raise CheckpointError(f"{extra} is a full export; expected an incremental one")
        if manifest["since"] != model.manifests[-1]["checkpoint"]:
            raise CheckpointError(f"{extra} holds the changes since {manifest['since']}; the "
                                  f"exports before it end at {model.manifests[-1]['checkpoint']}")
        model.dense.update(dense)
        model.layouts.update(layouts)
        for name, table in tables.items():
            if name in model.tables:
                model.tables[name].update(table)
            else:
                model.tables[name] = table
        model.manifests.append(manifest)
    return model
