"""End to end: eqxdiff's Stable Diffusion pipeline against diffusers', pixel for pixel (<= 2/255)."""

import inspect
import json
import re
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eqxdiff
from eqxdiff.cli import generate
from eqxdiff.core import ConfigError, family_names, resolve_class
from eqxdiff.pipelines import (
    DiffusionPipeline,
    InputError,
    StableDiffusionPipeline,
    checked_call,
    read_parameters,
    save_images,
    save_pipeline,
    save_single_file,
)
from eqxdiff.pipelines import stable_diffusion as sd
from eqxdiff.pipelines._call import NOT_TAKEN, call_argument_names, is_checked
from eqxdiff.pipelines._diffusers_api import NOT_OFFERED, UnsupportedPipelineAttribute
from eqxdiff.pipelines.flux import FluxPipeline

from ._tiny_sd import build_pipeline
from ._util import (
    assert_close,
    assert_close_to_float64,
    nhwc_to_nchw,
    rel_error,
    run_float64,
)

PROMPTS = ["a red cat", "two dogs"]


def _reference_images(pipe, latents, **kwargs):
    with torch.no_grad():
        out = pipe(PROMPTS, latents=nhwc_to_nchw(latents), output_type="np", height=32, width=32, **kwargs).images
    return np.asarray(out)


def _max_pixel_diff(ours_uint8, ref_float):
    return int(np.max(np.abs(ours_uint8.astype(int) - (ref_float * 255).round().astype(int))))


@pytest.mark.parametrize("scheduler,prediction,sd2,kwargs", [
    ("pndm", "epsilon", False, dict(num_inference_steps=4, guidance_scale=7.5)),
    ("ddim", "v_prediction", True, dict(num_inference_steps=3, guidance_scale=5.0, guidance_rescale=0.7,
                                        negative_prompt=["blurry", "ugly"], freeu=(0.9, 0.2, 1.2, 1.4))),
    # VAE latent statistics (shift_factor, latents_mean / latents_std), which diffusers' SD pipeline does not read
    ("euler", "epsilon", False, dict(num_inference_steps=3, guidance_scale=1.0, vae_stats=True)),
])
def test_text_to_image_matches_diffusers(tmp_path, scheduler, prediction, sd2, kwargs):
    kwargs = dict(kwargs)
    ref = build_pipeline(tmp_path, scheduler=scheduler, prediction_type=prediction, sd2=sd2,
                         vae_stats=kwargs.pop("vae_stats", False))
    pipe = eqxdiff.load_pipeline(tmp_path)
    if "freeu" in kwargs:  # FreeU on both (diffusers' enable_freeu)
        ref.enable_freeu(*kwargs["freeu"])
        pipe.enable_freeu(*kwargs.pop("freeu"))
    latents = np.random.default_rng(0).standard_normal((2, 16, 16, 4)).astype(np.float32)
    expected = _reference_images(ref, latents, **kwargs)
    negative_prompt = kwargs.pop("negative_prompt", None)
    ours = pipe(PROMPTS, negative_prompt, latents=latents, height=32, width=32, progress=False, **kwargs)
    assert ours.dtype == np.uint8 and ours.shape == (2, 32, 32, 3)
    assert _max_pixel_diff(ours, expected) <= 2
    assert np.std(ours) > 1  # a real image, not a constant
    # diffusers' other output types from the same loop: "np" the float32 pixels in [0, 1] before quantisation (as
    # diffusers' to float32 precision, not 1/255), "pil" the uint8 pixels as a list of PIL images
    floats = pipe(PROMPTS, negative_prompt, latents=latents, height=32, width=32, output_type="np", progress=False,
                  **kwargs)
    assert floats.dtype == np.float32 and floats.shape == expected.shape
    assert pipe.timings["denoise_compile"] == 0.0  # the same loop program; only the post-processing is new
    assert_close(floats, expected, 2e-5, "output_type='np' vs diffusers'")  # measured <= 5e-6; 1/510 if quantised
    assert np.array_equal((floats * 255).round().astype(np.uint8), ours)  # the uint8 output quantises these
    pil = pipe(PROMPTS, negative_prompt, latents=latents, height=32, width=32, output_type="pil", progress=False,
               **kwargs)
    assert isinstance(pil, list) and [(im.mode, im.size) for im in pil] == [("RGB", (32, 32))] * 2
    assert np.array_equal(np.stack([np.asarray(im) for im in pil]), ours)

    # diffusers' own text embeddings (and its negative ones under guidance) given instead of the prompts: the same
    # images from the same compiled loop
    with torch.no_grad():
        embeds, negative = ref.encode_prompt(PROMPTS, "cpu", 1, kwargs["guidance_scale"] > 1, negative_prompt)
    assert (negative is None) == (kwargs["guidance_scale"] <= 1)
    given = pipe(prompt_embeds=embeds.numpy(), negative_prompt_embeds=None if negative is None else negative.numpy(),
                 latents=latents, height=32, width=32, progress=False, **kwargs)
    assert _max_pixel_diff(given, expected) <= 2


