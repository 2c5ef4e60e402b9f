"""The flow-matching, UniPC, LCM and TCD schedulers (and the custom schedules diffusers' ``set_timesteps`` takes)
against diffusers over whole jitted trajectories, fixed fake model outputs and the same noise; img2img starts; the
DDPM scheduler read from a DPM-Solver config; errors; keys in a ``fori_loop``; convergence on a Gaussian target.

Every float32 comparison is bounded by diffusers' scheduler run in float64 (``diffusers_float64``: the same program,
its float32 tables and arithmetic raised, the same noise): ours must be as accurate as diffusers' float32 run is
against it, step by step. (XLA contracts the update's multiply-adds into FMAs where the CPU has them, PyTorch does
not: the two float32 trajectories differ by a few ulps on one CPU and not on another, so no fixed bound.)"""

import inspect
import itertools
import json
import math
import re
from pathlib import Path

import diffusers
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eqxdiff
from eqxdiff import schedulers as S
from eqxdiff.schedulers import ConfigError, scheduler_from_config

from ._util import assert_close_to_float64, diffusers_float64, nhwc_to_nchw

# diffusers' schedulers trip NumPy 2's __array__(copy=) deprecation, warn about custom schedules and deprecate
# DPM-Solver's noise-prediction algorithm types (which eqxdiff serves as diffusers 0.42.1 runs them).
pytestmark = [pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore:.algorithm_types dpmsolver and sde-dpmsolver. is deprecated")]

SHAPE = (2, 4, 3, 2)  # channels-last
SD = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}
FLOW = "FlowMatchEulerDiscreteScheduler"
UNIPC = "UniPCMultistepScheduler"
WAN = {"use_flow_sigmas": True, "flow_shift": 3.0, "prediction_type": "flow_prediction"}


def _nhwc(t):
    return np.moveaxis(t.detach().numpy(), 1, -1)


def _fake_jax(x, t):
    return 0.3 * x + 0.1 * jnp.sin(t.astype(jnp.float32))


def _fake_torch(x, t):
    return 0.3 * x + 0.1 * torch.sin(torch.as_tensor(t).to(x.dtype))  # float32, or float64 in the float64 run


def _trajectory(sched, state, x, noises):
    """Every intermediate sample of a jitted ``lax.scan`` over ``sched.step`` (the noises are ignored by
    deterministic schedulers), run as the pipelines' loop runs it: on the state padded to the fixed schedule length,
    with the scheduler's ``stepper()`` (every parity case also proves that padding and the stepper change
    nothing)."""
    return _scan(sched.stepper(), S.pad_schedule(state), x, noises)


@eqx.filter_jit
def _scan(sched, state, x, noises):
    def body(carry, noise):
        x, state = carry
        out = _fake_jax(sched.scale_model_input(state, x), sched.current_timestep(state))
        x, state = sched.step(state, out, x, noise=noise)
        return (x, state), x

    (_, state), xs = jax.lax.scan(body, (x, state), noises)
    return xs, state


def _reference(ref, x, *, begin=0, **step_kwargs):
    """diffusers' samples from ``x`` (NCHW) and the noise each step drew: replayed from the generator's state before
    the step, zeros where the step drew none."""
    if begin:
        ref.set_begin_index(begin)
    takes_generator = "generator" in inspect.signature(ref.step).parameters
    generator = torch.Generator().manual_seed(0)
    samples, noises = [], []
    for t in ref.timesteps[begin:]:
        before = generator.get_state()
        model_input = ref.scale_model_input(x, t) if hasattr(ref, "scale_model_input") else x
        kwargs = {"generator": generator} if takes_generator else {}
        x = ref.step(_fake_torch(model_input, t), t, x, **kwargs, **step_kwargs).prev_sample
        replay = torch.Generator()
        replay.set_state(before)
        drew = not torch.equal(before, generator.get_state())
        noises.append(torch.randn(x.shape, generator=replay) if drew else torch.zeros_like(x))
        samples.append(_nhwc(x))
    return np.stack(samples), jnp.asarray(np.stack([_nhwc(z) for z in noises]))


def _reference64(ref64, x, **kwargs):
    """``_reference`` of a scheduler from ``_pair(..., float64=True)`` from ``x`` (float32 NCHW: its values), in
    float64: the samples only (the noise is the float32 run's, replayed by the same generator)."""
    with diffusers_float64():
        return _reference(ref64, x.double(), **kwargs)[0]


