"""Scheduler parity with the diffusers PyTorch schedulers (whole trajectories, 1e-4), training helpers,
img2img starts, swapping by name, config errors, and convergence on a Gaussian target.

Schedules, noised starts and training targets are float32 against float32, bounded by a float64 run of diffusers'
scheduler (``diffusers_float64``: its float32 tables and arithmetic in float64): ours must be as accurate as
diffusers' float32 result is against it. (XLA contracts ``a * x + b * noise`` into FMAs where the CPU has them, NumPy
and PyTorch do not: the two float32 results differ by an ulp or two on one CPU and not on another.)"""

import inspect

import diffusers
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from eqxdiff import schedulers as S
from eqxdiff.schedulers import ConfigError, scheduler_from_config

from ._util import assert_close, assert_close_to_float64, diffusers_float64, nhwc_to_nchw

# diffusers' schedulers trip NumPy 2's __array__(copy=) deprecation; nothing of ours.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

SHAPE = (2, 6, 5, 4)  # channels-last (batch, height, width, channels)
SD = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}
STOCHASTIC = {"EulerAncestralDiscreteScheduler", "DDPMScheduler"}


def _raw(class_name, **config):
    return {"_class_name": class_name, "_diffusers_version": "0.42.1", **config}


def _nhwc(t):
    return np.moveaxis(t.detach().numpy(), 1, -1)


# ---------------------------------------------------------------------------------------------------------------
# The fake model: a deterministic function of (model input, timestep); learned-variance DDPM gets extra channels.


def _fake_jax(x, t, learned: bool):
    out = 0.3 * x + 0.1 * jnp.sin(t.astype(jnp.float32))
    return jnp.concatenate([out, 0.5 * jnp.tanh(x)], axis=-1) if learned else out


def _fake_torch(x, t, learned: bool):
    out = 0.3 * x + 0.1 * torch.sin(torch.as_tensor(t).float())
    return torch.cat([out, 0.5 * torch.tanh(x)], dim=1) if learned else out


def _learned(raw):
    return raw.get("variance_type") in ("learned", "learned_range")


def _trajectory(sched, state, x, noises, learned):
    """Every intermediate sample of a jitted ``lax.scan`` over ``sched.step``, run as the pipelines' loop runs it:
    on the state padded to the fixed schedule length and with the scheduler's ``stepper()`` (so every parity case
    below also proves that padding and the stepper change nothing)."""
    length = int(sched.remaining_steps(state))
    xs, final = _scan(sched.stepper(), S.pad_schedule(state), x, noises, learned, length)
    return xs, final


@eqx.filter_jit
def _scan(sched, state, x, noises, learned, length):
    def body(carry, noise):
        x, state = carry
        out = _fake_jax(sched.scale_model_input(state, x), sched.current_timestep(state), learned)
        x, state = sched.step(state, out, x, noise=noise)
        return (x, state), x

    (_, state), xs = jax.lax.scan(body, (x, state), noises, length=length)
    return xs, state


def _reference(ref, raw, n, x, *, begin=0, noise_seed=0, ddim_eta=0.0):
    """diffusers' trajectory from ``x`` (NCHW torch) and the noise it drew, both as NHWC arrays."""
    learned = _learned(raw)
    timesteps = ref.timesteps[begin:]
    if begin and hasattr(ref, "set_begin_index"):
        ref.set_begin_index(begin)
    generator = torch.Generator().manual_seed(noise_seed)
    replay = torch.Generator().manual_seed(noise_seed)
    samples, noises = [], []
    for t in timesteps:
        out = _fake_torch(ref.scale_model_input(x, t), t, learned)
        kwargs = {}
        if raw["_class_name"] in STOCHASTIC:
            kwargs["generator"] = generator
            draws = raw["_class_name"] == "EulerAncestralDiscreteScheduler" or t > 0
            noises.append(torch.randn(x.shape, generator=replay) if draws else torch.zeros_like(x))
        elif ddim_eta:
            noise = torch.randn(x.shape, generator=generator)
            kwargs.update(eta=ddim_eta, variance_noise=noise)
            noises.append(noise)
        x = ref.step(out, t, x, **kwargs).prev_sample
        samples.append(_nhwc(x))
    noises = jnp.asarray(np.stack([_nhwc(z) for z in noises])) if noises else None
    return np.stack(samples), noises


def _pair(raw, n, shape=SHAPE, **init):
    ref = getattr(diffusers, raw["_class_name"]).from_config(raw)
    ref.set_timesteps(n)
    sched = scheduler_from_config(raw)
    return ref, sched, sched.init(n, sample_shape=shape, **init)


def _float64(raw, n=None):
    """diffusers' scheduler of ``raw`` built (and ``set_timesteps(n)``) in float64: step and call it inside
    ``diffusers_float64()`` too."""
    with diffusers_float64():
        ref = getattr(diffusers, raw["_class_name"]).from_config(raw)
        if n is not None:
            ref.set_timesteps(n)
    return ref