def test_image_to_image_matches_diffusers(tmp_path, monkeypatch):
    from diffusers.pipelines.stable_diffusion import (
        pipeline_stable_diffusion_img2img as img2img_module,
    )

    ref = build_pipeline(tmp_path, scheduler="ddim")
    ref_img2img = img2img_module.StableDiffusionImg2ImgPipeline(**ref.components)
    ref_img2img.set_progress_bar_config(disable=True)
    rng = np.random.default_rng(1)
    image = rng.integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    posterior_noise = rng.standard_normal((2, 16, 16, 4)).astype(np.float32)
    noise = rng.standard_normal((2, 16, 16, 4)).astype(np.float32)
    draws = iter([posterior_noise, noise])
    monkeypatch.setattr(img2img_module, "randn_tensor", lambda *a, **k: nhwc_to_nchw(next(draws)))
    monkeypatch.setattr(img2img_module, "retrieve_latents",
                        lambda out, generator=None, sample_mode="sample": out.latent_dist.mean
                        + out.latent_dist.std * nhwc_to_nchw(next(draws)))
    with torch.no_grad():
        expected = ref_img2img(PROMPTS, image=torch.from_numpy(image).permute(0, 3, 1, 2).float() / 255,
                               strength=0.6, num_inference_steps=5, guidance_scale=6.0, output_type="np").images

    pipe = eqxdiff.load_pipeline(tmp_path)
    state = pipe.scheduler.init(5, sample_shape=(2, 16, 16, 4), strength=0.6)
    embeds = pipe.embed(PROMPTS, ["", ""], guidance=sd.Guidance(6.0))
    clean = sd.encode_image_latents(pipe.vae, sd.to_model_range(image), jnp.asarray(posterior_noise))
    x = pipe.scheduler.add_noise_at_step(state, clean, jnp.asarray(noise))
    x = sd.denoise(pipe.unet, pipe.scheduler, state, x, embeds, jax.random.key(0), guidance=sd.Guidance(6.0))
    ours = sd.to_uint8(sd.decode_latents(pipe.vae, x))
    assert _max_pixel_diff(ours, expected) <= 2

    # the pipeline call runs the same steps, drawing its noise from the key
    out = pipe(PROMPTS, image=image, strength=0.6, num_inference_steps=5, guidance_scale=6.0, seed=3,
               progress=False)
    assert out.shape == (2, 32, 32, 3) and out.dtype == np.uint8


def test_pipeline_options_and_errors(tmp_path):
    build_pipeline(tmp_path)
    pipe = eqxdiff.load_pipeline(tmp_path, scheduler="euler")
    assert type(pipe.scheduler).__name__.lower().startswith("euler")
    a = pipe("a cat", num_images_per_prompt=3, num_inference_steps=2, seed=1, height=32, width=48, progress=False)
    first = dict(pipe.timings)
    b = pipe("a cat", num_images_per_prompt=3, num_inference_steps=2, seed=1, height=32, width=48, progress=False)
    # each stage's wall time and the compile time within it; the second call reuses every compiled program
    stages = ("call", "encode", "prepare", "denoise", "decode")
    assert set(first) == set(pipe.timings) == {*stages, *(f"{s}_compile" for s in stages)}
    assert all(0 <= first[f"{s}_compile"] <= first[s] for s in stages)
    assert first["denoise_compile"] > 0 and first["call_compile"] >= first["denoise_compile"]
    assert pipe.timings["call_compile"] == pipe.timings["denoise_compile"] == 0.0
    assert pipe.timings["call"] >= pipe.timings["denoise"] + pipe.timings["decode"]
    assert a.shape == (3, 32, 48, 3)
    np.testing.assert_array_equal(a, b)  # a seed reproduces
    assert not np.array_equal(a[0], a[1])  # images per prompt differ
    with pytest.raises(ValueError, match="height=31 must be a multiple of 2"):
        pipe("a cat", height=31, width=32)
    with pytest.raises(ValueError, match=r"latents must have shape \(1, 16, 16, 4\)"):
        pipe("a cat", latents=np.zeros((1, 4, 16, 16), np.float32), height=32, width=32)
    with pytest.raises(ValueError, match="strength must be in"):
        pipe("a cat", image=np.zeros((1, 32, 32, 3), np.uint8), strength=0.0)
    with pytest.raises(ValueError, match="negative_prompt has 2 entries"):
        pipe("a cat", ["x", "y"])
    with pytest.raises(ValueError, match=r"unknown scheduler name 'nope'; choose one of \[.*'euler'"):
        eqxdiff.load_pipeline(tmp_path, scheduler="nope")


