"""Core v2: values are traced, shapes compile. After a pipeline's first call, a call that changes only values (guidance,
steps, strength, eta, hand-off fractions, ControlNet scales and intervals, custom schedules of any length, seeds,
prompts of the same token length, numeric scheduler options, Wan 2.2's expert boundary and low-noise guidance,
LTX-Video's decode timestep and noise scale, frame rate and condition strengths, FreeU's factors) compiles nothing.

Compiles are counted with JAX's own monitoring events (every backend compile, the small eager programs included), not
only ``pipe.timings``. Each sweep also checks that the value took effect (the output moved), so a value that was
silently dropped cannot pass. Numerical parity for such values is the parity tests' job (they run the same loop).
"""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxdiff
from eqxdiff import schedulers as S
from eqxdiff.core import FAMILY_TABLE, resolve_class
from eqxdiff.pipelines import DiffusionPipeline, denoise_loop
from eqxdiff.pipelines._denoise import Denoiser, Guidance

from . import _tiny_controlnet, _tiny_controlnet_union, _tiny_ltx, _tiny_sd, _tiny_sdxl, _tiny_wan
from . import _tiny_flux_pipeline as tiny_flux

_COMPILES = [0]


def _count(name, *_, **__):
    if name == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count)


@contextlib.contextmanager
def no_compile(what):
    """Fail if anything compiles inside (``what`` names the call)."""
    before = _COMPILES[0]
    yield
    assert _COMPILES[0] == before, f"{what} compiled {_COMPILES[0] - before} program(s)"


def sweep(pipe, base: dict, changes: list[dict]):
    """``pipe(**base)`` once (it may compile), then each change of values on top of ``base``: nothing compiles, and
    each output differs from the base output."""
    first = np.asarray(pipe(**base, progress=False))
    for change in changes:
        with no_compile(f"{type(pipe).__name__} with {change}"):
            out = np.asarray(pipe(**{**base, **change}, progress=False))
        assert pipe.timings["call_compile"] == 0.0
        assert out.shape == first.shape and not np.array_equal(out, first), f"{change} changed nothing"
    return first


# ----------------------------------------------------------------------------------------------------------------
# Every scheduler, through the pipelines' loop, with a cheap model


class _Fake(Denoiser):
    def __call__(self, x, t, cond, *, step):
        return 0.3 * x + 0.1 * jnp.sin(t.astype(jnp.float32) / 100.0) + cond["bias"]


SHAPE = (1, 4, 4, 2)
COND = {"bias": jnp.asarray([0.0, 0.05]).reshape(2, 1, 1, 1)}  # batched guidance: [negative; positive]


def _run(scheduler, *, steps=None, strength=None, guidance=Guidance(3.0), **schedule):
    state = scheduler.init(steps, sample_shape=SHAPE, strength=strength, **schedule)
    x = jnp.asarray(np.random.default_rng(0).standard_normal(SHAPE), jnp.float32)
    x = x * scheduler.init_noise_sigma(S.pad_schedule(state))
    return np.asarray(denoise_loop(_Fake(), scheduler, state, x, COND, jax.random.key(0), guidance=guidance))


def _max_steps(scheduler) -> int:
    if isinstance(scheduler, (S.UniPCMultistepScheduler, S.DPMSolverMultistepScheduler)):
        return scheduler.config.num_train_timesteps - 1  # 1000 linspace steps repeat a sigma: refused (diffusers: NaN)
    return getattr(scheduler.config, "original_inference_steps", scheduler.config.num_train_timesteps)