def _check_schedule(ref, sched, state, ref64):
    """Integer timesteps exactly (diffusers' are integers: so are ours); float ones, the sigmas and the initial
    noise scale as accurate as diffusers' float32 ones, against its float64 run."""
    if np.issubdtype(ref.timesteps.numpy().dtype, np.integer):
        np.testing.assert_array_equal(np.asarray(state.timesteps), ref.timesteps.numpy())
    else:
        assert_close_to_float64(state.timesteps, ref.timesteps.numpy(), ref64.timesteps.numpy(), what="timesteps",
                                elementwise=True)
    if hasattr(state, "sigmas"):
        assert_close_to_float64(state.sigmas, ref.sigmas.numpy(), ref64.sigmas.numpy(), what="sigmas",
                                elementwise=True)
    assert_close_to_float64(sched.init_noise_sigma(state), np.float32(ref.init_noise_sigma),
                            np.float64(ref64.init_noise_sigma), what="init_noise_sigma")


def _check_trajectory(ours, expected):
    assert ours.shape == expected.shape
    for i, (a, e) in enumerate(zip(ours, expected, strict=True)):
        assert_close(a, e, 1e-4, f"sample after step {i}")


CASES = [
    # DDIM
    ("DDIMScheduler", dict(SD, clip_sample=False, set_alpha_to_one=False, steps_offset=1), 25),
    ("DDIMScheduler", dict(prediction_type="v_prediction", timestep_spacing="trailing"), 10),
    ("DDIMScheduler", dict(SD, rescale_betas_zero_snr=True, prediction_type="v_prediction",
                           timestep_spacing="trailing", clip_sample=False), 25),
    ("DDIMScheduler", dict(beta_schedule="squaredcos_cap_v2", prediction_type="sample",
                           timestep_spacing="linspace"), 1),
    ("DDIMScheduler", dict(thresholding=True, sample_max_value=1.5, timestep_spacing="linspace"), 10),
    # PNDM
    ("PNDMScheduler", dict(SD, skip_prk_steps=True, steps_offset=1), 25),
    ("PNDMScheduler", dict(SD, skip_prk_steps=True, prediction_type="v_prediction", timestep_spacing="trailing",
                           set_alpha_to_one=True), 10),
    ("PNDMScheduler", dict(skip_prk_steps=True, timestep_spacing="linspace"), 1),
    ("PNDMScheduler", dict(skip_prk_steps=False), 10),
    # (squaredcos + v_prediction is left out: alphas_cumprod[999] ~ 2e-9 makes PNDM's first update cancel
    # catastrophically, and diffusers' own float32 result is 1e-4 away from its float64 one.)
    ("PNDMScheduler", dict(SD, skip_prk_steps=False, prediction_type="v_prediction", timestep_spacing="linspace"), 25),
    ("PNDMScheduler", dict(skip_prk_steps=False, beta_schedule="squaredcos_cap_v2", timestep_spacing="trailing"), 25),
    # Euler
    # log_linear: n + 1 levels evenly spaced in log sigma, and diffusers' one more after them (refused before)
    ("EulerDiscreteScheduler", dict(SD, timestep_spacing="leading", steps_offset=1, interpolation_type="log_linear"),
     25),
    ("EulerDiscreteScheduler", dict(SD, interpolation_type="log_linear", use_beta_sigmas=True, sigma_max=10.0), 7),
    ("EulerDiscreteScheduler", dict(SD, prediction_type="v_prediction", use_karras_sigmas=True), 10),
    ("EulerDiscreteScheduler", dict(SD, rescale_betas_zero_snr=True, prediction_type="v_prediction",
                                    timestep_spacing="trailing"), 25),
    ("EulerDiscreteScheduler", dict(prediction_type="sample", use_exponential_sigmas=True), 1),
    ("EulerDiscreteScheduler", dict(SD, prediction_type="v_prediction", timestep_type="continuous",
                                    final_sigmas_type="sigma_min", sigma_min=0.05, use_karras_sigmas=True), 10),
    # Euler ancestral
    ("EulerAncestralDiscreteScheduler", dict(SD, timestep_spacing="leading", steps_offset=1), 25),
    ("EulerAncestralDiscreteScheduler", dict(SD, prediction_type="v_prediction"), 10),
    ("EulerAncestralDiscreteScheduler", dict(rescale_betas_zero_snr=True, prediction_type="v_prediction",
                                             timestep_spacing="trailing"), 25),
    ("EulerAncestralDiscreteScheduler", dict(SD, prediction_type="v_prediction", timestep_spacing="trailing"), 1),
    # sigma_to << sigma_from: sigma_to**2 - sigma_up**2 cancels to a float32 ulp or two, negative in XLA's rounding
    ("EulerAncestralDiscreteScheduler", dict(prediction_type="v_prediction", timestep_spacing="linspace"), 2),
    ("EulerAncestralDiscreteScheduler", dict(beta_schedule="squaredcos_cap_v2"), 2),
    # LMS
    ("LMSDiscreteScheduler", dict(SD, timestep_spacing="leading", steps_offset=1), 25),
    ("LMSDiscreteScheduler", dict(SD, prediction_type="v_prediction", use_karras_sigmas=True), 10),
    ("LMSDiscreteScheduler", dict(SD, use_beta_sigmas=True), 10),  # (beta sigmas were refused here, and below)
    ("LMSDiscreteScheduler", dict(prediction_type="sample", timestep_spacing="trailing"), 1),
    # 'trailing' overshoots to timestep -1 at 61 steps: 62 timesteps (diffusers' too), LMS had 61 steps' coefficients
    # and Euler 62 Karras levels (diffusers: 61)
    ("LMSDiscreteScheduler", dict(SD, timestep_spacing="trailing"), 61),
    ("EulerDiscreteScheduler", dict(SD, timestep_spacing="trailing", use_karras_sigmas=True), 61),
    # DPM-Solver++
    ("DPMSolverMultistepScheduler", dict(SD, timestep_spacing="leading", steps_offset=1), 25),
    ("DPMSolverMultistepScheduler", dict(SD, use_karras_sigmas=True, solver_order=3), 10),  # (order 3 was refused)
    # (Not with karras: sigma_max = 4096 makes the first two karras timesteps both 999, and diffusers then
    # starts at index 1 and runs off the end of its sigmas.)
    ("DPMSolverMultistepScheduler", dict(SD, prediction_type="v_prediction", rescale_betas_zero_snr=True,
                                         timestep_spacing="trailing"), 25),
    ("DPMSolverMultistepScheduler", dict(lower_order_final=False, final_sigmas_type="sigma_min",
                                         prediction_type="v_prediction", use_lu_lambdas=True), 10),
    ("DPMSolverMultistepScheduler", dict(SD, use_beta_sigmas=True, solver_type="heun"), 10),
    ("DPMSolverMultistepScheduler", dict(prediction_type="sample", thresholding=True, solver_type="heun",
                                         sample_max_value=1.2, timestep_spacing="trailing"), 10),
    ("DPMSolverMultistepScheduler", dict(SD, euler_at_final=True, use_exponential_sigmas=True), 20),
    # (a DDPM config's variance_type carries over to DPM-Solver, which ignores the fixed_* types: it was refused)
    ("DPMSolverMultistepScheduler", dict(SD, solver_order=1, variance_type="fixed_small"), 1),
    # 'trailing' at 61 steps ends at timestep -1: 62 steps, the last one's sigma clamped to timestep 0's (diffusers
    # interpolates); with sigma_min the last step is from that sigma to itself (h = 0). It was refused.
    ("DPMSolverMultistepScheduler", dict(SD, timestep_spacing="trailing", final_sigmas_type="sigma_min"), 61),
    # DDPM
    ("DDPMScheduler", dict(), 10),
    ("DDPMScheduler", dict(SD, prediction_type="v_prediction", timestep_spacing="trailing",
                           rescale_betas_zero_snr=True, clip_sample=False), 25),
    ("DDPMScheduler", dict(variance_type="fixed_large", timestep_spacing="trailing", clip_sample=False), 1),
    ("DDPMScheduler", dict(variance_type="learned_range", timestep_spacing="linspace", thresholding=True), 10),
    ("DDPMScheduler", dict(SD, variance_type="fixed_small_log", steps_offset=1, prediction_type="sample"), 25),
]