def test_clip_skip_takes_an_earlier_layer_through_the_final_norm(tmp_path):
    ref = build_pipeline(tmp_path)
    pipe = eqxdiff.load_pipeline(tmp_path, attention="xla")
    ids = sd.tokenize(pipe.tokenizer, PROMPTS)
    with torch.no_grad():
        out = ref.text_encoder(torch.from_numpy(ids).long(), output_hidden_states=True)
        norm = getattr(ref.text_encoder, "text_model", ref.text_encoder).final_layer_norm
        expected = norm(out.hidden_states[-2]).numpy()
    ours = sd.encode_prompt(pipe.text_encoder, jnp.asarray(ids), clip_skip=1)
    assert_close(ours, expected, 1e-4)
    assert rel_error(ours, sd.encode_prompt(pipe.text_encoder, jnp.asarray(ids))) > 1e-2

    # diffusers' encode_prompt applies clip_skip to the prompts only: its negative prompts (given or the empty
    # default) take the last hidden state (eqxdiff once skipped layers for both). transformers 5's CLIPTextModel has no
    # text_model, which diffusers' clip_skip path reads: the model itself holds final_layer_norm.
    if not hasattr(ref.text_encoder, "text_model"):
        object.__setattr__(ref.text_encoder, "text_model", ref.text_encoder)
    for negative in (["blurry", "ugly"], None):
        with torch.no_grad():
            embeds, negative_embeds = ref.encode_prompt(PROMPTS, "cpu", 1, True, negative, clip_skip=1)
        ours = pipe._embeddings(PROMPTS, negative, None, None, sd.Guidance(7.5), 1)
        assert_close(ours, torch.cat([negative_embeds, embeds]).numpy(), 1e-4, f"negative_prompt={negative}")
    ours = pipe._embeddings(None, ["blurry", "ugly"], embeds.numpy(), None, sd.Guidance(7.5), 1)
    with torch.no_grad():
        _, negative_embeds = ref.encode_prompt(PROMPTS, "cpu", 1, True, ["blurry", "ugly"], clip_skip=1)
    assert_close(ours[:2], negative_embeds.numpy(), 1e-4, "negative of given prompt_embeds")

    # a text encoder whose config.json says use_attention_mask=true: diffusers passes the tokenizer's mask (padding
    # masked), eqxdiff once dropped the key and encoded without it
    config_path = tmp_path / "text_encoder" / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "use_attention_mask": True}))
    ref.text_encoder.config.use_attention_mask = True
    masked = eqxdiff.load_pipeline(tmp_path, attention="xla")
    assert masked.text_encoder.config.use_attention_mask
    with torch.no_grad():
        embeds, negative_embeds = ref.encode_prompt(PROMPTS, "cpu", 1, True, None, clip_skip=1)
    ours = masked._embeddings(PROMPTS, None, None, None, sd.Guidance(7.5), 1)
    assert_close(ours, torch.cat([negative_embeds, embeds]).numpy(), 1e-4, "use_attention_mask")


def test_load_pipeline_errors(tmp_path):
    build_pipeline(tmp_path / "ok")
    index = json.loads((tmp_path / "ok" / "model_index.json").read_text())
    bad = dict(index, _class_name="FancyPipeline")
    (tmp_path / "ok" / "model_index.json").write_text(json.dumps(bad))
    with pytest.raises(eqxdiff.CheckpointError, match="unknown pipeline class 'FancyPipeline'"):
        eqxdiff.load_pipeline(tmp_path / "ok")
    with pytest.raises(eqxdiff.CheckpointError, match="model_index.json not found"):
        eqxdiff.load_pipeline(tmp_path)
    # a T5 as SD's text encoder: refused before anything loads, naming the component, the class and the choices
    t5 = dict(index, text_encoder=["transformers", "T5EncoderModel"])
    (tmp_path / "ok" / "model_index.json").write_text(json.dumps(t5))
    with pytest.raises(eqxdiff.CheckpointError, match=r"gives component 'text_encoder' the class 'T5EncoderModel', "
                                                      r"but a StableDiffusionPipeline runs CLIPTextModel as its"):
        eqxdiff.load_pipeline(tmp_path / "ok")
    with pytest.raises(eqxdiff.CheckpointError, match="component 'unet' the class 'FluxTransformer2DModel'"):
        StableDiffusionPipeline.check_component_class(
            next(c for c in StableDiffusionPipeline.COMPONENTS if c.name == "unet"),
            ["diffusers", "FluxTransformer2DModel"], "a folder")


