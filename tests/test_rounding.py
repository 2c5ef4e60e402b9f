"""The float32-vs-float32 check of ``tests/_util.py`` (``assert_close_to_float64``) and its float64 runs: a
summation in another order passes, an injected error of 1e-4 or 1e-5 (or of 16 float32 ulps) fails, a float64
program differing by 1e-12 fails, and the float64 runs really are float64: ``float64_jax`` through eqxdiff's float32
casts (jitted, and on a mesh of the 8 simulated devices), ``torch_float64`` through diffusers' upcasts,
``diffusers_float64`` for a scheduler with the same noise."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from eqxdiff import nn
from eqxdiff.parallel import MeshConfig, make_mesh, shard_batch, shard_params

from ._util import (
    FLOAT32_EPS,
    SLACK,
    assert_close_to_float64,
    assert_leaves_close_to_float64,
    diffusers_float64,
    float64_jax,
    run_float64,
    to_float64,
    torch_float64,
)

# diffusers' schedulers trip NumPy 2's __array__(copy=) deprecation; nothing of ours.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")


def _sums():
    """16 sums of 65536 terms (10 + N(0, 1)) done four ways: float64, and float32 in blocks of 8, in blocks of 16
    (two orders of one accuracy) and left to right (its running total is large: it rounds ~30x more). NumPy's
    float32 additions are IEEE's, the same on every CPU."""
    x = (10 + np.random.default_rng(0).standard_normal((16, 65536))).astype(np.float32)
    reference64 = x.astype(np.float64).sum(axis=1)
    blocks8 = x.reshape(16, -1, 8).sum(axis=2, dtype=np.float32).sum(axis=1, dtype=np.float32)
    blocks16 = x.reshape(16, -1, 16).sum(axis=2, dtype=np.float32).sum(axis=1, dtype=np.float32)
    sequential = np.zeros(16, np.float32)
    for column in x.T:
        sequential += column
    return blocks8, blocks16, sequential, reference64


def test_another_summation_order_passes_and_the_message_names_all_three_numbers():
    blocks8, blocks16, sequential, reference64 = _sums()
    assert not np.array_equal(blocks8, blocks16)  # the two float32 results do differ
    assert_close_to_float64(blocks16, blocks8, reference64, what="sum")
    assert_close_to_float64(blocks8, blocks16, reference64, what="sum, the other way")
    # the check is "as accurate as the reference": a more accurate order passes, a far less accurate one does not
    assert_close_to_float64(blocks8, sequential, reference64, what="blocked against sequential")
    with pytest.raises(AssertionError, match=r"sequential against blocked: 2\.\d+e-06 from the float64 value, more "
                                             r"than 16 x the float32 reference's own \d\.\d+e-08 \(bound 1\.907e-06\); "
                                             r"the two float32 results differ by 2\.\d+e-06 \(all relative to "
                                             r"6\.\d+e\+05\)"):
        assert_close_to_float64(sequential, blocks8, reference64, what="sequential against blocked")


@pytest.mark.parametrize("relative", [1e-4, 1e-5])
def test_an_injected_error_fails(relative):
    """A perturbation of 1e-4 (and 1e-5) of the largest entry on one element: far more than the rounding either
    float32 sum shows here, so the check fails, and says by how much."""
    actual, expected, _, reference64 = _sums()
    rounding = np.max(np.abs(expected - reference64)) / np.max(np.abs(reference64))
    assert SLACK * rounding < relative  # the sums round by ~1e-6: a 1e-5 error is already a bug here
    wrong = actual.copy()
    wrong[7] += relative * np.max(np.abs(reference64))
    with pytest.raises(AssertionError, match=r"sum: .* from the float64 value, more than 16 x the float32 reference's "
                                             r"own .* the two float32 results differ by"):
        assert_close_to_float64(wrong, expected, reference64, what="sum")


def test_exactly_rounded_results_get_a_few_ulps():
    """Elementwise arithmetic rounds once per operation: when the reference is correctly rounded its own error is
    below an ulp, and the bound is SLACK float32 ulps of the largest entry, not zero."""
    x = np.random.default_rng(1).standard_normal(1000)
    reference64 = x * 3.1 + 0.5
    expected = (x * 3.1 + 0.5).astype(np.float32)
    fma = (x.astype(np.float32).astype(np.float64) * np.float32(3.1) + np.float32(0.5)).astype(np.float32)
    assert_close_to_float64(fma, expected, reference64, what="fused multiply-add")
    scale = np.max(np.abs(reference64))
    off = expected + np.float32(2 * SLACK * FLOAT32_EPS * scale)
    with pytest.raises(AssertionError, match="fused multiply-add"):
        assert_close_to_float64(off, expected, reference64, what="fused multiply-add")


def test_zero_in_exact_arithmetic_is_measured_on_the_given_scale():
    noise = np.float32(1e-9) * np.random.default_rng(2).standard_normal(8).astype(np.float32)
    assert_close_to_float64(noise[::-1].copy(), noise, np.zeros(8), what="zero gradient", scale=1.0)
    with pytest.raises(AssertionError, match="zero gradient"):
        assert_close_to_float64(noise + 1e-5, noise, np.zeros(8), what="zero gradient", scale=1.0)


