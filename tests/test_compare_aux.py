"""`jaxamp.compare` on a loss that returns ``(loss, aux)``, as `jax.grad(..., has_aux=True)` takes it.

The loss is differentiated (aux is not); the scopes and the outputs' figure
cover aux's floating leaves too, and the gradients' figures are those of the
same loss without aux.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals

WIDTH = 32


def _params():
    keys = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(keys[0], (WIDTH, WIDTH)) / 6, jax.random.normal(keys[1], (WIDTH, 4)) / 6), (
        jax.random.normal(keys[2], (16, WIDTH))
    )


def _loss(params, x):
    w1, w2 = params
    with jax.named_scope("hidden"):
        h = jnp.tanh(x @ w1)
    with jax.named_scope("head"):
        logits = h @ w2
    return jnp.mean(logits**2)


def _loss_aux(params, x):
    loss = _loss(params, x)
    return loss, {"loss": loss, "count": jnp.int32(x.shape[0]), "name": "mse"}


def test_a_loss_with_aux_gets_the_same_gradient_figures_as_without():
    params, x = _params()
    with_aux = jaxamp.compare(_loss_aux, compute_dtype="f16")(params, x)
    plain = jaxamp.compare(_loss, compute_dtype="f16")(params, x)
    assert len(with_aux.gradients) == 3  # both weights and x
    assert [g.path for g in with_aux.gradients] == [g.path for g in plain.gradients]
    for got, want in zip(with_aux.gradients, plain.gradients):
        assert got.sqnr_db == want.sqnr_db and 30 < got.sqnr_db < 90
    assert with_aux.output_db == plain.output_db
    assert {s.scope for s in with_aux.scopes} >= {"hidden", "head"}
    assert "gradient" in str(with_aux)


def test_a_pair_whose_first_element_is_not_a_scalar_has_no_gradients():
    params, x = _params()
    report = jaxamp.compare(lambda p, x: (jnp.tanh(x @ p[0]), jnp.float32(1.0)), compute_dtype="bf16")(params, x)
    assert report.gradients == () and report.scopes
    assert np.isfinite(report.output_db)