@pytest.mark.parametrize("component,key,value", [("unet", "sample_size", "16"),
                                                  ("vae", "block_out_channels", "16"),
                                                  ("vae", "block_out_channels", [16, "32"])])
def test_wrong_typed_config_values_name_the_file_and_the_key(tmp_path_factory, tmp_path, component, key, value):
    """A config value of the wrong type in a copied tiny folder: eqxdiff-generate's checks before loading (the
    pipelines' folder_limits, read through the config classes) and eqxdiff.load both raise ConfigError naming the
    file and the key (the value reached _warn_if_large raw and crashed there with a TypeError)."""
    tiny = tmp_path_factory.getbasetemp() / "tiny_sd_configs"
    if not tiny.exists():
        build_pipeline(tiny)
    folder = tmp_path / "copy"
    shutil.copytree(tiny, folder)
    path = folder / component / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))

    def read(name):
        return json.loads((folder / name).read_text()) if (folder / name).is_file() else None

    bad = re.escape(f"{key}={tuple(value) if isinstance(value, list) else value!r} has the wrong type")
    for cls in (StableDiffusionPipeline, FluxPipeline) if component == "vae" else (StableDiffusionPipeline,):
        with pytest.raises(ConfigError, match=rf"^{component}/config.json: .*{bad}"):
            cls.folder_limits(read)
    with pytest.raises(ConfigError, match=rf"{component}/config.json: .*{bad}"):
        generate.validate(["--model", str(folder), "--prompt", "a cat", "--height", "32", "--width", "32"])
    with pytest.raises(ConfigError, match=rf"config.json in {re.escape(repr(str(folder / component)))}: .*{bad}"):
        eqxdiff.load(folder, component)


def test_config_overrides_reach_each_model_from_a_folder_and_a_single_file(tmp_path):
    """load_pipeline's config_overrides set config keys per model, from a folder and from a single file (whose
    tensors are checked against the file's own configs); what is not a model, or not a setting, is named."""
    build_pipeline(tmp_path / "sd")
    overrides = {"text_encoder": {"hidden_act": "gelu"}, "vae": {"scaling_factor": 0.5}}
    file = save_single_file(eqxdiff.load_pipeline(tmp_path / "sd"), tmp_path / "sd.safetensors")
    for pipe in (eqxdiff.load_pipeline(tmp_path / "sd", config_overrides=overrides),
                 eqxdiff.load_pipeline(file, config=tmp_path / "sd", config_overrides=overrides)):
        assert pipe.text_encoder.config.hidden_act == "gelu" and pipe.vae.config.scaling_factor == 0.5
        assert pipe.unet.config == eqxdiff.load(tmp_path / "sd", "unet").config
    for path, kwargs in ((tmp_path / "sd", {}), (file, {"config": tmp_path / "sd"})):
        with pytest.raises(ConfigError, match=r"config_overrides names \['scheduler'\], not models of a "
                                              r"StableDiffusionPipeline: its models are \['text_encoder', 'unet', "
                                              r"'vae'\] \(the scheduler's keys go in scheduler_options\)"):
            eqxdiff.load_pipeline(path, config_overrides={"scheduler": {"steps_offset": 0}}, **kwargs)
        with pytest.raises(ConfigError, match=r"config_overrides \['act'\] are not settings of a CLIPTextConfig"):
            eqxdiff.load_pipeline(path, config_overrides={"text_encoder": {"act": "gelu"}}, **kwargs)


def test_every_pipeline_names_the_classes_of_its_models():
    """Every served pipeline says which checkpoint classes each of its models may be, and each is one the family
    table serves (a ControlNet pipeline's nets: its net class, or its multi-net wrapper)."""
    models = set(family_names("model"))
    for name in family_names("pipeline"):
        cls = resolve_class(name)
        for c in cls.COMPONENTS:
            if c.kind != "model":
                assert not cls.component_classes(c), (name, c.name)
                continue
            accepted = cls.component_classes(c)
            assert accepted, f"{name}.{c.name} names no class"
            wrappers = {getattr(cls, "MULTI_CLASS", type).__name__}
            assert set(accepted) <= models | wrappers, (name, c.name, accepted)