@pytest.mark.parametrize("name", sorted(S.SCHEDULER_CLASSES))
def test_every_scheduler_runs_any_step_count_and_start_in_one_program(name):
    scheduler = S.SCHEDULER_CLASSES[name]()
    has_eta = "eta" in {f.name for f in dataclasses.fields(scheduler)}
    if has_eta:  # the pipelines pass eta as an array
        scheduler = dataclasses.replace(scheduler, eta=jnp.asarray(0.0))
    fewest = 5 if name == "PNDMScheduler" else 1  # PNDM's Runge-Kutta warm-up needs 4 steps
    runs = [dict(steps=fewest), dict(steps=9), dict(steps=_max_steps(scheduler)), dict(steps=9, strength=0.5),
            dict(steps=9, guidance=Guidance(5.0)), dict(steps=9, guidance=Guidance(5.0, rescale=0.5))]
    if has_eta:
        runs.append(dict(steps=9, scheduler=dataclasses.replace(scheduler, eta=jnp.asarray(0.5))))
    if "timesteps" in scheduler.SCHEDULE_KEYWORDS:
        runs += [dict(timesteps=[901, 500, 1]), dict(timesteps=[999, 800, 600, 400, 200, 50])]
    if "sigmas" in scheduler.SCHEDULE_KEYWORDS and name != "UniPCMultistepScheduler":  # UniPC: flow sigmas only
        runs += [dict(sigmas=[1.0, 0.6, 0.3, 0.0]), dict(sigmas=[0.9, 0.5, 0.0])]
    seen = [_run(scheduler, steps=4)]
    for run in runs:
        run = dict(run)
        sched = run.pop("scheduler", scheduler)
        with no_compile(f"{name} {run}"):
            out = _run(sched, **run)
        assert np.all(np.isfinite(out))
        assert not any(np.array_equal(out, s) for s in seen), f"{name} {run} gave an earlier run's output"
        seen.append(out)


@pytest.mark.parametrize("name,options", [
    ("FlowMatchEulerDiscreteScheduler", [dict(shift=3.0), dict(shift=1.7, shift_terminal=0.1)]),
    ("UniPCMultistepScheduler", [dict(flow_shift=5.0), dict(flow_shift=3.0, use_karras_sigmas=True)]),
    ("EulerDiscreteScheduler", [dict(use_karras_sigmas=True, sigma_max=20.0), dict(use_karras_sigmas=True,
                                                                                   sigma_max=7.5, sigma_min=0.1)]),
    ("DPMSolverMultistepScheduler", [dict(use_karras_sigmas=True), dict(timestep_spacing="trailing")]),
])
def test_numeric_scheduler_options_share_the_loop(name, options):
    """Options that only shape the schedule (a flow shift, Karras sigma bounds, the spacing) are dropped from the
    scheduler the loop compiles (``stepper()``), so a new value compiles nothing and still takes effect."""
    base = dict(use_flow_sigmas=True, prediction_type="flow_prediction") if name.startswith("UniPC") else {}  # Wan's
    cls = S.SCHEDULER_CLASSES[name]
    first = _run(cls.from_config(base), steps=6)
    for option in options:
        with no_compile(f"{name} {option}"):
            out = _run(cls.from_config({**base, **option}), steps=6)
        assert not np.array_equal(out, first)


@pytest.mark.parametrize("name", ["DPMSolverMultistepScheduler", "UniPCMultistepScheduler"])
def test_trailing_overshoot_runs_in_the_same_program(name):
    """'trailing' spacing overshoots to timestep -1 at 61 steps (62 steps, as in diffusers, whose sigma
    interpolation clamps it): it runs in the loop program of any other step count."""
    scheduler = S.SCHEDULER_CLASSES[name].from_config({"timestep_spacing": "trailing"})
    first = _run(scheduler, steps=60)
    with no_compile(f"{name} trailing, 61 steps"):
        out = _run(scheduler, steps=61)
    assert np.all(np.isfinite(out)) and not np.array_equal(out, first)


