"""How a pipeline's VAE decode runs and how its output reaches the host: in the activations' dtype (diffusers decodes
in the VAE's dtype; float16 VAEs with ``force_upcast`` in float32, as diffusers' rule), and converted to uint8 on the
device with the same rounding as the host conversion."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxdiff
from eqxdiff.pipelines import NonFiniteError
from eqxdiff.pipelines._images import to_uint8, uint8_on_device


@pytest.mark.parametrize("dtype, decodes_in", [("bfloat16", jnp.bfloat16), ("float32", jnp.float32),
                                               ("float16", jnp.float32)])
def test_vae_decodes_in_the_activations_dtype(dtype, decodes_in):
    pipe = eqxdiff.load_pipeline("digits", dtype=dtype)
    assert pipe.vae_dtype == jnp.dtype(decodes_in)  # digits' VAE config says force_upcast, as SD's do
    latents = jax.ShapeDtypeStruct((1, 4, 4, pipe.vae.config.latent_channels), jnp.dtype(dtype))
    out = jax.eval_shape(pipe.decode, latents)  # the VAE's output dtype is the dtype it ran in
    assert out.dtype == jnp.dtype(decodes_in)


def test_uint8_on_device_rounds_as_the_host():
    rng = np.random.default_rng(0)
    x = rng.uniform(-1.2, 1.2, (3, 7, 5, 3)).astype(np.float32)
    x[0, 0, 0] = [-1.0, 1.0, 0.0]
    x[0, 0, 1] = np.float32(2 * (0.5 / 255) - 1)  # exactly half a level above 0: rounds to even
    x[0, 0, 2] = np.float32(2 * (254.5 / 255) - 1)
    finite, pixels = uint8_on_device(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(pixels), to_uint8(x))
    assert np.asarray(finite).tolist() == [True, True, True]
    bf16 = jnp.asarray(x, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(uint8_on_device(bf16)[1]), to_uint8(np.asarray(bf16, np.float32)))


def test_finish_names_the_non_finite_outputs(monkeypatch):
    pipe = eqxdiff.load_pipeline("digits")
    bad = jnp.zeros((2, 8, 8, 3)).at[1, 0, 0, 0].set(jnp.nan)
    monkeypatch.setattr(type(pipe), "decode", lambda self, latents: bad)
    with pytest.raises(NonFiniteError, match="1 of 2 images"):
        pipe.finish(jnp.zeros((2, 1, 1, 4)), "uint8")