def test_every_served_pipeline_checks_and_times_its_call():
    """Every served pipeline's ``__call__`` carries ``@checked_call`` (arguments checked before anything compiles,
    the call's timings), inherited or its own; a family whose ``__call__`` lacks it is refused at its definition."""
    for name in family_names("pipeline"):
        assert is_checked(resolve_class(name).__call__), name
    with pytest.raises(TypeError, match=r"Forgetful.__call__ must be decorated with @checked_call \(from "
                                        r"eqxdiff.pipelines\)"):
        class Forgetful(StableDiffusionPipeline):
            def __call__(self, prompt=None):
                return prompt

    class Remembers(StableDiffusionPipeline):
        @checked_call
        def __call__(self, prompt=None):
            return prompt

    assert is_checked(Remembers.__call__)


def test_every_diffusers_call_argument_is_taken_or_says_what_to_do_instead():
    """Each served pipeline class takes the call arguments of its diffusers namesake (the LoRA-scale argument too,
    in its signature), but those it leaves out by design (``generator``, ``return_dict``, callbacks, IP-Adapter
    images ...), whose unexpected-keyword error says what to do instead (``_call.NOT_TAKEN``)."""
    import diffusers

    for name in family_names("pipeline"):
        theirs = inspect.signature(getattr(diffusers, name).__call__).parameters
        left = set(theirs) - {"self", "kwargs"} - call_argument_names(resolve_class(name))
        assert left <= set(NOT_TAKEN), (name, sorted(left - set(NOT_TAKEN)))
        lora = resolve_class(name).LORA_SCALE_ARGUMENT
        assert lora is None or lora in inspect.signature(resolve_class(name).__call__).parameters, name


def test_every_diffusers_pipeline_attribute_is_there_or_says_what_to_do_instead():
    """Each public method and attribute of a served class's diffusers namesake is the eqxdiff class's too, or in
    ``_diffusers_api.NOT_OFFERED``, whose entry an instance's lookup raises (an ``AttributeError``, so ``hasattr`` is
    False) with what to do instead; every entry is a name some namesake has. Other names fail as Python's own."""
    import diffusers

    theirs = set()
    for name in family_names("pipeline"):
        public = {a for a in dir(getattr(diffusers, name)) if not a.startswith("_")}
        theirs |= public
        left = {a for a in public if not hasattr(resolve_class(name), a)}
        assert left <= set(NOT_OFFERED), (name, sorted(left - set(NOT_OFFERED)))
    assert set(NOT_OFFERED) <= theirs, sorted(set(NOT_OFFERED) - theirs)
    pipe = object.__new__(StableDiffusionPipeline)  # (the lookup reads nothing of the instance)
    with pytest.raises(UnsupportedPipelineAttribute, match=r"StableDiffusionPipeline has no 'enable_model_cpu_offload' "
                                                           r"\(a diffusers pipeline's\): pass offload_encoders=True"):
        pipe.enable_model_cpu_offload()
    with pytest.raises(AttributeError, match=r"load_pipeline\(\.\.\., attention='chunked'\)"):
        pipe.enable_xformers_memory_efficient_attention()
    assert not hasattr(pipe, "to") and not hasattr(pipe, "no_such_thing")
    with pytest.raises(AttributeError, match="^'StableDiffusionPipeline' object has no attribute 'no_such_thing'$"):
        pipe.no_such_thing
    with pytest.raises(UnsupportedPipelineAttribute, match=r"^FluxPipeline has no 'from_config' \(a diffusers "
                                                           r"pipeline's\): "):
        FluxPipeline.from_config  # a class-level lookup says it too
    with pytest.raises(AttributeError, match="^type object 'FluxPipeline' has no attribute 'no_such_thing'$"):
        FluxPipeline.no_such_thing