def test_elementwise_errors_are_relative_to_each_value():
    """``elementwise`` measures each element against its own float64 value, as ``rtol`` does: an error of 1e-4 of a
    small element fails there, and is invisible next to the largest."""
    values = np.array([1.0, 1e-6, 3.0])
    expected = values.astype(np.float32)
    actual = expected * np.float32([1, 1 + 1e-4, 1])
    assert_close_to_float64(actual, expected, values, what="norm-wise")
    with pytest.raises(AssertionError, match=r"small element: .*relative to the float64 value 1\.000000e-06 at \(1,\), "
                                             r"the worst element"):
        assert_close_to_float64(actual, expected, values, what="small element", elementwise=True)


def test_a_second_float64_program_must_agree_to_float64_rounding():
    """``actual64``: the actual side's program in float64 may differ from the reference's float64 run by float64
    rounding only: a change of 1e-12 (far below float32's resolution) is a different function and fails."""
    x = np.random.default_rng(5).standard_normal(100)
    exact = np.tanh(x)
    rounded = exact.astype(np.float32)
    assert_close_to_float64(rounded, rounded, exact, what="tanh", actual64=np.tanh(x.copy()))
    with pytest.raises(AssertionError, match=r"tanh: the two programs differ in float64 by 4\.\d+e-13, more than "
                                             r"float64 rounding"):
        assert_close_to_float64(rounded, rounded, exact, what="tanh", actual64=np.tanh(x * (1 + 1e-12)))


def test_diffusers_float64_steps_a_scheduler_in_float64_with_the_same_noise():
    """A scheduler built and stepped under ``diffusers_float64`` keeps float64 tables and samples, and its ancestral
    noise is the float32 run's noise from the same generator (else the two runs would differ by O(1))."""
    import diffusers

    raw = {"_class_name": "EulerAncestralDiscreteScheduler", "beta_schedule": "scaled_linear"}
    ref = diffusers.EulerAncestralDiscreteScheduler.from_config(raw)
    ref.set_timesteps(5)
    with diffusers_float64():
        ref64 = diffusers.EulerAncestralDiscreteScheduler.from_config(raw)
        ref64.set_timesteps(5)
    assert ref.sigmas.dtype == torch.float32 and ref64.sigmas.dtype == ref64.alphas_cumprod.dtype == torch.float64
    x, out = torch.randn(1, 2, 3, 3), torch.randn(1, 2, 3, 3)
    t = ref.timesteps[1]
    ref._step_index = ref64._step_index = 1
    step = ref.step(out, t, x, generator=torch.Generator().manual_seed(0)).prev_sample
    with diffusers_float64():
        step64 = ref64.step(out.double(), t.double(), x.double(), generator=torch.Generator().manual_seed(0))
    assert step64.prev_sample.dtype == torch.float64
    error = float((step64.prev_sample - step).abs().max() / step64.prev_sample.abs().max())
    assert 0 < error < 1e-5


def test_torch_float64_keeps_diffusers_upcasts_in_float64():
    """diffusers' RMSNorm takes its variance after ``.to(torch.float32)``: in ``torch_float64`` that stays float64,
    so the result is NumPy's float64 formula to float64 rounding (not float32's)."""
    from diffusers.models.normalization import RMSNorm

    x = torch.randn(3, 16, dtype=torch.float32) * 3
    got = torch_float64(RMSNorm(16, eps=1e-6, elementwise_affine=False), x)
    x64 = x.double().numpy()
    exact = x64 / np.sqrt(np.mean(x64**2, axis=-1, keepdims=True) + 1e-6)
    assert got.dtype == np.float64 and np.max(np.abs(got - exact)) < 1e-14
    assert torch.ones(1).float().dtype == torch.float32 and torch.ones(1).double().float().dtype == torch.float32


def test_leaves_share_their_programs_rounding_and_zero_leaves_its_largest_scale():
    """Gradient leaves: a small leaf may be off by the rounding its tree shows elsewhere (its own can be luckily
    small), an error of 1e-4 still fails, and a leaf that is zero in exact arithmetic is noise on the largest scale."""
    rng = np.random.default_rng(6)
    exact = {"w": rng.standard_normal((16, 16)), "b": rng.standard_normal(4), "key_bias": np.full(4, 1e-18)}
    noisy = {k: v * (1 + 1e-6 * rng.standard_normal(v.shape)) for k, v in exact.items()}  # rounds by ~1e-6 ...
    expected = {k: (noisy if k == "w" else exact)[k].astype(np.float32) for k in exact}  # ... except b, luckily
    expected["key_bias"] = np.float32(1e-9) * rng.standard_normal(4).astype(np.float32)
    actual = {k: v.copy() for k, v in expected.items()}
    actual["b"] = (exact["b"] * (1 + 2e-6)).astype(np.float32)  # 2e-6: 16 ulps, more than 16 x b's own 3e-8
    actual["key_bias"] = -expected["key_bias"]
    assert_leaves_close_to_float64(actual, expected, exact, what="gradient")
    with pytest.raises(AssertionError, match="b alone"):  # measured alone, b's luckily small rounding is too tight
        assert_close_to_float64(actual["b"], expected["b"], exact["b"], what="b alone")
    actual["b"] = (exact["b"] * (1 + 1e-4)).astype(np.float32)
    with pytest.raises(AssertionError, match=r"gradient \['b'\] \(4,\): 1\.0\d*e-04 from the float64 value"):
        assert_leaves_close_to_float64(actual, expected, exact, what="gradient")


