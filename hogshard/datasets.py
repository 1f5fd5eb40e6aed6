"""Real data sets for the examples, tests and benchmarks, read from local files only.

Fashion-MNIST comes from its original idx files (see ../shared/data/README.md); where they are
absent, scikit-learn's bundled digits (8x8 images, 10 classes) stand in, and the caller is told.

Example::

    >>> data = load_image_dataset(Path("/nonexistent"), allow_fallback=True)  # doctest: +SKIP
    >>> data.name, data.train_x.shape[1:]                                      # doctest: +SKIP
    ('sklearn-digits', (1, 8, 8))
"""

from __future__ import annotations

import gzip
import logging
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

#: Where the shared data sets sit relative to a checkout of this repository.
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
FASHION_MNIST = SHARED_DATA / "fashion-mnist"

_IMAGE_MAGIC, _LABEL_MAGIC = 2051, 2049


class DatasetError(Exception):
    """A data set file is missing or not in the expected format."""


@dataclass
class ImageDataset:
    """Images as float32 ``(N, 1, H, W)`` scaled to [0, 1], labels as int64 ``(N,)``."""

    name: str
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray

    @property
    def num_classes(self) -> int:
        return int(max(self.train_y.max(), self.test_y.max())) + 1


def _read_gzip(path: Path, header_bytes: int) -> tuple[bytes, bytes]:
    """The header and the body of a gzip file, or DatasetError for a corrupt one."""
    try:
        with gzip.open(path, "rb") as f:
            return f.read(header_bytes), f.read()
    except (EOFError, gzip.BadGzipFile, OSError) as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise DatasetError(f"{path}: not a readable gzip file ({err})") from None


def read_idx_images(path: Path) -> np.ndarray:
    """uint8 ``(N, rows, cols)`` from a gzip idx3 file."""
    head, body = _read_gzip(path, 16)
    if len(head) != 16:
        raise DatasetError(f"{path}: truncated header; expected 16 bytes")
    magic, n, rows, cols = struct.unpack(">iiii", head)
    if magic != _IMAGE_MAGIC:
        raise DatasetError(f"{path}: magic {magic}; expected {_IMAGE_MAGIC} (idx3 images)")
    data = np.frombuffer(body, dtype=np.uint8)
    if data.size != n * rows * cols:
        raise DatasetError(f"{path}: {data.size} pixels; expected {n}x{rows}x{cols}")
    return data.reshape(n, rows, cols)


def read_idx_labels(path: Path) -> np.ndarray:
    """uint8 ``(N,)`` from a gzip idx1 file."""
    head, body = _read_gzip(path, 8)
    if len(head) != 8:
        raise DatasetError(f"{path}: truncated header; expected 8 bytes")
    magic, n = struct.unpack(">ii", head)
    if magic != _LABEL_MAGIC:
        raise DatasetError(f"{path}: magic {magic}; expected {_LABEL_MAGIC} (idx1 labels)")
    data = np.frombuffer(body, dtype=np.uint8)
    if data.size != n:
        raise DatasetError(f"{path}: {data.size} labels; expected {n}")
    return data


def _images(raw: np.ndarray) -> np.ndarray:
    return (raw.astype(np.float32) / 255.0)[:, None, :, :]


def load_fashion_mnist(directory: Path = FASHION_MNIST) -> ImageDataset:
    """The four idx files of Fashion-MNIST in ``directory``."""
    files = {
        "train_x": "train-images-idx3-ubyte.gz", "train_y": "train-labels-idx1-ubyte.gz",
        "test_x": "t10k-images-idx3-ubyte.gz", "test_y": "t10k-labels-idx1-ubyte.gz",
    }
    missing = [name for name in files.values() if not (directory / name).is_file()]
    if missing:
        raise DatasetError(f"{directory}: missing {missing}; expected the Fashion-MNIST idx files")
    return ImageDataset(
        "fashion-mnist",
        _images(read_idx_images(directory / files["train_x"])),
        read_idx_labels(directory / files["train_y"]).astype(np.int64),
        _images(read_idx_images(directory / files["test_x"])),
        read_idx_labels(directory / files["test_y"]).astype(np.int64),
    )


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> ImageDataset:
    """scikit-learn's bundled 8x8 digits, split into train and test."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        raise DatasetError(
            "neither Fashion-MNIST nor scikit-learn is available; pass --data DIR with the "
            "Fashion-MNIST idx files or `pip install scikit-learn`"
        ) from None
    bunch = sklearn_digits()
    x = (bunch.images.astype(np.float32) / 16.0)[:, None, :, :]
    y = bunch.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    cut = int(len(y) * (1 - test_fraction))
    return ImageDataset("sklearn-digits", x[order[:cut]], y[order[:cut]], x[order[cut:]],
                        y[order[cut:]])


def load_image_dataset(directory: Path | None, allow_fallback: bool = True) -> ImageDataset:
    """Fashion-MNIST from ``directory`` (default: the shared data folder); when it is absent
    and ``allow_fallback``, scikit-learn's digits, with a warning that says so."""
    directory = directory or FASHION_MNIST
    try:
        return load_fashion_mnist(directory)
    except (DatasetError, FileNotFoundError) as err:
        if not allow_fallback:
            raise
        log.warning("%s; falling back to scikit-learn's digits data set", err)
        return load_digits()