def test_set_progress_bar_config_sets_the_calls_progress_default(tmp_path, monkeypatch):
    """``set_progress_bar_config(disable=True)`` (diffusers' call) turns the calls' progress bar off by default, is
    carried by ``from_pipe`` and is not saved; a pipeline still copies, deep-copies and pickles (the mixin's
    ``__getattr__`` leaves the dunder look-ups alone)."""
    import copy
    import pickle

    from eqxdiff.pipelines import _latents

    build_pipeline(tmp_path / "a")
    pipe = eqxdiff.load_pipeline(tmp_path / "a")
    pipe.set_progress_bar_config(disable=True)
    assert pipe.call_defaults == {"progress": False}
    assert type(pipe).from_pipe(pipe).call_defaults == {"progress": False}
    bars = []

    def progress_bar(*args, enabled=True):  # records what the call asks for, then stops it before the loop compiles
        bars.append(enabled)
        raise KeyboardInterrupt

    monkeypatch.setattr(_latents, "progress_bar", progress_bar)
    for progress in ({}, {"progress": True}):
        with pytest.raises(KeyboardInterrupt):
            pipe("a cat", num_inference_steps=1, height=32, width=32, **progress)
    assert bars == [False, True]
    pipe.set_progress_bar_config(disable=False)
    assert pipe.call_defaults == {"progress": True}
    save_pipeline(pipe, tmp_path / "b")
    assert "_eqxdiff" not in json.loads((tmp_path / "b" / "model_index.json").read_text())
    with pytest.raises(TypeError, match=r"takes only disable= .* not \['leave'\]"):
        pipe.set_progress_bar_config(leave=False)
    for again in (copy.copy(pipe), copy.deepcopy(pipe), pickle.loads(pickle.dumps(pipe))):
        assert type(again) is type(pipe) and again.call_defaults == pipe.call_defaults
        assert not hasattr(again, "to")


def test_from_single_file_loads_a_file_as_its_class(tmp_path):
    """``Cls.from_single_file(file, config=folder)`` (diffusers' name) is ``load_pipeline(file, config=folder,
    pipeline_class=Cls)``; a folder is refused, pointing to ``from_pretrained``."""
    import equinox as eqx

    img2img = resolve_class("StableDiffusionImg2ImgPipeline")
    build_pipeline(tmp_path / "sd")
    file = save_single_file(eqxdiff.load_pipeline(tmp_path / "sd"), tmp_path / "sd.safetensors")
    pipe = img2img.from_single_file(str(file), config=tmp_path / "sd", dtype="bfloat16")
    assert type(pipe) is img2img and pipe.activations_dtype == jnp.bfloat16
    ours = eqxdiff.load_pipeline(tmp_path / "sd", dtype="bfloat16")
    leaves = [jax.tree.leaves(eqx.filter(p.unet, eqx.is_array)) for p in (pipe, ours)]
    assert all(a.dtype == jnp.bfloat16 and bool((a == b).all()) for a, b in zip(*leaves, strict=True))
    with pytest.raises(eqxdiff.loading.CheckpointError, match="a folder or Hub id is from_pretrained's"):
        StableDiffusionPipeline.from_single_file(tmp_path / "sd")


def test_every_pipeline_declares_its_image_to_image_argument():
    """``INIT_IMAGE`` names a real argument of the call, or is None; a ControlNet pipeline without a
    ``control_image`` argument takes its control image as ``image`` (diffusers' names), which is then no
    image-to-image start."""
    for name in family_names("pipeline"):
        cls = resolve_class(name)
        arguments = inspect.signature(cls.__call__).parameters
        assert cls.INIT_IMAGE is None or cls.INIT_IMAGE in arguments, name
        if any(c.name == "controlnet" for c in cls.COMPONENTS) and "control_image" not in arguments:
            assert cls.INIT_IMAGE is None, name
    assert resolve_class("StableDiffusionControlNetImg2ImgPipeline").INIT_IMAGE == "image"
    assert resolve_class("FluxImg2ImgPipeline").INIT_IMAGE == "image"


def test_with_scheduler_and_from_pipe_build_through_init_and_keep_settings(tmp_path, monkeypatch):
    """``with_scheduler`` builds its pipeline through ``__init__`` (``from_pipe``): the components are shared, the
    timings its own, and what the user set (VAE tiling) is kept, as by ``from_pipe``."""
    build_pipeline(tmp_path)
    pipe = eqxdiff.load_pipeline(tmp_path)
    pipe.enable_vae_tiling()
    built = []
    init = DiffusionPipeline.__init__
    monkeypatch.setattr(DiffusionPipeline, "__init__",
                        lambda self, **kw: (built.append(type(self)), init(self, **kw))[1])
    euler = pipe.with_scheduler("euler", timestep_spacing="trailing")
    assert built == [StableDiffusionPipeline]
    assert type(euler.scheduler).__name__ == "EulerDiscreteScheduler"
    assert euler.scheduler.config.timestep_spacing == "trailing"
    assert euler.unet is pipe.unet and euler.text_encoder is pipe.text_encoder and euler.timings is not pipe.timings
    assert euler.vae_tiling and type(pipe).from_pipe(pipe).vae_tiling
    assert not type(pipe).from_pipe(eqxdiff.load_pipeline(tmp_path)).vae_tiling


