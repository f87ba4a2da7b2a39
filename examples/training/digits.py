"""scikit-learn's handwritten digits, read straight from the file scikit-learn ships.

sklearn.datasets.load_digits() returns the same arrays, but importing sklearn.datasets
loads much of scikit-learn and SciPy in every rank; this reads the one file it needs.
"""
from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 digits: pixels (1797, 64) as float64 in 0..16, and the labels (1797,) as int."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the digits ship with scikit-learn: pip install scikit-learn")
    path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)