def _case_id(case):
    name, config, n = case
    return f"{name.removesuffix('Scheduler')}-{n}-" + ",".join(f"{k}={v}" for k, v in config.items()
                                                               if k not in SD or config[k] != SD[k])


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_trajectory_matches_diffusers(case):
    class_name, config, n = case
    raw = _raw(class_name, **config)
    ref, sched, state = _pair(raw, n)
    ref64 = _float64(raw, n)
    if config.get("interpolation_type") == "log_linear":  # diffusers keeps one level more than its steps reach
        ref.sigmas, ref64.sigmas = ref.sigmas[:len(state.timesteps) + 1], ref64.sigmas[:len(state.timesteps) + 1]
    _check_schedule(ref, sched, state, ref64)
    x = np.random.default_rng(n).standard_normal(SHAPE).astype(np.float32) * float(ref.init_noise_sigma)
    expected, noises = _reference(ref, raw, n, nhwc_to_nchw(x))
    ours, final = _trajectory(sched, state, jnp.asarray(x), noises, _learned(raw))
    _check_trajectory(ours, expected)
    assert int(final.step_index) == len(state.timesteps)


def test_ddim_eta_matches_diffusers():
    raw = _raw("DDIMScheduler", **SD, steps_offset=1, clip_sample=False)
    ref, _, state = _pair(raw, 10)
    sched = S.DDIMScheduler(scheduler_from_config(raw).config, eta=0.7)
    x = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
    expected, noises = _reference(ref, raw, 10, nhwc_to_nchw(x), ddim_eta=0.7)
    ours, _ = _trajectory(sched, state, jnp.asarray(x), noises, False)
    _check_trajectory(ours, expected)


def test_dpm_solver_drops_learned_variance_like_diffusers():
    """diffusers keeps the first 3 channels of a learned-variance model (pixel-space models such as IF)."""
    raw = _raw("DPMSolverMultistepScheduler", variance_type="learned_range", use_karras_sigmas=True)
    shape = (2, 5, 5, 3)
    ref, sched, state = _pair(raw, 10, shape)
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    expected, _ = _reference(ref, raw, 10, nhwc_to_nchw(x))
    ours, _ = _trajectory(sched, state, jnp.asarray(x), None, True)
    _check_trajectory(ours, expected)