def test_save_pipeline_round_trips_through_diffusers(tmp_path):
    from diffusers import StableDiffusionPipeline as DiffusersPipeline

    build_pipeline(tmp_path / "a", scheduler="ddim")
    pipe = eqxdiff.load_pipeline(tmp_path / "a")
    save_pipeline(pipe, tmp_path / "b")
    again = eqxdiff.load_pipeline(tmp_path / "b")
    latents = np.random.default_rng(0).standard_normal((1, 16, 16, 4)).astype(np.float32)
    kwargs = dict(num_inference_steps=2, height=32, width=32)
    ours = pipe("a cat", latents=latents, progress=False, **kwargs)
    np.testing.assert_array_equal(ours, again("a cat", latents=latents, progress=False, **kwargs))
    ref = DiffusersPipeline.from_pretrained(tmp_path / "b", safety_checker=None)
    ref.set_progress_bar_config(disable=True)
    assert type(ref.scheduler).__name__ == "DDIMScheduler"
    with torch.no_grad():
        expected = ref("a cat", latents=nhwc_to_nchw(latents), output_type="np", **kwargs).images
    assert _max_pixel_diff(ours, expected) <= 2


def test_saved_images_carry_their_parameters(tmp_path):
    images = np.zeros((2, 8, 8, 3), np.uint8)
    paths = save_images(images, tmp_path, {"prompt": "a cat", "seed": 3, "steps": 20})
    assert [p.name for p in paths] == ["image_0.png", "image_1.png"]
    assert read_parameters(paths[1]) == {"prompt": "a cat", "seed": 3, "steps": 20, "index": 1}


def test_pipeline_class_is_exported():
    assert StableDiffusionPipeline is sd.StableDiffusionPipeline


def test_load_pipeline_with_scan_layers_gives_the_same_images(tmp_path):
    """``load_pipeline(scan_layers=True)`` stacks the text encoder's layers (the tiny UNet has none to stack) and
    changes no number: prompt embeddings (clip_skip too) and images equal the unrolled pipeline's."""
    build_pipeline(tmp_path)
    plain = eqxdiff.load_pipeline(tmp_path, attention="xla")
    scanned = eqxdiff.load_pipeline(tmp_path, attention="xla", scan_layers=True)
    assert isinstance(scanned.text_encoder.text_model.layers, eqxdiff.nn.Stacked)
    assert isinstance(plain.text_encoder.text_model.layers, tuple)
    ids = jnp.asarray(sd.tokenize(plain.tokenizer, PROMPTS))
    for skip in (None, 1):  # as accurate as the unrolled encoder, against its float64 run
        assert_close_to_float64(sd.encode_prompt(scanned.text_encoder, ids, clip_skip=skip),
                                sd.encode_prompt(plain.text_encoder, ids, clip_skip=skip),
                                run_float64(sd.encode_prompt, plain.text_encoder, ids, clip_skip=skip),
                                what=f"scanned embeddings (clip_skip={skip})")
    latents = np.random.default_rng(0).standard_normal((2, 16, 16, 4)).astype(np.float32)
    kwargs = dict(latents=latents, height=32, width=32, num_inference_steps=2, progress=False)
    assert _max_pixel_diff(scanned(PROMPTS, **kwargs), plain(PROMPTS, **kwargs) / 255.0) <= 1  # rounding only


def test_a_folder_carries_its_recommended_call(tmp_path):
    """Issue 18: a folder's model_index.json may hold eqxdiff's call defaults ("_eqxdiff": {"call_defaults": ...};
    diffusers keeps none and ignores keys starting with "_"). A call that leaves an argument out takes the folder's
    value before the signature's default; one that gives it wins; save_pipeline writes them back; from_pipe keeps
    the ones the new class takes; a name the call does not take is a ConfigError naming the file. The shipped digits
    model carries the README's recipe (20 steps, guidance 4, seed 0)."""
    build_pipeline(tmp_path / "sd")
    index = json.loads((tmp_path / "sd" / "model_index.json").read_text())
    index["_eqxdiff"] = {"call_defaults": {"num_inference_steps": 2, "guidance_scale": 3.0, "height": 32,
                                           "width": 32, "seed": 5}}
    (tmp_path / "sd" / "model_index.json").write_text(json.dumps(index))
    pipe = eqxdiff.load_pipeline(tmp_path / "sd")
    assert pipe.call_defaults["num_inference_steps"] == 2
    implicit = pipe("a red cat", progress=False)
    explicit = pipe("a red cat", num_inference_steps=2, guidance_scale=3.0, height=32, width=32, seed=5,
                    progress=False)
    np.testing.assert_array_equal(implicit, explicit)
    assert not np.array_equal(implicit, pipe("a red cat", seed=6, progress=False))  # a given argument wins
    saved = save_pipeline(pipe, tmp_path / "saved")
    assert json.loads((saved / "model_index.json").read_text())["_eqxdiff"] == index["_eqxdiff"]
    assert eqxdiff.load_pipeline(saved).call_defaults == pipe.call_defaults
    assert sd.StableDiffusionInpaintPipeline.from_pipe(pipe).call_defaults == pipe.call_defaults
    index["_eqxdiff"] = {"call_defaults": {"num_steps": 3}}
    (tmp_path / "sd" / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"model_index.json in .*sd' \(_eqxdiff.call_defaults\) names \['num_steps'\], "
                                          r"which StableDiffusionPipeline.__call__ does not take"):
        eqxdiff.load_pipeline(tmp_path / "sd")
    assert eqxdiff.load_pipeline("digits").call_defaults == {"num_inference_steps": 20, "guidance_scale": 4.0,
                                                             "seed": 0}


