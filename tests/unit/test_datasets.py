"""Unit tests of hogshard.datasets: idx readers on small gzip files written here, the
Fashion-MNIST loader, and the fallback to scikit-learn's digits.
"""

from __future__ import annotations

import gzip
import importlib.util
import logging
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from hogshard import datasets
from hogshard.datasets import (
    FASHION_MNIST,
    DatasetError,
    ImageDataset,
    load_digits,
    load_fashion_mnist,
    load_image_dataset,
    read_idx_images,
    read_idx_labels,
)

IMAGE_MAGIC, LABEL_MAGIC = 2051, 2049
HAVE_SKLEARN = importlib.util.find_spec("sklearn") is not None
FASHION_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                 "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
HAVE_FASHION = all((FASHION_MNIST / name).is_file() for name in FASHION_FILES)

needs_sklearn = pytest.mark.skipif(not HAVE_SKLEARN, reason="scikit-learn is not installed "
                                   "(pip install scikit-learn) so the digits fallback cannot load")
needs_fashion = pytest.mark.skipif(not HAVE_FASHION, reason=f"Fashion-MNIST idx files are not "
                                   f"at {FASHION_MNIST} (see ../shared/data/README.md)")


def write_gz(path: Path, payload: bytes) -> Path:
    with gzip.open(path, "wb") as f:
        f.write(payload)
    return path


def images_payload(pixels: np.ndarray, magic: int = IMAGE_MAGIC, count: int | None = None) -> bytes:
    n, rows, cols = pixels.shape
    return struct.pack(">iiii", magic, n if count is None else count, rows, cols) + \
        pixels.astype(np.uint8).tobytes()


def labels_payload(labels: np.ndarray, magic: int = LABEL_MAGIC, count: int | None = None) -> bytes:
    return struct.pack(">ii", magic, len(labels) if count is None else count) + \
        labels.astype(np.uint8).tobytes()


def pixels(n: int, rows: int = 3, cols: int = 4, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, rows, cols), dtype=np.uint8)


def write_fashion(directory: Path, n_train: int = 6, n_test: int = 4) -> tuple[np.ndarray, ...]:
    directory.mkdir(parents=True, exist_ok=True)
    train_x, test_x = pixels(n_train, seed=1), pixels(n_test, seed=2)
    train_y = np.arange(n_train, dtype=np.uint8) % 10
    test_y = (np.arange(n_test, dtype=np.uint8) * 3) % 10
    write_gz(directory / FASHION_FILES[0], images_payload(train_x))
    write_gz(directory / FASHION_FILES[1], labels_payload(train_y))
    write_gz(directory / FASHION_FILES[2], images_payload(test_x))
    write_gz(directory / FASHION_FILES[3], labels_payload(test_y))
    return train_x, train_y, test_x, test_y


# ---------------------------------------------------------------------------------------------
# idx readers
# ---------------------------------------------------------------------------------------------


def test_read_images(tmp_path: Path) -> None:
    data = pixels(5)
    got = read_idx_images(write_gz(tmp_path / "img.gz", images_payload(data)))
    assert got.dtype == np.uint8 and got.shape == (5, 3, 4)
    np.testing.assert_array_equal(got, data)


def test_read_labels(tmp_path: Path) -> None:
    labels = np.array([0, 9, 3, 3, 255], dtype=np.uint8)
    got = read_idx_labels(write_gz(tmp_path / "lab.gz", labels_payload(labels)))
    assert got.dtype == np.uint8 and got.shape == (5,)
    np.testing.assert_array_equal(got, labels)


def test_read_empty_files(tmp_path: Path) -> None:
    assert read_idx_images(write_gz(tmp_path / "i.gz", images_payload(pixels(0)))).shape == (0, 3, 4)
    assert read_idx_labels(write_gz(tmp_path / "l.gz", labels_payload(np.zeros(0)))).shape == (0,)


def test_images_bad_magic(tmp_path: Path) -> None:
    path = write_gz(tmp_path / "img.gz", images_payload(pixels(2), magic=1234))
    with pytest.raises(DatasetError, match="magic 1234; expected 2051"):
        read_idx_images(path)


def test_labels_bad_magic(tmp_path: Path) -> None:
    path = write_gz(tmp_path / "lab.gz", labels_payload(np.zeros(2), magic=IMAGE_MAGIC))
    with pytest.raises(DatasetError, match="expected 2049"):
        read_idx_labels(path)


def test_labels_file_read_as_images(tmp_path: Path) -> None:
    path = write_gz(tmp_path / "lab.gz", labels_payload(np.zeros(20)))
    with pytest.raises(DatasetError, match="expected 2051"):
        read_idx_images(path)


@pytest.mark.parametrize("keep", [0, 7, 15])
def test_images_truncated_header(tmp_path: Path, keep: int) -> None:
    path = write_gz(tmp_path / "img.gz", images_payload(pixels(2))[:keep])
    with pytest.raises(DatasetError, match="truncated header"):
        read_idx_images(path)


@pytest.mark.parametrize("keep", [0, 4, 7])
def test_labels_truncated_header(tmp_path: Path, keep: int) -> None:
    path = write_gz(tmp_path / "lab.gz", labels_payload(np.zeros(3))[:keep])
    with pytest.raises(DatasetError, match="truncated header"):
        read_idx_labels(path)