def _pair(class_name, config, n, init=None, eta=None, float64=False):
    """diffusers' scheduler, ours and our state; with ``float64`` diffusers' built in float64 as well (last)."""
    raw = {"_class_name": class_name, "_diffusers_version": "0.42.1", **config}
    init = init or {}

    def build():
        ref = getattr(diffusers, class_name).from_config(raw)
        ref.set_timesteps(n, **{k: (np.asarray(v) if k == "sigmas" else v) for k, v in init.items()})
        return ref

    ref = build()
    sched = scheduler_from_config(raw)
    if eta is not None:
        sched = S.TCDScheduler(sched.config, eta=eta)
    pair = ref, sched, sched.init(n, sample_shape=SHAPE, **init)
    if float64:
        with diffusers_float64():
            pair += (build(),)
    return pair


def _check_schedule(ref, state, ref64):
    """Integer timesteps exactly; float ones and the sigmas as accurate as diffusers', value by value."""
    if np.issubdtype(ref.timesteps.numpy().dtype, np.integer):
        np.testing.assert_array_equal(np.asarray(state.timesteps), ref.timesteps.numpy())
    else:
        assert_close_to_float64(state.timesteps, ref.timesteps.numpy(), ref64.timesteps.numpy(), what="timesteps",
                                elementwise=True)
    if hasattr(state, "sigmas"):
        assert_close_to_float64(state.sigmas, ref.sigmas.numpy(), ref64.sigmas.numpy(), what="sigmas",
                                elementwise=True)


def _check_trajectory(ours, expected, expected64):
    assert ours.shape == expected.shape == expected64.shape
    for i, (a, e, e64) in enumerate(zip(ours, expected, expected64, strict=True)):
        assert_close_to_float64(a, e, e64, what=f"sample after step {i}")


