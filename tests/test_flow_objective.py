"""The flow-matching training objective against diffusers' training utilities and scripts: the timestep density
(``compute_density_for_timestep_sampling``) given the same random draws, the training schedule's timesteps and
sigmas at ``int(u * num_train_timesteps)`` (the scripts' ``get_sigmas``), the SD3 loss weightings, and the whole
loss given the same draws; ``diffusion_loss`` dispatching on the scheduler, and the settings' errors.

Float32 results are bounded by the same computation in float64 (NumPy formulas, or diffusers' own code on float64
tensors): ours must be as accurate as diffusers' float32 result is against it. (XLA contracts multiply-adds into FMAs
where the CPU has them and PyTorch does not, so the two float32 results differ by an ulp on some CPUs only.)"""

import math

import diffusers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

from eqxdiff.schedulers import DDPMScheduler, FlowMatchEulerDiscreteScheduler
from eqxdiff.train import (
    Objective,
    TimestepBias,
    diffusion_loss,
    flow_density,
    flow_loss_weights,
    flow_matching_loss,
    flow_schedule_at,
    flow_timesteps,
)

from ._util import assert_close_to_float64, nhwc_to_nchw, torch_float64

FLOW_CONFIGS = [
    {"shift": 3.0},  # SD3
    {"use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15},  # Flux: the training schedule is unshifted
    {"num_train_timesteps": 500, "shift": 1.7},
]


def _flow(config):
    raw = {"_class_name": "FlowMatchEulerDiscreteScheduler", **config}
    return diffusers.FlowMatchEulerDiscreteScheduler.from_config(raw), FlowMatchEulerDiscreteScheduler.from_config(raw)


def _density64(scheme, draws, logit_mean, logit_std, mode_scale):
    """``compute_density_for_timestep_sampling`` in float64, given its standard normal (``logit_normal``) or
    uniform draws."""
    z = np.asarray(draws, np.float64)
    if scheme == "logit_normal":
        return 1 / (1 + np.exp(-(logit_mean + logit_std * z)))
    if scheme == "mode":
        return 1 - z - mode_scale * (np.cos(math.pi * z / 2) ** 2 - 1 + z)
    return z


def _script_sigmas(ref, timesteps):
    """The training scripts' ``get_sigmas``: each timestep's sigma, found by its position in the schedule."""
    step_indices = [(ref.timesteps == t).nonzero().item() for t in timesteps]
    return ref.sigmas[step_indices].flatten()


@pytest.mark.parametrize("scheme,kwargs", [
    ("logit_normal", dict(logit_mean=0.0, logit_std=1.0)),
    ("logit_normal", dict(logit_mean=-0.4, logit_std=1.6)),
    ("mode", dict(mode_scale=1.29)),
    ("mode", dict(mode_scale=0.5)),
    ("none", {}), ("uniform", {}), ("sigma_sqrt", {}), ("cosmap", {}),
])
def test_density_matches_diffusers_given_the_same_draws(scheme, kwargs):
    batch, seed = 64, 3
    full = dict(logit_mean=0.0, logit_std=1.0, mode_scale=1.29) | kwargs
    expected = compute_density_for_timestep_sampling(scheme, batch, **full,
                                                     generator=torch.Generator().manual_seed(seed))
    replay = torch.Generator().manual_seed(seed)
    draws = torch.randn(batch, generator=replay) if scheme == "logit_normal" else torch.rand(batch, generator=replay)
    ours = flow_density(scheme, jnp.asarray(draws.numpy()), **full)
    assert_close_to_float64(ours, expected.numpy(), _density64(scheme, draws.numpy(), **full), what=scheme,
                            elementwise=True)


@pytest.mark.parametrize("config", FLOW_CONFIGS)
def test_schedule_at_u_matches_diffusers_scripts(config):
    ref, sched = _flow(config)
    timesteps, sigmas = sched.training_schedule()
    # the same float32 operations in the same order, each a separate correctly rounded one in NumPy and in PyTorch
    # (no FMA can join them): exactly equal on any CPU, and so are lookups at the same indices
    np.testing.assert_array_equal(timesteps, ref.timesteps.numpy())
    np.testing.assert_array_equal(sigmas, ref.sigmas.numpy())
    n = ref.config.num_train_timesteps
    u = torch.cat([torch.tensor([0.0, 1e-7, 0.5, 1 - 2**-24, 0.999]), torch.rand(59, generator=torch.Generator()
                                                                                  .manual_seed(1))])
    indices = (u * n).long()
    expected_t = ref.timesteps[indices]
    ours_t, ours_s = jax.jit(flow_schedule_at, static_argnums=0)(sched, jnp.asarray(u.numpy()))
    np.testing.assert_array_equal(np.asarray(ours_t), expected_t.numpy())
    np.testing.assert_array_equal(np.asarray(ours_s), _script_sigmas(ref, expected_t).numpy())


@pytest.mark.parametrize("scheme", ["sigma_sqrt", "cosmap", "none", "logit_normal"])
def test_loss_weights_match_diffusers(scheme):
    sigmas = torch.tensor([0.001, 0.1, 0.37, 0.5, 0.9, 1.0])
    expected = compute_loss_weighting_for_sd3(scheme, sigmas)
    assert_close_to_float64(flow_loss_weights(scheme, jnp.asarray(sigmas.numpy())), expected.numpy(),
                            torch_float64(compute_loss_weighting_for_sd3, scheme, sigmas), what=scheme,
                            elementwise=True)


def _velocity_jax(x, t, context):
    return 0.5 * x * jnp.cos(0.01 * t.reshape(-1, 1, 1, 1)) + context


def _velocity_torch(x, t, context):
    return 0.5 * x * torch.cos(0.01 * t.reshape(-1, 1, 1, 1)) + context


@pytest.mark.parametrize("scheme", ["logit_normal", "cosmap"])
def test_flow_matching_loss_matches_diffusers_script(scheme):
    """The loss of diffusers' SD3/Flux training scripts, computed in torch from our draws (u and the noise)."""
    ref, sched = _flow({"shift": 3.0})
    objective = Objective(weighting_scheme=scheme, logit_mean=0.3, logit_std=0.8, mode_scale=1.29)
    x0 = jnp.asarray(np.random.default_rng(0).standard_normal((4, 3, 2, 2)), jnp.float32)
    context = jnp.asarray(0.25, jnp.float32)
    key = jax.random.key(7)
    loss = jax.jit(flow_matching_loss, static_argnums=(0, 1, 2))(_velocity_jax, sched, objective, x0, context, key)

    k_t, k_noise = jax.random.split(key)
    draws = (jax.random.normal if scheme == "logit_normal" else jax.random.uniform)(k_t, (4,), jnp.float32)
    u = torch.from_numpy(np.array(flow_density(scheme, draws, logit_mean=0.3, logit_std=0.8, mode_scale=1.29)))
    noise = nhwc_to_nchw(jax.random.normal(k_noise, x0.shape, jnp.float32))
    model_input = nhwc_to_nchw(x0)
    indices = (u * ref.config.num_train_timesteps).long()
    timesteps = ref.timesteps[indices]
    sigmas = _script_sigmas(ref, timesteps).reshape(-1, 1, 1, 1)

    def script_loss(model_input, noise, sigmas, timesteps):
        noisy = (1.0 - sigmas) * model_input + sigmas * noise
        pred = _velocity_torch(noisy, timesteps, 0.25)
        weighting = compute_loss_weighting_for_sd3(scheme, sigmas)
        target = noise - model_input
        return torch.mean((weighting.float() * (pred.float() - target.float()) ** 2).reshape(4, -1), 1).mean()

    script_args = (model_input, noise, sigmas, timesteps)  # the schedule's sigmas and timesteps: data of the script
    expected = script_loss(*script_args)
    expected64 = torch_float64(script_loss, *script_args)  # its .float() keep float64 there
    assert_close_to_float64(loss, expected.numpy(), expected64, what="flow-matching loss")
    if scheme == "logit_normal":  # diffusion_loss dispatches to it on a flow-matching scheduler, and it has a gradient
        loss_fn = lambda x: diffusion_loss(_velocity_jax, sched, objective, x, context, key)  # noqa: E731
        same, grads = jax.value_and_grad(loss_fn)(x0)
        assert_close_to_float64(same, loss, expected64, what="diffusion_loss against flow_matching_loss")
        assert bool(jnp.all(jnp.isfinite(grads))) and float(jnp.abs(grads).max()) > 0


def test_flow_timesteps_follow_the_density():
    """logit_normal(0, 1) puts the unshifted schedule's sigmas around 0.5 with a std of about 0.21 (a uniform one
    would have 1/sqrt(12) = 0.29), the timesteps at sigma * num_train_timesteps."""
    _, sched = _flow({})
    timesteps, sigmas = jax.jit(flow_timesteps, static_argnums=(1, 2, 3))(
        jax.random.key(0), 4096, sched, Objective(weighting_scheme="logit_normal"))
    assert abs(float(jnp.median(sigmas)) - 0.5) < 0.03 and abs(float(jnp.std(sigmas)) - 0.21) < 0.02
    assert float(jnp.std(sigmas)) < 1 / math.sqrt(12) - 0.05
    sigmas = np.asarray(sigmas)
    assert_close_to_float64(timesteps, 1000 * sigmas, 1000 * sigmas.astype(np.float64), what="timesteps",
                            elementwise=True)


def test_objective_errors():
    _, sched = _flow({})
    ddpm = DDPMScheduler()
    x0, key = jnp.zeros((2, 2, 2, 1)), jax.random.key(0)
    with pytest.raises(ValueError, match="weighting_scheme='sd3'"):
        Objective(weighting_scheme="sd3")
    with pytest.raises(ValueError, match="logit_std=0"):
        Objective(logit_std=0)
    with pytest.raises(ValueError, match="snr_gamma and timestep_bias"):
        diffusion_loss(_velocity_jax, sched, Objective(snr_gamma=5.0), x0, 0.0, key)
    with pytest.raises(ValueError, match="snr_gamma and timestep_bias"):
        diffusion_loss(_velocity_jax, sched, Objective(timestep_bias=TimestepBias("later", 2.0)), x0, 0.0, key)
    with pytest.raises(ValueError, match="prediction_type='epsilon'"):
        diffusion_loss(_velocity_jax, sched, Objective(prediction_type="epsilon"), x0, 0.0, key)
    with pytest.raises(ValueError, match="DDPMScheduler trains on the DDPM process"):
        diffusion_loss(_velocity_jax, ddpm, Objective(weighting_scheme="logit_normal"), x0, 0.0, key)