IMG2IMG = [
    ("DDIMScheduler", dict(SD, steps_offset=1, clip_sample=False, set_alpha_to_one=False), 25),
    ("PNDMScheduler", dict(SD, skip_prk_steps=True, steps_offset=1), 25),
    ("EulerDiscreteScheduler", dict(SD, use_karras_sigmas=True), 10),
    ("EulerDiscreteScheduler", dict(SD), 25),  # linspace: fractional timesteps
    ("EulerAncestralDiscreteScheduler", dict(SD, timestep_spacing="leading", steps_offset=1), 10),
    ("LMSDiscreteScheduler", dict(SD), 25),
    ("DPMSolverMultistepScheduler", dict(SD, use_karras_sigmas=True), 25),
    ("DDPMScheduler", dict(SD, clip_sample=False), 10),
]


@pytest.mark.parametrize("case", IMG2IMG, ids=[_case_id(c) for c in IMG2IMG])
def test_img2img_start_matches_diffusers_pipeline(case):
    """As diffusers' img2img pipelines: t_start from strength, add_noise at the first remaining timestep."""
    class_name, config, n = case
    raw = _raw(class_name, **config)
    strength = 0.6
    ref, sched, state = _pair(raw, n, strength=strength)
    t_start = max(n - min(int(n * strength), n), 0)
    begin = t_start * ref.order
    assert state.begin_index == begin and sched.order == ref.order
    ref64 = _float64(raw, n)
    assert_close_to_float64(np.asarray(sched.timesteps_to_run(state)), ref.timesteps[begin:].numpy(),
                            ref64.timesteps[begin:].numpy(), what="timesteps", elementwise=True)
    rng = np.random.default_rng(3)
    x0 = rng.standard_normal(SHAPE).astype(np.float32)
    noise = rng.standard_normal(SHAPE).astype(np.float32)
    if hasattr(ref, "set_begin_index"):
        ref.set_begin_index(begin)
        ref64.set_begin_index(begin)
    start = ref.add_noise(nhwc_to_nchw(x0), nhwc_to_nchw(noise), ref.timesteps[begin:begin + 1].repeat(SHAPE[0]))
    with diffusers_float64():
        start64 = ref64.add_noise(nhwc_to_nchw(x0).double(), nhwc_to_nchw(noise).double(),
                                  ref64.timesteps[begin:begin + 1].repeat(SHAPE[0]))
    ours_start = sched.add_noise_at_step(state, jnp.asarray(x0), jnp.asarray(noise))
    assert_close_to_float64(ours_start, _nhwc(start), _nhwc(start64), what="noised start")
    if not config.get("use_karras_sigmas"):  # add_noise at the start timestep agrees (what pipelines call)
        t = jnp.broadcast_to(sched.current_timestep(state), (SHAPE[0],))
        assert_close_to_float64(sched.add_noise(jnp.asarray(x0), jnp.asarray(noise), t), _nhwc(start),
                                _nhwc(start64), what="add_noise")
    expected, noises = _reference(ref, raw, n, start, begin=begin)
    ours, _ = _trajectory(sched, state, ours_start, noises, False)
    _check_trajectory(ours, expected)


# ---------------------------------------------------------------------------------------------------------------
# Training helpers


# With zero-SNR rescaling diffusers' float32 arithmetic moves alphas_cumprod[0] by a few ulp, which is ~0.2% of
# 1 - alphas_cumprod[0]; eqxdiff rescales in float64 (test_zero_snr_rescale_matches_diffusers_in_float64), so ours
# is the closer of the two to diffusers' own float64 run there.
@pytest.mark.parametrize("class_name,config", [
    ("DDPMScheduler", dict(SD)),
    ("DDPMScheduler", dict(rescale_betas_zero_snr=True, beta_schedule="squaredcos_cap_v2")),
    ("DDIMScheduler", dict(SD)),
    ("PNDMScheduler", dict()),
    ("EulerDiscreteScheduler", dict(SD)),
    ("EulerDiscreteScheduler", dict(rescale_betas_zero_snr=True)),
    ("EulerAncestralDiscreteScheduler", dict(SD)),
    ("LMSDiscreteScheduler", dict(SD)),
])
def test_add_noise_matches_diffusers(class_name, config):
    raw = _raw(class_name, **config)
    ref = getattr(diffusers, class_name).from_config(raw)  # no set_timesteps: the training schedule
    ref64 = _float64(raw)
    sched = scheduler_from_config(raw)
    rng = np.random.default_rng(0)
    x0, noise = (rng.standard_normal((5, 3, 2, 4)).astype(np.float32) for _ in range(2))
    t = np.array([0, 1, 250, 998, 999])
    t_ref = torch.from_numpy(t).float() if class_name in ("EulerDiscreteScheduler", "LMSDiscreteScheduler",
                                                          "EulerAncestralDiscreteScheduler") else torch.from_numpy(t)
    expected = ref.add_noise(nhwc_to_nchw(x0), nhwc_to_nchw(noise), t_ref)
    with diffusers_float64():
        expected64 = ref64.add_noise(nhwc_to_nchw(x0).double(), nhwc_to_nchw(noise).double(), t_ref)
    ours = jax.jit(sched.add_noise)(jnp.asarray(x0), jnp.asarray(noise), jnp.asarray(t))
    assert_close_to_float64(ours, _nhwc(expected), _nhwc(expected64), what="add_noise")


