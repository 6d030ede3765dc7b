"""The fast grouped sorts of scan/detect/stats.py give what the plain numpy sorts give (the verdicts depend on it)."""
from __future__ import annotations

import numpy as np

from megatronapp.scan.detect import stats


def _reference_median(keys, vals):
    o = np.argsort(vals)
    o = o[np.argsort(keys[o], kind="stable")]
    k, v = keys[o], vals[o].astype(float)
    uk, start, cnt = np.unique(k, return_index=True, return_counts=True)
    return uk, (v[start + (cnt - 1) // 2] + v[start + cnt // 2]) / 2, cnt


def test_grouped_sorts_equal_numpy_on_every_path():
    rng = np.random.default_rng(3)
    # key ranges: narrow (packed as they are), wide (dense ids), huge (no packing); values: small integers (one
    # composite sort), integer floats, wide integer floats (ns since the epoch), fractions, NaN
    for t in range(240):
        n = int(rng.integers(1, 2000))
        keys = rng.integers(-5, [10, 10**6, 2**40, 2**62][t % 4], n)
        if t % 5 == 0 and np.abs(keys).max() < 2**31:
            keys = keys.astype(np.int32)
        vals = rng.integers(-10**6, 10 ** int(rng.integers(1, 16)), n)
        kind = t % 7
        if kind in (1, 2):
            vals = vals.astype(float) * (1e3 if kind == 2 else 1)
        elif kind == 3:
            vals = rng.random(n) * 1e3
            vals[: n // 3] = vals[n // 3: 2 * (n // 3)]  # ties
        elif kind == 4:
            vals = vals + 0.5
        elif kind == 5:
            vals = vals.astype(float)
            vals[::9] = np.nan
        elif kind == 6:  # ns on clocks days apart: wide overall, narrow within a key (a base per key)
            day = rng.integers(0, 4 * 10**14, int(keys.max()) - int(keys.min()) + 1 if t % 4 < 2 else 7)
            vals = (day[(keys - keys.min()) % len(day)] + rng.integers(0, 10**6, n)).astype(float)
        for got, want in zip(stats.group_median(keys, vals), _reference_median(keys, vals)):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
        o = stats.by_key_then_value(keys, vals)
        ref = np.lexsort((vals, keys))
        np.testing.assert_array_equal(keys[o], keys[ref])
        np.testing.assert_array_equal(vals[o], vals[ref])
        np.testing.assert_array_equal(stats._stable_order(keys), np.argsort(keys, kind="stable"))