def test_shapes_and_non_finite_values_are_refused():
    with pytest.raises(AssertionError, match="shapes differ"):
        assert_close_to_float64(np.zeros(3), np.zeros(3), np.zeros(4))
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close_to_float64(np.array([np.nan, 1.0]), np.ones(2), np.ones(2))


def test_float64_jax_computes_in_float64_through_float32_casts():
    """GroupNorm takes its statistics with ``x.astype(jnp.float32)``: under ``float64_jax`` that cast keeps float64,
    jitted (``eqx.filter_jit``) or not, the result equals NumPy's float64 formula to float64 rounding, and the
    float32 program compiled before is not reused."""
    weight, bias = np.linspace(0.5, 1.5, 8, dtype=np.float32), np.linspace(-0.3, 0.3, 8, dtype=np.float32)
    norm = eqx.tree_at(lambda m: (m.weight, m.bias), nn.GroupNorm(2, 8, eps=1e-6), (jnp.asarray(weight),
                                                                                    jnp.asarray(bias)))
    x = np.random.default_rng(3).standard_normal((2, 5, 5, 8)) * 3 + 1
    g = x.reshape(2, 25, 2, 4)
    mean, var = g.mean(axis=(1, 3), keepdims=True), g.var(axis=(1, 3), keepdims=True)
    exact = ((g - mean) / np.sqrt(var + 1e-6)).reshape(x.shape) * weight.astype(np.float64) + bias.astype(np.float64)
    jitted = eqx.filter_jit(lambda m, x: m(x))
    f32 = np.asarray(jitted(norm, jnp.asarray(x, jnp.float32)))
    for fn in (jitted, lambda m, x: m(x)):
        got = run_float64(fn, norm, x)
        assert got.dtype == np.float64
        assert np.max(np.abs(got - exact)) < 1e-13
    assert 1e-8 < np.max(np.abs(f32 - exact)) < 1e-5  # the float32 run was float32, and stays compiled as such
    assert np.asarray(jitted(norm, jnp.asarray(x, jnp.float32))).dtype == np.float32
    assert jnp.float32 is not jnp.float64 and nn._layers.jnp is jnp  # restored


def test_float64_jax_on_a_mesh():
    """A float64 program sharded over the 8 simulated devices: parameters and batch placed by the rules, the result
    float64 and equal to one device's float64 run to float64 rounding."""
    mesh = make_mesh(MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=-1))
    linear = nn.Linear(16, 32, key=jax.random.key(0))
    x = np.random.default_rng(4).standard_normal((8, 16))
    single = run_float64(lambda m, x: jax.jit(lambda m, x: jnp.tanh(m(x)))(m, x), linear, x)
    with float64_jax():
        model, inputs = to_float64((linear, x))
        sharded_model, sharded_x = shard_params(model, mesh), shard_batch(inputs, mesh)
        assert sharded_model.weight.dtype == jnp.float64 and len(sharded_x.sharding.device_set) == 8
        out = eqx.filter_jit(lambda m, x: jnp.tanh(m(x)))(sharded_model, sharded_x)
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(out), single, rtol=0, atol=1e-14)


def test_float64_jax_draws_the_float32_numbers():
    """A program that draws (a training loss: noise, dropout, timesteps) draws the same numbers in its float64 run."""
    def draws(key, x):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        return (x + jax.random.normal(k1, x.shape, x.dtype), jax.random.uniform(k2, (5,), jnp.float32),
                jax.random.bernoulli(k3, 0.3, (7,)), jax.random.randint(k4, (3,), 0, 1000, dtype=jnp.int32))

    key, x = jax.random.key(0), np.zeros(4, np.float32)
    float32, float64 = jax.jit(draws)(key, x), run_float64(draws, key, x)
    assert float64[0].dtype == np.float64 and jax.random.normal is not None
    for a, b in zip(float32, float64):
        np.testing.assert_array_equal(np.asarray(a).astype(b.dtype), b)
    assert np.asarray(jax.random.normal(key, (2,))).dtype == np.float32  # restored


def test_torch_float64_runs_a_copy():
    layer = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    out = torch_float64(layer, x)
    assert out.dtype == np.float64 and layer.weight.dtype == torch.float32
    with torch.no_grad():
        np.testing.assert_allclose(out, x.double() @ layer.weight.double().T + layer.bias.double(), rtol=1e-15)