@pytest.mark.parametrize("name", [n for n, c in S.SCHEDULERS.items() if issubclass(c.cls, S.AbstractBetaScheduler)])
def test_get_velocity_and_dpm_add_noise_match_ddpm(name):
    """``get_velocity`` is DDPMScheduler's for every scheduler (diffusers' Euler version indexes alphas_cumprod
    by position in its timestep list, not by timestep); DPM-Solver's ``add_noise`` is DDPM's forward process
    (diffusers' indexes its unflipped training sigmas by that position)."""
    sched = scheduler_from_config(_raw("DDPMScheduler", **SD), name=name)
    ref = diffusers.DDPMScheduler.from_config(_raw("DDPMScheduler", **SD))
    ref64 = _float64(_raw("DDPMScheduler", **SD))
    rng = np.random.default_rng(1)
    x0, noise = (rng.standard_normal((4, 3, 2, 4)).astype(np.float32) for _ in range(2))
    t = np.array([0, 17, 500, 998])
    args, args64 = (nhwc_to_nchw(x0), nhwc_to_nchw(noise), torch.from_numpy(t)), \
        (nhwc_to_nchw(x0).double(), nhwc_to_nchw(noise).double(), torch.from_numpy(t))
    with diffusers_float64():
        velocity64, noised64 = ref64.get_velocity(*args64), ref64.add_noise(*args64)
    assert_close_to_float64(sched.get_velocity(jnp.asarray(x0), jnp.asarray(noise), jnp.asarray(t)),
                            _nhwc(ref.get_velocity(*args)), _nhwc(velocity64), what="velocity")
    if isinstance(sched, S.DPMSolverMultistepScheduler):
        assert_close_to_float64(sched.add_noise(jnp.asarray(x0), jnp.asarray(noise), jnp.asarray(t)),
                                _nhwc(ref.add_noise(*args)), _nhwc(noised64), what="add_noise")


def test_alphas_cumprod_match_diffusers():
    for config in (SD, dict(beta_schedule="squaredcos_cap_v2"), dict(trained_betas=np.linspace(1e-4, 0.03, 1000))):
        raw = _raw("DDPMScheduler", **config)
        ours = scheduler_from_config(raw).alphas_cumprod
        expected = diffusers.DDPMScheduler.from_config(raw).alphas_cumprod.numpy()
        # each value is a product of up to 1000 roundings, as accurate as diffusers' own (against its float64 run)
        assert_close_to_float64(ours, expected, _float64(raw).alphas_cumprod.numpy(), what=f"alphas_cumprod {config}",
                                elementwise=True)


@pytest.mark.parametrize("config", [SD, dict(), dict(beta_start=0.0003, beta_end=0.021, num_train_timesteps=777),
                                    dict(SD, num_train_timesteps=2001)])
def test_linear_betas_are_diffusers_bit_for_bit(config):
    """Linear and scaled-linear betas are torch's float32 linspace, bit for bit (NumPy's float64 linspace cast to
    float32 is an ulp off in about a third of them, which moved a truncated timestep under exponential or beta sigma
    spacing), and so are alphas_cumprod."""
    raw = _raw("DDPMScheduler", **config)
    ours, ref = scheduler_from_config(raw), diffusers.DDPMScheduler.from_config(raw)
    np.testing.assert_array_equal(S._beta.betas(ours.config), ref.betas.numpy())
    np.testing.assert_array_equal(np.asarray(ours.alphas_cumprod), ref.alphas_cumprod.numpy())


@pytest.mark.parametrize("config", [dict(), SD, dict(beta_schedule="squaredcos_cap_v2")])
def test_zero_snr_rescale_matches_diffusers_in_float64(config):
    """The zero-SNR rescale is computed in float64: it is diffusers' ``rescale_zero_terminal_snr`` applied to
    float64 betas. (diffusers' float32 evaluation differs from this by up to ~4e-5 in the last few values.)"""
    from diffusers.schedulers.scheduling_ddpm import rescale_zero_terminal_snr

    raw = _raw("DDPMScheduler", **config, rescale_betas_zero_snr=True)
    plain = diffusers.DDPMScheduler.from_config({**raw, "rescale_betas_zero_snr": False}).betas
    betas = rescale_zero_terminal_snr(plain.double()).float()
    expected64 = torch.cumprod(1.0 - betas.double(), 0).numpy()
    ours = scheduler_from_config(raw).alphas_cumprod
    assert ours[-1] == 0.0
    # the float64 product rounded once to float32: ours within a few of those roundings, value by value
    assert_close_to_float64(ours, expected64.astype(np.float32), expected64, what="alphas_cumprod", elementwise=True)
    # Euler floors the last value only (the others are the same numbers: exactly equal)
    floored = scheduler_from_config(raw, name="euler").alphas_cumprod
    assert floored[-1] == np.float32(2.0**-24) and np.array_equal(floored[:-1], ours[:-1])


# ---------------------------------------------------------------------------------------------------------------
# Swapping by name, configs


SD15_RAW = _raw("PNDMScheduler", beta_end=0.012, beta_schedule="scaled_linear", beta_start=0.00085,
                num_train_timesteps=1000, set_alpha_to_one=False, skip_prk_steps=True, steps_offset=1,
                trained_betas=None, clip_sample=False)