@pytest.mark.parametrize("cls_name, scheduler, fixed", [
    ("StableDiffusionPipeline", {"_class_name": "DDIMScheduler", "clip_sample": True}, {"steps_offset", "clip_sample"}),
    ("StableDiffusionInpaintPipeline", {"_class_name": "PNDMScheduler", "skip_prk_steps": False},
     {"steps_offset", "skip_prk_steps"}),
    ("StableDiffusionInpaintPipeline", {"_class_name": "DDIMScheduler", "clip_sample": True}, {"steps_offset"}),
    ("StableDiffusionControlNetPipeline", {"_class_name": "DDIMScheduler", "clip_sample": True}, set()),
])
def test_an_outdated_scheduler_config_is_read_as_diffusers_pipeline_reads_it(tmp_path, cls_name, scheduler, fixed):
    """diffusers' SD pipelines (text-to-image, image-to-image, inpainting; not ControlNet) rewrite an outdated
    scheduler config when built: steps_offset 1, clip_sample False (not the inpainting pipeline), the inpainting
    pipeline's PNDM skip_prk_steps True (a deprecation warning). A folder whose scheduler config leaves steps_offset
    out (0 by default) samples with the same config in both (a warning naming each key here)."""
    import diffusers

    build_pipeline(tmp_path)
    config_file = tmp_path / "scheduler" / "scheduler_config.json"
    raw = json.loads(config_file.read_text())
    raw.pop("steps_offset")
    raw.update(scheduler, timestep_spacing="leading")
    config_file.write_text(json.dumps(raw))
    kwargs = {}
    if cls_name.startswith("StableDiffusionControlNet"):
        kwargs["controlnet"] = diffusers.ControlNetModel(
            block_out_channels=(32, 64), layers_per_block=1, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            cross_attention_dim=32, attention_head_dim=4, norm_num_groups=8, conditioning_embedding_out_channels=(8,))
    reference = getattr(diffusers, cls_name).from_pretrained(tmp_path, safety_checker=None, **kwargs).scheduler.config
    expected = {k: reference[k] for k in ("steps_offset", "clip_sample", "skip_prk_steps") if k in reference}
    fixes = {k for k, v in expected.items() if v != raw.get(k, {"steps_offset": 0}.get(k))}
    assert fixes == fixed
    if kwargs:
        kwargs["controlnet"].save_pretrained(tmp_path / "controlnet", safe_serialization=True)
        index = json.loads((tmp_path / "model_index.json").read_text())
        index.update(controlnet=["diffusers", "ControlNetModel"], _class_name=cls_name)
        (tmp_path / "model_index.json").write_text(json.dumps(index))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = eqxdiff.load_pipeline(tmp_path, pipeline_class=resolve_class(cls_name))
    named = sorted(re.findall(r"config's (\w+)=", " ".join(str(w.message) for w in caught
                                                           if "scheduler config" in str(w.message))))
    assert named == sorted(fixes)
    read = {k: getattr(pipe.scheduler.config, k) for k in expected if hasattr(pipe.scheduler.config, k)}
    assert read == {k: expected[k] for k in read} and "steps_offset" in read
    if cls_name == "StableDiffusionPipeline":  # eqxdiff-generate checks the steps on the schedule the load reads:
        steps = str(raw["num_train_timesteps"])  # 'leading' with steps_offset 1 ends past the training timesteps
        with warnings.catch_warnings(record=True) as caught, pytest.raises(InputError, match=r"steps_offset"):
            warnings.simplefilter("always")
            generate.validate(["--model", str(tmp_path), "--num-inference-steps", steps])
        assert not caught  # the load warns, not the check before it
        generate.validate(["--model", str(tmp_path), "--num-inference-steps", str(int(steps) - 1)])