def test_images_truncated_pixels(tmp_path: Path) -> None:
    path = write_gz(tmp_path / "img.gz", images_payload(pixels(3))[:-5])
    with pytest.raises(DatasetError, match="31 pixels; expected 3x3x4"):
        read_idx_images(path)


def test_images_extra_pixels(tmp_path: Path) -> None:
    path = write_gz(tmp_path / "img.gz", images_payload(pixels(3)) + b"\0")
    with pytest.raises(DatasetError, match="pixels"):
        read_idx_images(path)


def test_images_count_larger_than_data(tmp_path: Path) -> None:
    path = write_gz(tmp_path / "img.gz", images_payload(pixels(2), count=3))
    with pytest.raises(DatasetError, match="expected 3x3x4"):
        read_idx_images(path)


def test_labels_truncated(tmp_path: Path) -> None:
    path = write_gz(tmp_path / "lab.gz", labels_payload(np.zeros(10))[:-3])
    with pytest.raises(DatasetError, match="7 labels; expected 10"):
        read_idx_labels(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_idx_images(tmp_path / "absent.gz")


@pytest.mark.parametrize("damage", ["cut_gzip_stream", "not_gzip"])
def test_corrupt_gzip_is_a_dataset_error(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "img.gz"
    payload = images_payload(pixels(50))
    if damage == "cut_gzip_stream":
        blob = gzip.compress(payload)
        path.write_bytes(blob[: len(blob) // 2])
    else:
        path.write_bytes(payload)
    with pytest.raises(DatasetError):
        read_idx_images(path)


# ---------------------------------------------------------------------------------------------
# loaders
# ---------------------------------------------------------------------------------------------


def test_load_fashion_mnist_from_folder(tmp_path: Path) -> None:
    train_x, train_y, test_x, test_y = write_fashion(tmp_path / "fm")
    data = load_fashion_mnist(tmp_path / "fm")
    assert isinstance(data, ImageDataset) and data.name == "fashion-mnist"
    assert data.train_x.shape == (6, 1, 3, 4) and data.test_x.shape == (4, 1, 3, 4)
    assert data.train_x.dtype == np.float32 and data.test_x.dtype == np.float32
    assert data.train_y.dtype == np.int64 and data.test_y.dtype == np.int64
    np.testing.assert_allclose(data.train_x[:, 0], train_x / 255.0, rtol=1e-6)
    np.testing.assert_allclose(data.test_x[:, 0], test_x / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(data.train_y, train_y)
    np.testing.assert_array_equal(data.test_y, test_y)
    assert 0.0 <= data.train_x.min() and data.train_x.max() <= 1.0
    assert data.num_classes == int(max(train_y.max(), test_y.max())) + 1


@pytest.mark.parametrize("missing", FASHION_FILES)
def test_load_fashion_mnist_names_missing_file(tmp_path: Path, missing: str) -> None:
    write_fashion(tmp_path)
    (tmp_path / missing).unlink()
    with pytest.raises(DatasetError, match=missing):
        load_fashion_mnist(tmp_path)


def test_load_image_dataset_prefers_folder(tmp_path: Path) -> None:
    write_fashion(tmp_path)
    assert load_image_dataset(tmp_path).name == "fashion-mnist"


def test_no_fallback_raises(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="missing"):
        load_image_dataset(tmp_path / "absent", allow_fallback=False)


@needs_sklearn
def test_fallback_to_digits_when_folder_missing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="hogshard.datasets"):
        data = load_image_dataset(tmp_path / "absent")
    assert data.name == "sklearn-digits"
    assert "falling back" in caplog.text
    assert data.train_x.shape[1:] == (1, 8, 8) and data.train_x.dtype == np.float32
    assert data.train_y.dtype == np.int64
    assert len(data.train_y) + len(data.test_y) == 1797
    assert 0.0 <= data.train_x.min() and data.train_x.max() <= 1.0
    assert data.num_classes == 10


@needs_sklearn
def test_digits_split_is_seeded() -> None:
    a, b, c = load_digits(seed=0), load_digits(seed=0), load_digits(seed=1)
    np.testing.assert_array_equal(a.train_y, b.train_y)
    assert not np.array_equal(a.train_y, c.train_y)
    assert len(a.test_y) == 1797 - int(1797 * 0.8)


def test_digits_without_sklearn_explains(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # makes the import fail
    with pytest.raises(DatasetError, match="scikit-learn"):
        load_digits()


def test_shared_data_path_points_into_shared() -> None:
    assert FASHION_MNIST == datasets.SHARED_DATA / "fashion-mnist"
    assert datasets.SHARED_DATA.parts[-2:] == ("shared", "data")


@needs_fashion
def test_fashion_mnist_loads_when_present() -> None:
    data = load_image_dataset(None, allow_fallback=False)
    assert data.name == "fashion-mnist"
    assert data.train_x.shape == (60_000, 1, 28, 28)
    assert data.test_x.shape == (10_000, 1, 28, 28)
    assert data.train_y.shape == (60_000,) and data.test_y.shape == (10_000,)
    assert data.num_classes == 10
    assert np.bincount(data.train_y).tolist() == [6000] * 10
    assert 0.0 <= float(data.train_x.min()) and float(data.train_x.max()) <= 1.0