DIFFUSERS_NAMES = {"ddim": "DDIMScheduler", "pndm": "PNDMScheduler", "euler": "EulerDiscreteScheduler",
                   "euler_a": "EulerAncestralDiscreteScheduler", "lms": "LMSDiscreteScheduler",
                   "dpm++2m": "DPMSolverMultistepScheduler", "dpm++2m_karras": "DPMSolverMultistepScheduler",
                   "ddpm": "DDPMScheduler", "flow_euler": "FlowMatchEulerDiscreteScheduler",
                   "unipc": "UniPCMultistepScheduler", "lcm": "LCMScheduler", "tcd": "TCDScheduler"}


@pytest.mark.parametrize("name", list(S.SCHEDULERS))
def test_swap_by_name_matches_diffusers_from_config(name):
    assert set(DIFFUSERS_NAMES) == set(S.SCHEDULERS)
    source = diffusers.PNDMScheduler.from_config(SD15_RAW)
    overrides = {"use_karras_sigmas": name.endswith("karras")} if name.startswith("dpm") else {}
    ref = getattr(diffusers, DIFFUSERS_NAMES[name]).from_config(source.config, **overrides)
    sched = scheduler_from_config(SD15_RAW, name=name)
    assert type(sched).__name__ == DIFFUSERS_NAMES[name]
    for key, value in sched.config.to_dict().items():
        if not key.startswith("_"):
            assert value == ref.config[key], f"{name}: {key}={value!r}, diffusers has {ref.config[key]!r}"
    # Also from diffusers' own .config, and from ours (both list the keys that were defaulted).
    assert scheduler_from_config(dict(source.config), name=name).config == sched.config
    ours_source = scheduler_from_config(SD15_RAW)
    assert scheduler_from_config(ours_source.config.to_dict(), name=name).config == sched.config
    ref.set_timesteps(10)
    np.testing.assert_allclose(np.asarray(sched.init(10, sample_shape=SHAPE).timesteps), ref.timesteps.numpy())


def test_options_set_last_over_the_names_own_keys():
    """A key the user sets that the scheduler's name also sets (``dpm++2m_karras``: ``use_karras_sigmas=True``,
    ``solver_order=2``) takes the user's value, in load_pipeline / with_scheduler / the CLI's --scheduler-option
    (all through ``build_scheduler``); it raised TypeError "got multiple values for keyword argument"."""
    from eqxdiff.pipelines._components import build_scheduler

    sched = scheduler_from_config(SD15_RAW, name="dpm++2m_karras", use_karras_sigmas=False, solver_order=1)
    assert (sched.config.use_karras_sigmas, sched.config.solver_order, sched.config.algorithm_type) == (
        False, 1, "dpmsolver++")
    sched, _ = build_scheduler(SD15_RAW, "dpm++2m_karras", {"use_karras_sigmas": False})
    assert sched.config == scheduler_from_config(SD15_RAW, name="dpm++2m").config


@pytest.mark.parametrize("class_name", list(S.SCHEDULER_CLASSES))
def test_config_covers_every_diffusers_key(class_name):
    """Each diffusers ``__init__`` argument is a config field, or one whose only values eqxdiff ignores."""
    ignored = {"flow_shift", "time_shift_type"}  # (LCM/TCD and others: keys their diffusers class only stores)
    params = set(inspect.signature(getattr(diffusers, class_name).__init__).parameters) - {"self"}
    fields = set(S.SCHEDULER_CLASSES[class_name].CONFIG().to_dict())
    assert params - fields <= ignored, params - fields - ignored
    # Defaults agree with diffusers.
    defaults = getattr(diffusers, class_name)().config
    for key, value in S.SCHEDULER_CLASSES[class_name].CONFIG().to_dict().items():
        assert value == defaults[key], f"{class_name}: default {key}={value!r}, diffusers {defaults[key]!r}"


@pytest.mark.parametrize("raw,match", [
    (_raw("DDIMScheduler", beta_schedule="sigmoid"), "beta_schedule='sigmoid'"),
    (_raw("DDIMScheduler", timestep_spacing="karras"), "timestep_spacing='karras'"),
    (_raw("DDIMScheduler", prediction_type="flow_prediction"), "prediction_type='flow_prediction'"),
    (_raw("PNDMScheduler", prediction_type="sample"), "prediction_type='sample'"),
    (_raw("EulerAncestralDiscreteScheduler", prediction_type="sample"), "prediction_type='sample'"),
    (_raw("LMSDiscreteScheduler", use_exponential_sigmas=True, use_beta_sigmas=True),
     "use_exponential_sigmas=True cannot be combined with use_beta_sigmas=True"),
    (_raw("EulerDiscreteScheduler", interpolation_type="cubic"), "interpolation_type='cubic'"),
    (_raw("EulerDiscreteScheduler", use_karras_sigmas=True, use_exponential_sigmas=True), "use_karras_sigmas"),
    (_raw("DPMSolverMultistepScheduler", algorithm_type="dpmsolver"), "final_sigmas_type='zero' is refused by "
     "diffusers with algorithm_type='dpmsolver'"),
    (_raw("DPMSolverMultistepScheduler", algorithm_type="sde-dpmsolver", final_sigmas_type="sigma_min",
          solver_order=3), "solver_order=3 with algorithm_type='sde-dpmsolver' has no update in diffusers"),
    (_raw("DPMSolverMultistepScheduler", solver_order=4), "solver_order=4"),
    (_raw("DPMSolverMultistepScheduler", use_lu_lambdas=True, use_flow_sigmas=True,
          prediction_type="flow_prediction"), "use_lu_lambdas=True cannot be combined with use_flow_sigmas"),
    (_raw("DDPMScheduler", variance_type="fixed_large_log"), "variance_type='fixed_large_log' gives NaN"),
    (_raw("DDPMScheduler", trained_betas=[0.1, 0.2]), "trained_betas"),
    (_raw("DDIMScheduler", clip_sample=1), "clip_sample=1"),
    (_raw("KDPM2DiscreteScheduler"), "_class_name='KDPM2DiscreteScheduler'.*DDIMScheduler"),
    ({"beta_schedule": "linear"}, "no _class_name.*euler_a"),
])
def test_config_errors_name_key_and_value(raw, match):
    with pytest.raises(ConfigError, match=match):
        scheduler_from_config(raw)