CASES = [
    # flow-matching Euler: SD3's static shift, Flux's dynamic mu (exponential, linear; custom sigmas as the Flux
    # pipeline passes them), LTX's shift_terminal, respaced sigmas, Mochi's inverted sigmas, stochastic sampling
    (FLOW, {}, 10, {}, None),
    (FLOW, {"shift": 3.0}, 8, {}, None),
    (FLOW, {"use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15}, 6, {"mu": 0.8}, None),
    (FLOW, {"use_dynamic_shifting": True, "time_shift_type": "linear"}, 5, {"mu": 1.5}, None),
    (FLOW, {"use_dynamic_shifting": True}, None, {"mu": 1.1, "sigmas": list(np.linspace(1.0, 1 / 5, 5))}, None),
    (FLOW, {"shift": 2.0, "shift_terminal": 0.1, "num_train_timesteps": 500}, 7, {}, None),
    (FLOW, {"shift": 3.0, "use_karras_sigmas": True}, 6, {}, None),
    (FLOW, {"use_exponential_sigmas": True}, 6, {}, None),
    (FLOW, {"shift": 3.0, "use_beta_sigmas": True}, 6, {}, None),
    (FLOW, {"invert_sigmas": True}, 5, {}, None),
    (FLOW, {"shift": 3.0, "stochastic_sampling": True}, 6, {}, None),
    (FLOW, {"shift": 3.0}, None, {"timesteps": [1000.0, 800.0, 500.0, 100.0]}, None),
    # UniPC on beta schedules. (diffusers returns NaN on the last step of some configs, which eqxdiff refuses:
    # test_unipc_undefined_update_is_refused_where_diffusers_is_not_finite.)
    (UNIPC, SD, 10, {}, None),
    (UNIPC, dict(SD, solver_type="bh1", solver_order=3, final_sigmas_type="sigma_min"), 12, {}, None),
    # long runs: the order-3 B(h) weights cancel catastrophically in float32 (~1/h^2 of their digits); computed in
    # float32 with XLA's expm1 they drifted 20x further from diffusers' float64 run than diffusers' float32 run did
    (UNIPC, dict(SD, solver_type="bh1", solver_order=3, final_sigmas_type="sigma_min"), 200, {}, None),
    (UNIPC, dict(solver_order=1, predict_x0=False, prediction_type="v_prediction", timestep_spacing="trailing",
                 final_sigmas_type="sigma_min"), 8, {}, None),
    (UNIPC, dict(SD, solver_order=3, lower_order_final=False, final_sigmas_type="sigma_min", solver_type="bh1",
                 predict_x0=False), 7, {}, None),
    (UNIPC, dict(SD, use_karras_sigmas=True), 10, {}, None),
    (UNIPC, dict(SD, disable_corrector=[0, 3], solver_type="midpoint"), 8, {}, None),  # midpoint -> bh2
    (UNIPC, dict(SD, use_beta_sigmas=True), 6, {}, None),
    (UNIPC, dict(prediction_type="sample", thresholding=True, sample_max_value=1.2, timestep_spacing="leading",
                 steps_offset=1), 7, {}, None),
    (UNIPC, dict(SD, prediction_type="v_prediction", rescale_betas_zero_snr=True, timestep_spacing="trailing"),
     6, {}, None),
    # 'trailing' at 61 steps ends at timestep -1 (62 steps, the last sigma clamped to timestep 0's): was refused
    (UNIPC, dict(SD, timestep_spacing="trailing", solver_order=3, solver_type="bh1", final_sigmas_type="sigma_min"),
     61, {}, None),
    # UniPC on flow sigmas (Wan: timesteps truncated to integers)
    (UNIPC, WAN, 10, {}, None),
    (UNIPC, dict(WAN, use_dynamic_shifting=True, solver_order=3), None,
     {"mu": 0.9, "sigmas": list(np.linspace(1.0, 1 / 6, 6))}, None),
    (UNIPC, dict(WAN, use_karras_sigmas=True), 6, {}, None),
    # DPM-Solver++ on flow sigmas (Wan's DPM++: 1 - sigma, sigma; the shifted schedule from 1 - 1/T; refused before),
    # from a UniPC config (Wan's folders) whose solver_type bh2 diffusers reads as midpoint (refused before too)
    ("DPMSolverMultistepScheduler", dict(WAN, flow_shift=5.0, solver_type="bh2"), 8, {}, None),
    # dynamic shifting: mu sets the flow shift to exp(mu) (refused before)
    ("DPMSolverMultistepScheduler", dict(WAN, use_dynamic_shifting=True), 5, {"mu": 1.2}, None),
    # DPM++ 2M SDE (sde-dpmsolver++: noise every step; refused before), on a beta schedule and on flow sigmas
    ("DPMSolverMultistepScheduler", dict(SD, algorithm_type="sde-dpmsolver++", solver_type="heun",
                                         use_karras_sigmas=True, solver_order=3), 8, {}, None),
    ("DPMSolverMultistepScheduler", dict(WAN, algorithm_type="sde-dpmsolver++"), 6, {}, None),
    # DPM-Solver (noise predictions; diffusers takes it only with final_sigmas_type="sigma_min"), order 3 and SDE
    ("DPMSolverMultistepScheduler", dict(SD, algorithm_type="dpmsolver", final_sigmas_type="sigma_min",
                                         solver_order=3, prediction_type="v_prediction"), 10, {}, None),
    ("DPMSolverMultistepScheduler", dict(SD, algorithm_type="sde-dpmsolver", final_sigmas_type="sigma_min",
                                         solver_type="heun", thresholding=True, use_karras_sigmas=True), 7, {}, None),
    # (a v-prediction on flow sigmas: alpha = 1 - sigma; diffusers runs it, it was refused)
    ("DPMSolverMultistepScheduler", dict(WAN, solver_type="heun", lower_order_final=False,
                                         prediction_type="v_prediction"), 6, {}, None),
    # LCM and TCD
    ("LCMScheduler", {}, 4, {}, None),
    ("LCMScheduler", {}, None, {"timesteps": [999, 759, 499, 259]}, None),
    ("LCMScheduler", dict(prediction_type="v_prediction", timestep_scaling=5.0, original_inference_steps=100),
     6, {}, None),
    ("LCMScheduler", dict(clip_sample=True, beta_schedule="linear"), 6, {"original_inference_steps": 25}, None),
    ("LCMScheduler", {}, 1, {}, None),
    ("TCDScheduler", {}, 4, {}, 0.3),
    ("TCDScheduler", {}, 4, {}, 0.0),
    ("TCDScheduler", dict(prediction_type="v_prediction"), None, {"timesteps": [999, 759, 499, 259]}, 1.0),
    ("TCDScheduler", dict(prediction_type="sample", set_alpha_to_one=False), 5, {"original_inference_steps": 40},
     0.5),
    # the custom schedules the existing schedulers take
    ("DDPMScheduler", dict(SD, clip_sample=False), None, {"timesteps": [900, 700, 450, 120, 3]}, None),
    ("EulerDiscreteScheduler", SD, None, {"timesteps": [999.0, 750.5, 400.0, 20.0]}, None),
    ("EulerDiscreteScheduler", dict(SD, prediction_type="v_prediction"), None, {"sigmas": [14.0, 5.0, 1.0, 0.1, 0.0]},
     None),
    ("DPMSolverMultistepScheduler", SD, None, {"timesteps": [999, 800, 600, 300, 100, 10]}, None),
]


def _case_id(case):
    name, config, n, init, eta = case
    parts = [f"{k}={v}" for k, v in {**config, **init}.items() if k not in SD or config[k] != SD[k]]
    return f"{name.removesuffix('Scheduler')}-{n}-" + ",".join(parts)[:80] + ("" if eta is None else f"-eta={eta}")


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_trajectory_matches_diffusers(case):
    class_name, config, n, init, eta = case
    ref, sched, state, ref64 = _pair(class_name, config, n, init, eta, float64=True)
    _check_schedule(ref, state, ref64)
    x = np.random.default_rng(len(state.timesteps)).standard_normal(SHAPE).astype(np.float32)
    sigma = float(getattr(ref, "init_noise_sigma", 1.0))  # (diffusers' flow-matching Euler has none: 1)
    assert_close_to_float64(sched.init_noise_sigma(state), np.float32(sigma),
                            np.float64(getattr(ref64, "init_noise_sigma", 1.0)), what="init_noise_sigma")
    x = x * sigma
    step_kwargs = {} if eta is None else {"eta": eta}
    expected, noises = _reference(ref, nhwc_to_nchw(x), **step_kwargs)
    ours, final = _trajectory(sched, state, jnp.asarray(x), noises)
    _check_trajectory(ours, expected, _reference64(ref64, nhwc_to_nchw(x), **step_kwargs))
    assert int(final.step_index) == len(state.timesteps)


def test_unipc_bh1_to_zero_stays_finite():
    """diffusers' bh1 UniPC multiplies a zero residual by B(h) = -inf on the step to sigma 0 and returns NaN; ours
    returns that step's order-1 prediction and agrees with diffusers on every step before it."""
    ref, sched, state, ref64 = _pair(UNIPC, dict(SD, solver_type="bh1"), 6, float64=True)
    x = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    expected, noises = _reference(ref, nhwc_to_nchw(x))
    ours, _ = _trajectory(sched, state, jnp.asarray(x), noises)
    assert np.isnan(expected[-1]).all() and np.isfinite(np.asarray(ours)).all()
    _check_trajectory(ours[:-1], expected[:-1], _reference64(ref64, nhwc_to_nchw(x))[:-1])


def _unipc_row(config, alpha, sig, lam, s0, t, order, corrector):
    """diffusers' UniP / UniC update of ``order`` from sigma index ``s0`` to ``t`` as UniPC's weights, one step at a
    time in float64 (the per-step loop the scheduler's vectorised tables replaced)."""
    with np.errstate(all="ignore"):
        h = lam[t] - lam[s0]
        rks = np.array([(lam[s0 - k] - lam[s0]) / h for k in range(1, order)] + [1.0])
        hh = -h if config.predict_x0 else h
        h_phi_1 = np.expm1(hh)
        h_phi_k = h_phi_1 / hh - 1
        b_h = hh if config.solver_type == "bh1" else np.expm1(hh)
        factorial, rows, b = 1, [], []
        for i in range(1, order + 1):
            rows.append(rks ** (i - 1))
            b.append(h_phi_k * factorial / b_h)
            factorial *= i + 1
            h_phi_k = h_phi_k / hh - 1 / factorial
        r, b = np.stack(rows), np.array(b)

        def solve(r, b):
            try:
                return np.linalg.solve(r, b)
            except np.linalg.LinAlgError:
                return np.full(b.shape, np.nan)

        if corrector:
            rhos = np.array([0.5]) if order == 1 else solve(r, b)
        else:
            rhos = np.zeros(0) if order == 1 else np.array([0.5]) if order == 2 else solve(r[:-1, :-1], b[:-1])
        if config.predict_x0:
            cx, c0, scale = sig[t] / sig[s0], -alpha[t] * h_phi_1, alpha[t]
        else:
            cx, c0, scale = alpha[t] / alpha[s0], -sig[t] * h_phi_1, sig[t]
        row = np.array([cx, c0, 0.0, 0.0, 0.0])
        for k in range(order - 1):
            row[2 + k] = -scale * b_h * rhos[k] / rks[k]
        if corrector:
            row[4] = -scale * b_h * rhos[-1]
    return row if corrector else row[:4]


def test_unipc_weight_tables_match_the_per_step_formulas():
    """UniPC's float64 weight tables are built vectorised over the steps (a Python loop over 999 steps took ~0.6 s
    per init): bit for bit what the step-by-step formulas give, non-finite entries included (the update into sigma 0;
    a repeated sigma, whose singular solve is NaN: NumPy refuses a batched solve for one singular system)."""
    schedules = [np.array([14.6, 8.0, 8.0, 3.0, 1.0, 0.5, 0.5, 0.1, 0.0], np.float32),  # repeats, then sigma 0
                 np.array([0.999, 0.9, 0.7, 0.7, 0.4, 0.2, 0.05, 0.05], np.float32)]  # flow sigmas, ending repeated
    for order, solver_type, predict_x0, flow in itertools.product((1, 2, 3), ("bh1", "bh2"), (True, False),
                                                                  (False, True)):
        sched = S.UniPCMultistepScheduler.from_config(dict(solver_order=order, solver_type=solver_type,
                                                           predict_x0=predict_x0, use_flow_sigmas=flow))
        sigmas = schedules[flow]
        pred, corr = sched._coefficient_tables(sigmas)
        s = sigmas.astype(np.float64)
        alpha, sig = (1 - s, s) if flow else (1 / np.sqrt(s * s + 1), s / np.sqrt(s * s + 1))
        with np.errstate(all="ignore"):
            lam = np.log(alpha) - np.log(sig)
        for i, p in itertools.product(range(len(s) - 1), range(1, order + 1)):
            want = _unipc_row(sched.config, alpha, sig, lam, i, i + 1, p, False) if i >= p - 1 else np.zeros(4)
            np.testing.assert_array_equal(pred[i, p - 1], want, err_msg=f"predictor {sched.config} {i} {p}")
            want = _unipc_row(sched.config, alpha, sig, lam, i - 1, i, p, True) if i >= p else np.zeros(5)
            np.testing.assert_array_equal(corr[i, p - 1], want, err_msg=f"corrector {sched.config} {i} {p}")


@pytest.mark.parametrize("config,fix", [
    (dict(SD, predict_x0=False), "predict_x0=True or final_sigmas_type='sigma_min'"),  # 0 * inf into sigma 0
    (dict(SD, lower_order_final=False), "lower_order_final=True"),  # order 2 into sigma 0: h = inf
    (dict(WAN, lower_order_final=False, final_sigmas_type="sigma_min", solver_order=3),  # equal sigmas: h = 0
     "lower_order_final=True"),
])
def test_unipc_undefined_update_is_refused_where_diffusers_is_not_finite(config, fix):
    """A schedule with an update whose weights are not finite: diffusers' last sample is NaN / inf (or its solve
    fails); eqxdiff refuses it at init, naming the step and the fix (it returned NaN)."""
    raw = {"_class_name": UNIPC, **config}
    ref = diffusers.UniPCMultistepScheduler.from_config(raw)
    ref.set_timesteps(5)
    x = torch.ones(1, 2, 3, 3)
    try:
        for t in ref.timesteps:
            x = ref.step(0.5 * x, t, x).prev_sample
        assert not torch.isfinite(x).all()
    except RuntimeError:  # torch.linalg.solve of a singular matrix
        pass
    with pytest.raises(ConfigError, match=f"update from sigma .* is undefined .*; use {re.escape(fix)}"):
        scheduler_from_config(raw).init(5, sample_shape=SHAPE)


@pytest.mark.parametrize("class_name,config,n,strength,begin", [
    (FLOW, {"shift": 3.0}, 10, 0.65, 3),  # Flux / SD3 pipelines: int(10 - 6.5) = 3 (SD's rule gives 4)
    (UNIPC, WAN, 10, 0.6, 4),
    ("LCMScheduler", {}, 4, 0.5, 2),
    ("TCDScheduler", {}, 6, 0.5, 3),
])
def test_img2img_start_matches_diffusers(class_name, config, n, strength, begin):
    """``init(strength=)`` starts where the diffusers img2img pipeline does, the noised start is the scheduler's
    forward process there (``scale_noise`` / ``add_noise`` after ``set_begin_index``), and the rest matches."""
    ref, sched, state, ref64 = _pair(class_name, config, n, float64=True)
    state = sched.init(n, sample_shape=SHAPE, strength=strength)
    assert state.begin_index == begin == sched.remaining_steps(sched.init(n, sample_shape=SHAPE)) - len(
        ref.timesteps[begin:])
    rng = np.random.default_rng(5)
    x0, noise = (rng.standard_normal(SHAPE).astype(np.float32) for _ in range(2))

    def noised(ref, x0, noise):
        ref.set_begin_index(begin)
        t = ref.timesteps[begin:begin + 1].repeat(SHAPE[0])
        return ref.scale_noise(x0, t, noise) if class_name == FLOW else ref.add_noise(x0, noise, t)

    start = noised(ref, nhwc_to_nchw(x0), nhwc_to_nchw(noise))
    with diffusers_float64():
        start64 = noised(ref64, nhwc_to_nchw(x0).double(), nhwc_to_nchw(noise).double())
    ours_start = sched.add_noise_at_step(state, jnp.asarray(x0), jnp.asarray(noise))
    assert_close_to_float64(ours_start, _nhwc(start), _nhwc(start64), what="noised start")
    expected, noises = _reference(ref, start, begin=begin)
    ours, _ = _trajectory(sched, state, ours_start, noises)
    with diffusers_float64():  # from diffusers' float64 start: the whole float64 program
        expected64 = _reference(ref64, start64, begin=begin)[0]
    _check_trajectory(ours, expected, expected64)


def test_ddpm_from_the_digits_dpm_solver_config_matches_diffusers():
    """The digits model's DPM-Solver++ config (variance_type=None) read by DDPM (what training and --scheduler ddpm
    do), equal to diffusers' DDPMScheduler.from_config of the same dict over a trajectory."""
    folder = Path(eqxdiff.__file__).parent / "assets" / "digits" / "scheduler"
    raw = json.loads((folder / "scheduler_config.json").read_text())
    assert raw["_class_name"] == "DPMSolverMultistepScheduler" and raw["variance_type"] is None
    sched = S.DDPMScheduler.from_config(raw)
    assert sched.config.variance_type is None and scheduler_from_config(raw, name="ddpm").config == sched.config
    ref = diffusers.DDPMScheduler.from_config(raw)
    ref.set_timesteps(12)
    with diffusers_float64():
        ref64 = diffusers.DDPMScheduler.from_config(raw)
        ref64.set_timesteps(12)
    state = sched.init(12, sample_shape=SHAPE)
    _check_schedule(ref, state, ref64)
    x = np.random.default_rng(2).standard_normal(SHAPE).astype(np.float32)
    expected, noises = _reference(ref, nhwc_to_nchw(x))
    ours, _ = _trajectory(sched, state, jnp.asarray(x), noises)
    _check_trajectory(ours, expected, _reference64(ref64, nhwc_to_nchw(x)))


def test_training_schedule_and_dynamic_shift_match_diffusers():
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    raw = {"_class_name": FLOW, "use_dynamic_shifting": True, "base_shift": 0.4, "max_shift": 1.3,
           "base_image_seq_len": 128, "max_image_seq_len": 2048}
    sched = scheduler_from_config(raw)
    for seq in (64, 1024, 4096):  # Python floats (float64), four operations either way: a few float64 ulps apart
        assert sched.dynamic_shift_mu(seq) == pytest.approx(calculate_shift(seq, 128, 2048, 0.4, 1.3), rel=1e-12)
    for config in ({}, {"shift": 3.0, "num_train_timesteps": 700}):
        ref = diffusers.FlowMatchEulerDiscreteScheduler(**config)
        timesteps, sigmas = S.FlowMatchEulerDiscreteScheduler.from_config(config).training_schedule()
        # the same float32 operations in the same order, each a separate correctly rounded one in NumPy and in PyTorch
        # (no FMA can join them): exactly equal on any CPU
        np.testing.assert_array_equal(timesteps, ref.timesteps.numpy())
        np.testing.assert_array_equal(sigmas, ref.sigmas.numpy())


def test_beta_quantile_matches_scipy():
    from scipy.stats import beta

    from eqxdiff.schedulers._sigmas import beta_ppf

    # Both float64, and neither is rounding-limited: SciPy's (Boost's) inverse is within ~3e-16 of a 40-digit mpmath
    # quantile, ours (bisection to 2^-40, then Newton on our float64 CDF) within ~3e-14; 1e-12 is that solver's
    # accuracy with margin, far below the 6e-8 of the float32 sigmas it gives.
    q = np.concatenate([[0.0, 1e-6, 1e-4], np.linspace(0, 1, 41), [1 - 1e-4, 1.0]])
    for a, b in ((0.6, 0.6), (2.0, 5.0), (0.5, 1.5)):  # diffusers' (0.6, 0.6), and two skewed ones
        np.testing.assert_allclose(beta_ppf(q, a, b), beta.ppf(q, a, b), rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# Keys in a fori_loop, dtypes


@pytest.mark.parametrize("name,config", [("flow_euler", {"stochastic_sampling": True, "shift": 3.0}), ("lcm", {})])
def test_fori_loop_with_keys(name, config):
    sched = scheduler_from_config({"_class_name": "DDPMScheduler", **SD}, name=name, **config)

    @eqx.filter_jit
    def sample(sched, state, x, key):
        def body(_, carry):
            x, state, key = carry
            key, sub = jax.random.split(key)
            x, state = sched.step(state, _fake_jax(x, sched.current_timestep(state)), x, key=sub)
            return x, state, key

        return jax.lax.fori_loop(0, sched.remaining_steps(state), body, (x, state, key))[0]

    state = sched.init(4, sample_shape=SHAPE)
    x = jnp.ones(SHAPE, jnp.bfloat16)
    a, b, c = (sample(sched, state, x, jax.random.key(k)) for k in (0, 0, 1))
    assert a.dtype == jnp.bfloat16 and bool(jnp.all(a == b)) and not bool(jnp.all(a == c))


# ---------------------------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("raw,match", [
    ({"_class_name": FLOW, "use_karras_sigmas": True, "use_beta_sigmas": True}, "use_karras_sigmas=True.*pick one"),
    ({"_class_name": FLOW, "time_shift_type": "cubic"}, "time_shift_type='cubic'"),
    ({"_class_name": FLOW, "shift_terminal": 1.5}, "shift_terminal=1.5"),
    ({"_class_name": UNIPC, "solver_order": 4}, "solver_order=4"),
    ({"_class_name": UNIPC, "solver_type": "bh3"}, "solver_type='bh3'"),
    ({"_class_name": UNIPC, "shift_terminal": 0.1}, "shift_terminal=0.1 needs use_flow_sigmas=True"),
    ({"_class_name": UNIPC, **WAN, "use_exponential_sigmas": True},
     "use_exponential_sigmas=True cannot be combined with use_flow_sigmas=True"),
    ({"_class_name": UNIPC, **WAN, "use_beta_sigmas": True}, "use_beta_sigmas=True cannot be combined"),
    ({"_class_name": UNIPC, "prediction_type": "flow_prediction", "predict_x0": False}, "needs predict_x0=True"),
    ({"_class_name": UNIPC, "disable_corrector": [1.5]}, "disable_corrector"),
    ({"_class_name": "DPMSolverMultistepScheduler", "prediction_type": "flow_prediction"},
     "prediction_type='flow_prediction' needs use_flow_sigmas=True"),
    ({"_class_name": "DPMSolverMultistepScheduler", **WAN, "use_karras_sigmas": True},
     "use_karras_sigmas=True cannot be combined with use_flow_sigmas=True"),
    ({"_class_name": "LCMScheduler", "original_inference_steps": 0}, "original_inference_steps=0"),
    ({"_class_name": "DDPMScheduler", "variance_type": "fixed_large_log"}, "variance_type='fixed_large_log'"),
])
def test_config_errors(raw, match):
    with pytest.raises(ConfigError, match=match):
        scheduler_from_config(raw)


def test_init_errors_name_the_argument():
    def build(class_name, **config):
        return scheduler_from_config({"_class_name": class_name, **config})

    with pytest.raises(ValueError, match="DDIMScheduler.init does not take sigmas=.*only the number of steps"):
        build("DDIMScheduler").init(10, sigmas=[1.0, 0.5])
    with pytest.raises(ValueError, match="LCMScheduler.init does not take mu=.*takes timesteps=, "
                                         "original_inference_steps="):
        build("LCMScheduler").init(4, mu=0.5)
    with pytest.raises(ValueError, match="needs mu= with use_dynamic_shifting=True.*dynamic_shift_mu"):
        build(FLOW, use_dynamic_shifting=True).init(10)
    with pytest.raises(ValueError, match="lengths disagree"):
        build(FLOW).init(4, sigmas=[1.0, 0.5])
    # one step from sigma 1 leaves nothing to stretch (diffusers divides by zero: NaN sigmas and timesteps)
    with pytest.raises(ValueError, match="shift_terminal=0.1 cannot stretch .* at least 2 steps"):
        build(FLOW, shift_terminal=0.1).init(1)
    with pytest.raises(ValueError, match="shift_terminal=0.1 cannot stretch"):
        build(UNIPC, **WAN, shift_terminal=0.1).init(1, sample_shape=SHAPE)
    with pytest.raises(ValueError, match="sigmas= cannot be used with use_karras_sigmas=True"):
        build(UNIPC, **WAN, use_karras_sigmas=True).init(sigmas=[1.0, 0.6, 0.2], sample_shape=SHAPE)
    with pytest.raises(ValueError, match="sigmas= needs use_flow_sigmas=True"):
        build(UNIPC).init(sigmas=[1.0, 0.5], sample_shape=SHAPE)
    with pytest.raises(ValueError, match="sample_shape="):
        build(UNIPC).init(10)
    with pytest.raises(ValueError, match="not both"):
        build("LCMScheduler").init(4, timesteps=[999, 499])
    with pytest.raises(ValueError, match="strictly descending"):
        build("LCMScheduler").init(timesteps=[499, 999])
    with pytest.raises(ValueError, match=r"num_inference_steps=60 must be in \[1, 50\]"):
        build("LCMScheduler").init(60)
    with pytest.raises(ValueError, match="must lie in"):
        build("TCDScheduler").init(timesteps=[1000, 500])
    with pytest.raises(ValueError, match="eta=1.5"):
        S.TCDScheduler(eta=1.5)
    with pytest.raises(ValueError, match="mu= needs use_dynamic_shifting=True and time_shift_type='exponential'"):
        build("DPMSolverMultistepScheduler").init(10, mu=0.7, sample_shape=SHAPE)
    with pytest.raises(ValueError, match="timesteps= cannot be used with use_karras_sigmas=True"):
        build("EulerDiscreteScheduler", use_karras_sigmas=True).init(timesteps=[999.0, 500.0])
    with pytest.raises(ValueError, match="pass num_inference_steps or timesteps=, not both"):
        build("DDPMScheduler").init(10, timesteps=[999, 500])
    with pytest.raises(ValueError, match="pass key= .* or noise="):
        sched = build("LCMScheduler")
        sched.step(sched.init(2), jnp.zeros(SHAPE), jnp.zeros(SHAPE))


# ---------------------------------------------------------------------------------------------------------------
# Convergence on a Gaussian target


MU, STD = 0.7, 0.3


def _flow_moments(sched, state):
    """Mean and variance of the samples of N(MU, STD^2) drawn along the exact velocity field of the flow
    ``x_s = (1 - s) x0 + s z`` (affine in the start, so three starts give the moments exactly)."""

    def velocity(x, s):
        var = (1 - s) ** 2 * STD**2 + s**2
        centered = x - (1 - s) * MU
        return s / var * centered - (MU + (1 - s) * STD**2 / var * centered)

    @eqx.filter_jit
    def run(sched, state, x):
        def body(_, carry):
            x, state = carry
            return sched.step(state, velocity(x, state.sigmas[state.step_index]), x)

        return jax.lax.fori_loop(0, sched.remaining_steps(state), body, (x, state))[0]

    s0 = state.sigmas[0]
    x = (1 - s0) * MU + jnp.sqrt((1 - s0) ** 2 * STD**2 + s0**2) * jnp.array([-1.0, 0.0, 1.0])
    out = run(sched, state, x)
    return float(out[1]), float(((out[2] - out[0]) / 2) ** 2)


@pytest.mark.parametrize("name,config,steps,max_ratio,final", [
    ("flow_euler", {}, (16, 32, 64), 0.6, 1e-2),  # first order: about half per doubling
    # UniPC-2 with its corrector: at least second order (the variance error changes sign near 16-32 steps, so
    # the asymptotic range starts later)
    ("unipc", dict(WAN, flow_shift=1.0), (64, 128), 0.3, 1e-4),
])
def test_flow_sampling_converges_on_gaussian_target(name, config, steps, max_ratio, final):
    sched = scheduler_from_config({"_class_name": FLOW}, name=name, **config)
    errors = []
    for n in steps:
        mean, var = _flow_moments(sched, sched.init(n, sample_shape=(3,)))
        errors.append(abs(mean - MU) + abs(var - STD**2))
    assert all(b < a for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < max_ratio * errors[-2] and errors[-1] < final, errors
    assert math.isfinite(errors[-1])
