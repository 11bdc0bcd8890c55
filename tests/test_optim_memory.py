"""Bytes per parameter of parameters + AdamW state (benchmarks/optimizer_memory.py).

The script measures GPT-2 small; the same code on a small GPT must give the same
ratios: 12 bytes per parameter in float32, 6 with bf16 parameters and state, 8
with a Kahan buffer on top. Scalars (step counts, PRNG keys) add a few bytes in
all, hence the tolerance.
"""

import pytest

from benchmarks.models import GPTConfig
from benchmarks.optimizer_memory import measure

SMALL = GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_heads=4, n_layers=2)


def test_bytes_per_parameter_of_each_precision():
    results = measure(SMALL)
    assert results["float32"]["n_parameters"] > 100_000
    expected = {
        "float32": (4, 8, 12),
        "bf16 stochastic": (2, 4, 6),
        "bf16 kahan": (2, 6, 8),
        "bf16 nearest": (2, 4, 6),
    }
    assert set(results) == set(expected)
    for name, (params, state, total) in expected.items():
        r = results[name]
        assert r["parameters"] == params, name
        assert r["state"] == pytest.approx(state, abs=1e-3), name
        assert r["total"] == pytest.approx(total, abs=1e-3), name
    assert results["bf16 stochastic"]["total"] / results["float32"]["total"] == pytest.approx(0.5, abs=1e-4)