@pytest.mark.parametrize("class_name,config", [
    ("DDIMScheduler", {"clip_sample": False}), ("DDPMScheduler", {"thresholding": True}), ("LCMScheduler", {}),
    ("TCDScheduler", {"clip_sample": True}),  # TCD never clips
])
def test_zero_snr_epsilon_start_is_refused_where_diffusers_gives_nan(class_name, config):
    """Zero terminal SNR with an epsilon model: the first step's clean-sample estimate is x / 0; without a clip that
    bounds it diffusers' sample is NaN, and eqxdiff refuses the schedule at init, naming the fixes (it returned NaN)."""
    raw = _raw(class_name, **SD, rescale_betas_zero_snr=True, timestep_spacing="trailing", **config)
    ref = getattr(diffusers, class_name).from_config(raw)
    ref.set_timesteps(4)
    x = torch.ones(1, 2, 3, 3)
    assert not torch.isfinite(ref.step(0.5 * x, ref.timesteps[0], x, generator=torch.Generator()).prev_sample).all()
    sched = scheduler_from_config(raw)
    with pytest.raises(ConfigError, match="rescale_betas_zero_snr=True with prediction_type='epsilon' steps from "
                                          "timestep 999.*v_prediction"):
        sched.init(4, sample_shape=SHAPE)
    sched.init(4, sample_shape=SHAPE, strength=0.5)  # starting below t = 999 is fine
    if class_name != "TCDScheduler":  # as is a clip that bounds the estimate (diffusers' result is finite)
        scheduler_from_config({**raw, "clip_sample": True, "thresholding": False}).init(4, sample_shape=SHAPE)


def test_dpm_solver_zero_step_is_refused_where_diffusers_is_not_finite():
    """A second-order update across a repeated sigma divides by a zero step: heun's (e^-h - 1) / h at a Karras
    schedule's last step into the equal sigma_min, the repeated timestep of 1000 linspace steps. diffusers' sample
    is NaN / inf; eqxdiff refuses the schedule at init (it returned NaN)."""
    raw = _raw("DPMSolverMultistepScheduler", **SD, solver_type="heun", lower_order_final=False,
               final_sigmas_type="sigma_min", use_karras_sigmas=True)
    ref = diffusers.DPMSolverMultistepScheduler.from_config(raw)
    ref.set_timesteps(7)
    x = torch.ones(1, 2, 3, 3)
    for t in ref.timesteps:
        x = ref.step(0.3 * x + 0.1, t, x).prev_sample
    assert not torch.isfinite(x).all()
    with pytest.raises(ConfigError, match="multistep update of step 6 of 7 .* divides by a zero step"):
        scheduler_from_config(raw).init(7, sample_shape=SHAPE)
    scheduler_from_config(raw, euler_at_final=True).init(7, sample_shape=SHAPE)  # the fix it names
    with pytest.raises(ConfigError, match=r"step 500 of 1000 .* \(1000 'linspace' steps repeat a timestep\)"):
        scheduler_from_config(_raw("DPMSolverMultistepScheduler", **SD)).init(1000, sample_shape=SHAPE)


def test_usage_errors():
    with pytest.raises(ValueError, match="unknown scheduler name 'heun'.*dpm\\+\\+2m_karras"):
        scheduler_from_config(SD15_RAW, name="heun")
    with pytest.raises(ValueError, match="sample_shape="):
        scheduler_from_config(SD15_RAW).init(10)
    euler_a = scheduler_from_config(SD15_RAW, name="euler_a")
    state = euler_a.init(10)
    with pytest.raises(ValueError, match="pass key= .* or noise="):
        euler_a.step(state, jnp.zeros(SHAPE), jnp.zeros(SHAPE))
    with pytest.raises(ValueError, match="strength=1.5"):
        euler_a.init(10, strength=1.5)
    with pytest.raises(ValueError, match="not both"):
        euler_a.init(10, strength=0.5, begin_index=2)
    with pytest.raises(ValueError, match="num_inference_steps=0"):
        euler_a.init(0)
    with pytest.raises(ValueError, match="outside"):
        S.DDIMScheduler.from_config({"steps_offset": 200}).init(5)
    # (DDIM, DDPM, PNDM: diffusers' extra step at timestep -1 reads alphas_cumprod[-1]; DPM-Solver and UniPC run it)
    for cls, n in ((S.DDIMScheduler, 61), (S.DDPMScheduler, 103), (S.PNDMScheduler, 121)):
        with pytest.raises(ValueError, match=r"timesteps \[-1\] fall outside .*'trailing' overshoots to -1 .*"
                                             r"reads alphas_cumprod\[-1\], the noisiest value"):
            cls.from_config({"timestep_spacing": "trailing"}).init(n, sample_shape=SHAPE)
    assert euler_a.remaining_steps(euler_a.init(10, begin_index=3)) == 7
    # Shapes are checked (jaxtyping + beartype, at trace time).
    with pytest.raises(Exception, match="dims"):
        euler_a.step(state, jnp.zeros(SHAPE), jnp.zeros(SHAPE[:-1]), key=jax.random.key(0))