def test_per_step_guidance_is_one_program_for_any_values():
    """A per-step scale (``[steps]``: Wan 2.2's guidance_scale_2) is a new shape once, then values only."""
    scheduler = S.EulerDiscreteScheduler()
    _run(scheduler, steps=4, guidance=Guidance(np.array([4.0, 4.0, 2.0, 2.0])))
    with no_compile("per-step guidance"):
        a = _run(scheduler, steps=6, guidance=Guidance(np.array([6.0, 6.0, 6.0, 1.5, 1.5, 1.5])))
        b = _run(scheduler, steps=6, guidance=Guidance(np.full(6, 6.0)))
    assert not np.array_equal(a, b)
    np.testing.assert_allclose(b, _run(scheduler, steps=6, guidance=Guidance(6.0)), rtol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# Every pipeline class served today


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sd")
    _tiny_sd.build_pipeline(folder, scheduler="ddim")
    return eqxdiff.load_pipeline(folder)


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sdxl")
    base = _tiny_sdxl.build_base(folder / "base")
    _tiny_sdxl.build_refiner(folder / "refiner", base)
    return eqxdiff.load_pipeline(folder / "base"), eqxdiff.load_pipeline(folder / "refiner")


def _flux_folder(tmp_path_factory, variant: str):
    """The tiny Flux folder of ``variant`` (tests/_tiny_flux_pipeline.py), loaded."""
    folder = tmp_path_factory.mktemp(f"flux_{variant}")
    tiny_flux.build(folder, variant)
    return eqxdiff.load_pipeline(folder)


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return _flux_folder(tmp_path_factory, "dev")


IMAGE = np.random.default_rng(0).integers(0, 256, (1, 32, 32, 3), dtype=np.uint8)
MASK = np.zeros((1, 32, 32, 1), np.uint8)
MASK[:, 8:24, 8:24] = 255
SD_BASE = dict(prompt="a red cat", negative_prompt="blurry", height=32, width=32, num_inference_steps=3,
               guidance_scale=5.0, seed=0)
STEPS = [dict(num_inference_steps=1), dict(num_inference_steps=7)]
IMAGE_STEPS = [dict(num_inference_steps=4), dict(num_inference_steps=7)]  # strength < 1 needs a step left
SEEDS = [dict(seed=1), dict(prompt="two green dogs")]  # any prompt: the character tokenizer pads to its length


def _sd(sd):
    sweep(sd, SD_BASE, [dict(guidance_scale=8.0), dict(guidance_rescale=0.5), dict(eta=0.7), *STEPS, *SEEDS])
    euler = sd.with_scheduler("euler")
    sweep(euler, SD_BASE, [dict(timesteps=[999, 700, 400, 100]), dict(sigmas=[14.0, 3.0, 0.5, 0.0]),
                           dict(sigmas=[9.0, 0.0])])
    karras = sd.with_scheduler("euler", use_karras_sigmas=True, sigma_max=10.0)
    with no_compile("Euler with Karras sigmas (a schedule-only option)"):
        karras(**SD_BASE, progress=False)
    # 3 steps: strength 0.6 runs the last step, 0.9 the last two, 1.0 all three
    sweep(sd, dict(SD_BASE, image=IMAGE, strength=0.6), [dict(strength=0.9), dict(strength=1.0), *IMAGE_STEPS])
    freeu = type(sd).from_pipe(sd)  # FreeU's values are conditioning arrays: new values compile nothing
    freeu.enable_freeu(0.9, 0.2, 1.2, 1.4)
    first = np.asarray(freeu(**SD_BASE, progress=False))
    freeu.enable_freeu(0.6, 0.4, 1.1, 1.6)
    with no_compile("enable_freeu with other values"):
        assert not np.array_equal(np.asarray(freeu(**SD_BASE, progress=False)), first)


def _sd_inpaint(sd):
    pipe = resolve_class("StableDiffusionInpaintPipeline").from_pipe(sd)
    sweep(pipe, dict(SD_BASE, image=IMAGE, mask_image=MASK, strength=0.7),
          [dict(strength=1.0), dict(strength=0.4), dict(guidance_scale=3.0), *IMAGE_STEPS])


def _sdxl(sdxl):
    base, _ = sdxl
    sweep(base, SD_BASE, [dict(guidance_scale=2.0), dict(guidance_rescale=0.3), *STEPS, *SEEDS])
    sweep(base, dict(SD_BASE, image=IMAGE, strength=0.5), [dict(strength=0.8)])


def _sdxl_handoff(sdxl):
    """The base stops at denoising_end (latents out), the refiner starts at denoising_start: both fractions move."""
    base, refiner = sdxl
    run = dict(SD_BASE, num_inference_steps=6)
    latents = base(**run, denoising_end=0.7, output_type="latent", progress=False)
    sweep(refiner, dict(run, image=latents, denoising_start=0.7), [dict(denoising_start=0.5),
                                                                   dict(denoising_start=0.85)])
    first = base(**run, denoising_end=0.7, output_type="latent", progress=False)
    with no_compile("the base with another denoising_end"):
        other = base(**run, denoising_end=0.4, output_type="latent", progress=False)
    assert not np.array_equal(np.asarray(first), np.asarray(other))


def _sdxl_inpaint(sdxl):
    pipe = resolve_class("StableDiffusionXLInpaintPipeline").from_pipe(sdxl[0])
    sweep(pipe, dict(SD_BASE, image=IMAGE, mask_image=MASK, strength=0.7), [dict(strength=0.4), *IMAGE_STEPS])


def _control(pipe, base, steps=STEPS):
    sweep(pipe, base, [dict(controlnet_conditioning_scale=0.4), dict(control_guidance_start=0.3),
                       dict(control_guidance_end=0.5), dict(guidance_scale=9.0), *steps])


@pytest.fixture(scope="module")
def sd_control(sd, tmp_path_factory):
    net = _tiny_controlnet.controlnet(_tiny_controlnet.SD_PIPE_CONTROLNET, seed=5)
    folder = tmp_path_factory.mktemp("controlnet")
    net.save_pretrained(folder, safe_serialization=True)
    return resolve_class("StableDiffusionControlNetPipeline").from_pipe(sd, controlnet=eqxdiff.load(folder))


CONTROL = _tiny_controlnet.control_images(1, 32, seed=3)


def _sd_controlnet(sd_control):
    _control(sd_control, dict(SD_BASE, image=CONTROL))


def _sd_controlnet_img2img(sd_control):
    pipe = resolve_class("StableDiffusionControlNetImg2ImgPipeline").from_pipe(sd_control)
    _control(pipe, dict(SD_BASE, image=IMAGE, control_image=CONTROL, strength=0.8), steps=IMAGE_STEPS)


def _sd_controlnet_inpaint(sd_control):
    pipe = resolve_class("StableDiffusionControlNetInpaintPipeline").from_pipe(sd_control)
    _control(pipe, dict(SD_BASE, image=IMAGE, mask_image=MASK, control_image=CONTROL, strength=0.7), steps=IMAGE_STEPS)


def _sdxl_control(sdxl, tmp_path_factory, name: str):
    net = _tiny_controlnet.controlnet(_tiny_controlnet.SDXL_PIPE_CONTROLNET, seed=6)
    folder = tmp_path_factory.mktemp("controlnet_xl")
    net.save_pretrained(folder, safe_serialization=True)
    return resolve_class(name).from_pipe(sdxl[0], controlnet=eqxdiff.load(folder))


def _sdxl_controlnet(sdxl, tmp_path_factory):
    _control(_sdxl_control(sdxl, tmp_path_factory, "StableDiffusionXLControlNetPipeline"), dict(SD_BASE, image=CONTROL))


def _sdxl_controlnet_img2img(sdxl, tmp_path_factory):
    pipe = _sdxl_control(sdxl, tmp_path_factory, "StableDiffusionXLControlNetImg2ImgPipeline")
    _control(pipe, dict(SD_BASE, image=IMAGE, control_image=CONTROL, strength=0.8), steps=IMAGE_STEPS)


def _sdxl_controlnet_inpaint(sdxl, tmp_path_factory):
    pipe = _sdxl_control(sdxl, tmp_path_factory, "StableDiffusionXLControlNetInpaintPipeline")
    _control(pipe, dict(SD_BASE, image=IMAGE, mask_image=MASK, control_image=CONTROL, strength=0.7), steps=IMAGE_STEPS)


def _sdxl_controlnet_union(sdxl, tmp_path_factory, name="StableDiffusionXLControlNetUnionPipeline", **images):
    folder = tmp_path_factory.mktemp("union")
    _tiny_controlnet_union.union_net(seed=7).save_pretrained(folder, safe_serialization=True)
    pipe = resolve_class(name).from_pipe(sdxl[0], controlnet=eqxdiff.load(folder))
    _control(pipe, dict(SD_BASE, control_image=CONTROL, control_mode=1, **images),
             steps=IMAGE_STEPS if images else STEPS)


def _sdxl_controlnet_union_img2img(sdxl, tmp_path_factory):
    _sdxl_controlnet_union(sdxl, tmp_path_factory, "StableDiffusionXLControlNetUnionImg2ImgPipeline", image=IMAGE,
                           strength=0.8)


def _sdxl_controlnet_union_inpaint(sdxl, tmp_path_factory):
    _sdxl_controlnet_union(sdxl, tmp_path_factory, "StableDiffusionXLControlNetUnionInpaintPipeline", image=IMAGE,
                           mask_image=MASK, strength=0.7)


FLUX_BASE = dict(prompt="a red cat", height=8, width=8, num_inference_steps=3, guidance_scale=3.5, seed=0,
                 max_sequence_length=12)


def _flux(flux):
    sweep(flux, FLUX_BASE, [dict(guidance_scale=5.0), *STEPS, dict(sigmas=[1.0, 0.5]),
                            dict(sigmas=[1.0, 0.8, 0.6, 0.4, 0.2]), *SEEDS])
    sweep(flux, dict(FLUX_BASE, negative_prompt="blurry", true_cfg_scale=2.0),
          [dict(true_cfg_scale=4.5), dict(guidance_scale=1.5)])


def _flux_img2img(flux):
    pipe = resolve_class("FluxImg2ImgPipeline").from_pipe(flux)
    image = IMAGE[:, :8, :8]
    # 3 steps: strength 0.9 starts at step 0, 0.6 at 1, 0.2 at 2
    sweep(pipe, dict(FLUX_BASE, image=image, strength=0.6), [dict(strength=0.9), dict(strength=0.2), *IMAGE_STEPS])


def _flux_kontext(flux):
    pipe = resolve_class("FluxKontextPipeline").from_pipe(flux)
    sweep(pipe, dict(FLUX_BASE, image=IMAGE[:, :8, :8], _auto_resize=False, max_area=64),
          [dict(guidance_scale=6.0), *STEPS, dict(seed=4)])


@pytest.fixture(scope="module")
def flux_control(tmp_path_factory):
    return _flux_folder(tmp_path_factory, "control")


def _flux_control(flux_control):
    control = IMAGE[:, :8, :8]
    sweep(flux_control, dict(FLUX_BASE, control_image=control),
          [dict(guidance_scale=6.0), *STEPS, dict(seed=4), dict(control_image=255 - control)])


def _flux_control_from_image(pipe, **extra):
    """Flux control image-to-image and inpainting: strength, guidance and the control image are values."""
    control = IMAGE[:, :8, :8]
    sweep(pipe, dict(FLUX_BASE, image=255 - control, control_image=control, strength=0.6, **extra),
          [dict(strength=0.9), dict(guidance_scale=6.0), dict(control_image=control[:, ::-1]), *IMAGE_STEPS])


def _flux_control_img2img(flux_control):
    _flux_control_from_image(resolve_class("FluxControlImg2ImgPipeline").from_pipe(flux_control))


def _flux_control_inpaint(flux_control):
    pipe = resolve_class("FluxControlInpaintPipeline").from_pipe(flux_control)
    _flux_control_from_image(pipe, mask_image=MASK[:, 8:16, 8:16])


def _flux_inpaint(flux):
    pipe = resolve_class("FluxInpaintPipeline").from_pipe(flux)
    sweep(pipe, dict(FLUX_BASE, image=IMAGE[:, :8, :8], mask_image=MASK[:, 8:16, 8:16], strength=0.6),
          [dict(strength=0.9), dict(strength=1.0), dict(guidance_scale=6.0), *IMAGE_STEPS])


@pytest.fixture(scope="module")
def flux_fill(tmp_path_factory):
    return _flux_folder(tmp_path_factory, "fill")


def _flux_fill(flux_fill):
    mask = MASK[:, 4:20, 4:20]  # the fill folder's VAE halves: 16 pixels make 8x8 latents, as the dev folder's 8
    sweep(flux_fill, dict(FLUX_BASE, image=IMAGE[:, :16, :16], mask_image=mask, height=16, width=16),
          [dict(guidance_scale=6.0), dict(strength=0.6), *STEPS, dict(seed=4), dict(mask_image=255 - mask)])


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan")
    _tiny_wan.build_a14b(folder)  # two experts, boundary 0.875
    return eqxdiff.load_pipeline(folder)


@pytest.fixture(scope="module")
def wan_ti2v(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan_ti2v")
    _tiny_wan.build_ti2v(folder)
    return resolve_class("WanImageToVideoPipeline").from_pretrained(folder)  # a text-to-video folder, as TI2V-5B's


WAN_BASE = dict(prompt="a red cat", negative_prompt="blurry", height=32, width=32, num_frames=9, num_inference_steps=3,
                guidance_scale=4.0, seed=0, max_sequence_length=16)


def _wan(wan):
    """Wan 2.2 A14B: the experts' boundary, the low-noise guidance and the steps are values of one loop."""
    sweep(wan, WAN_BASE, [dict(guidance_scale=6.0), dict(guidance_scale_2=2.0), dict(boundary_ratio=0.5),
                          dict(boundary_ratio=0.95, guidance_scale_2=1.5), *STEPS, dict(seed=2)])


def _wan_i2v(wan_ti2v):
    image = IMAGE[0]
    sweep(wan_ti2v, dict(WAN_BASE, image=image), [dict(guidance_scale=2.0), *STEPS, dict(image=255 - image)])


def _wan_v2v(wan):
    """Video-to-video (the A14B folder run as one: both experts): the strength, the guidance, the steps and the video
    are values."""
    video = np.repeat(IMAGE, 9, axis=0)  # 9 frames
    pipe = resolve_class("WanVideoToVideoPipeline").from_pipe(wan)
    base = {k: v for k, v in WAN_BASE.items() if k != "num_frames"}  # the video's
    sweep(pipe, dict(base, video=video, strength=0.7), [dict(strength=1.0), dict(guidance_scale=6.0),
                                                      *IMAGE_STEPS, dict(video=255 - video)])


@pytest.fixture(scope="module")
def ltx(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ltx")
    _tiny_ltx.build_pipeline(folder)  # the 0.9.5 VAE: decode_timestep and decode_noise_scale are decoder inputs
    return eqxdiff.load_pipeline(folder)


LTX_BASE = dict(prompt="a red cat", negative_prompt="blurry", height=32, width=32, num_frames=9, num_inference_steps=3,
                guidance_scale=3.0, seed=0, max_sequence_length=16, decode_timestep=0.05)
LTX_VALUES = [dict(guidance_scale=5.0), dict(guidance_rescale=0.5), dict(decode_timestep=0.2),
              dict(decode_noise_scale=0.3), dict(frame_rate=12), *STEPS, dict(seed=2)]


def _ltx(ltx):
    """LTX-Video: the guidance, the decoder's timestep and noise scale, the frame rate (the rotary positions) and the
    steps are values."""
    sweep(ltx, LTX_BASE, [*LTX_VALUES, dict(timesteps=[1000.0, 600.0, 100.0])])


def _ltx_i2v(ltx):
    image = IMAGE[0]
    pipe = resolve_class("LTXImageToVideoPipeline").from_pipe(ltx)
    sweep(pipe, dict(LTX_BASE, image=image), [*LTX_VALUES, dict(image=255 - image)])


def _ltx_condition(ltx):
    """Conditions' pictures and strengths, the re-noising scale and the schedule's length are values."""
    image = IMAGE[0]
    pipe = resolve_class("LTXConditionPipeline").from_pipe(ltx)
    sweep(pipe, dict(LTX_BASE, image=[image, 255 - image], frame_index=[0, 8], strength=[1.0, 0.8]),
          [dict(guidance_scale=5.0), dict(decode_timestep=0.2), dict(strength=[0.7, 0.5]),
           dict(image_cond_noise_scale=0.5), dict(image=[255 - image, image]), *STEPS])


@pytest.fixture(scope="module")
def ltx_upsample(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ltx_upsample")
    _tiny_ltx.build_upsampler(folder, _tiny_ltx.vae())
    return eqxdiff.load_pipeline(folder)


def _ltx_upsample(ltx_upsample):
    """The upsampler's AdaIN and tone-mapping factors and the decode values are values."""
    latents = np.random.default_rng(0).standard_normal((1, 2, 2, 2, 8)).astype(np.float32)
    sweep(ltx_upsample, dict(latents=latents, decode_timestep=0.05, seed=0),
          [dict(adain_factor=1.0), dict(tone_map_compression_ratio=0.5), dict(decode_timestep=0.2),
           dict(decode_noise_scale=0.3), dict(seed=2), dict(latents=-latents)])


SWEEPS = {
    "StableDiffusionPipeline": (_sd, "sd"),
    "StableDiffusionInpaintPipeline": (_sd_inpaint, "sd"),
    "StableDiffusionXLPipeline": (_sdxl, "sdxl"),
    "StableDiffusionXLImg2ImgPipeline": (_sdxl_handoff, "sdxl"),
    "StableDiffusionXLInpaintPipeline": (_sdxl_inpaint, "sdxl"),
    "StableDiffusionControlNetPipeline": (_sd_controlnet, "sd_control"),
    "StableDiffusionControlNetImg2ImgPipeline": (_sd_controlnet_img2img, "sd_control"),
    "StableDiffusionControlNetInpaintPipeline": (_sd_controlnet_inpaint, "sd_control"),
    "StableDiffusionXLControlNetPipeline": (_sdxl_controlnet, "sdxl", "tmp_path_factory"),
    "StableDiffusionXLControlNetImg2ImgPipeline": (_sdxl_controlnet_img2img, "sdxl", "tmp_path_factory"),
    "StableDiffusionXLControlNetInpaintPipeline": (_sdxl_controlnet_inpaint, "sdxl", "tmp_path_factory"),
    "StableDiffusionXLControlNetUnionPipeline": (_sdxl_controlnet_union, "sdxl", "tmp_path_factory"),
    "StableDiffusionXLControlNetUnionImg2ImgPipeline": (_sdxl_controlnet_union_img2img, "sdxl", "tmp_path_factory"),
    "StableDiffusionXLControlNetUnionInpaintPipeline": (_sdxl_controlnet_union_inpaint, "sdxl", "tmp_path_factory"),
    "FluxPipeline": (_flux, "flux"),
    "FluxImg2ImgPipeline": (_flux_img2img, "flux"),
    "FluxKontextPipeline": (_flux_kontext, "flux"),
    "FluxControlPipeline": (_flux_control, "flux_control"),
    "FluxControlImg2ImgPipeline": (_flux_control_img2img, "flux_control"),
    "FluxControlInpaintPipeline": (_flux_control_inpaint, "flux_control"),
    "FluxInpaintPipeline": (_flux_inpaint, "flux"),
    "FluxFillPipeline": (_flux_fill, "flux_fill"),
    "WanPipeline": (_wan, "wan"),
    "WanImageToVideoPipeline": (_wan_i2v, "wan_ti2v"),
    "WanVideoToVideoPipeline": (_wan_v2v, "wan"),
    "LTXPipeline": (_ltx, "ltx"),
    "LTXImageToVideoPipeline": (_ltx_i2v, "ltx"),
    "LTXConditionPipeline": (_ltx_condition, "ltx"),
    "LTXLatentUpsamplePipeline": (_ltx_upsample, "ltx_upsample"),
}


def _served_pipeline_classes() -> list[str]:
    classes = {resolve_class(name) for name in FAMILY_TABLE}
    return sorted(c.__name__ for c in classes if isinstance(c, type) and issubclass(c, DiffusionPipeline))


def test_every_served_pipeline_class_has_a_sweep():
    assert sorted(SWEEPS) == _served_pipeline_classes()


@pytest.mark.parametrize("name", sorted(SWEEPS))
def test_values_compile_nothing_after_the_first_call(name, request):
    run, *fixtures = SWEEPS[name]
    run(*(request.getfixturevalue(f) for f in fixtures))


def test_stepper_drops_only_schedule_fields():
    """Schedulers differing only in schedule-only fields share one loop program (equal, hashable steppers)."""
    a = S.FlowMatchEulerDiscreteScheduler.from_config({"shift": 3.0, "use_dynamic_shifting": True})
    b = S.FlowMatchEulerDiscreteScheduler.from_config({"shift": 1.0, "stochastic_sampling": False})
    assert a.stepper() == b.stepper() and hash(a.stepper().config) == hash(b.stepper().config)
    c = S.FlowMatchEulerDiscreteScheduler.from_config({"stochastic_sampling": True})
    assert c.stepper() != a.stepper()  # a field step reads is kept
    d = S.DDIMScheduler.from_config({"clip_sample": False, "timestep_spacing": "trailing"})
    assert d.stepper().config.clip_sample is False and d.stepper().config.timestep_spacing == "leading"