# ---------------------------------------------------------------------------------------------------------------
# A plain fori_loop with keys, dtypes


def test_fori_loop_with_keys_is_deterministic_and_keeps_dtype():
    sched = scheduler_from_config(SD15_RAW, name="euler_a")

    @eqx.filter_jit
    def sample(sched, state, x, key):
        def body(_, carry):
            x, state, key = carry
            key, sub = jax.random.split(key)
            out = _fake_jax(sched.scale_model_input(state, x), sched.current_timestep(state), False)
            x, state = sched.step(state, out, x, key=sub)
            return x, state, key

        return jax.lax.fori_loop(0, sched.remaining_steps(state), body, (x, state, key))[0]

    state = sched.init(8)
    x = jnp.ones(SHAPE, jnp.bfloat16) * sched.init_noise_sigma(state).astype(jnp.bfloat16)
    a = sample(sched, state, x, jax.random.key(0))
    b = sample(sched, state, x, jax.random.key(0))
    c = sample(sched, state, x, jax.random.key(1))
    assert a.dtype == jnp.bfloat16 and bool(jnp.all(a == b)) and not bool(jnp.all(a == c))


# ---------------------------------------------------------------------------------------------------------------
# Convergence on a Gaussian target


MU, STD = 0.7, 0.3


def _gaussian_moments(sched, state, acp_of_state):
    """Mean and variance of the samples of N(MU, STD^2) drawn with the exact denoiser.

    The sampler is affine in its starting point, so three starting points (z = -1, 0, 1 times the exact
    marginal's std) give the output mean and std exactly, without Monte Carlo noise.
    """

    def eps_model(x_in, state):
        a = acp_of_state(state)  # x_in = sqrt(a) x0 + sqrt(1 - a) eps
        return jnp.sqrt(1 - a) * (x_in - jnp.sqrt(a) * MU) / (a * STD**2 + 1 - a)

    @eqx.filter_jit
    def run(sched, state, x):
        def body(_, carry):
            x, state = carry
            return sched.step(state, eps_model(sched.scale_model_input(state, x), state), x)

        return jax.lax.fori_loop(0, sched.remaining_steps(state), body, (x, state))[0]

    a0 = acp_of_state(state)
    sigma_space = isinstance(sched, (S.EulerDiscreteScheduler, S.EulerAncestralDiscreteScheduler, S.LMSDiscreteScheduler))
    scale = 1 / jnp.sqrt(a0) if sigma_space else 1.0  # sigma space: x = x_t / sqrt(a)
    z = jnp.array([-1.0, 0.0, 1.0], jnp.float32)
    x = scale * (jnp.sqrt(a0) * MU + jnp.sqrt(a0 * STD**2 + 1 - a0) * z)
    out = run(sched, state, x)
    return float(out[1]), float(((out[2] - out[0]) / 2) ** 2)


# A long training schedule (the SD betas rescaled to 16000 steps) so that the discrete schedule itself is close
# to its continuous limit: with 1000 training steps even a 1000-step DDIM run ends ~2e-3 off in variance.
FINE_T = 16000
FINE = _raw("DDIMScheduler", num_train_timesteps=FINE_T, beta_start=0.00085 * 1000 / FINE_T,
            beta_end=0.012 * 1000 / FINE_T, beta_schedule="scaled_linear", clip_sample=False)


@pytest.mark.parametrize("name,steps,max_ratio,final", [
    ("euler", (10, 20, 40, 80, 160), 0.6, 1e-2),  # first order: the error halves per doubling, asymptotically
    ("ddim", (10, 20, 40, 80, 160), 0.6, 1e-2),
    ("dpm++2m_karras", (10, 20, 40, 80), 0.3, 1e-3),  # second order: a quarter per doubling
])
def test_sampling_converges_on_gaussian_target(name, steps, max_ratio, final):
    sched = scheduler_from_config(FINE, name=name)
    acp = jnp.asarray(sched.alphas_cumprod)
    if name == "ddim":
        acp_of_state = lambda s: acp[sched.current_timestep(s)]  # noqa: E731
    else:
        acp_of_state = lambda s: 1 / (s.sigmas[s.step_index] ** 2 + 1)  # noqa: E731
    errors = []
    for n in steps:
        mean, var = _gaussian_moments(sched, sched.init(n, sample_shape=(3,)), acp_of_state)
        errors.append(abs(mean - MU) + abs(var - STD**2))
    assert all(b < a for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < max_ratio * errors[-2], errors
    assert errors[-1] < final, errors
