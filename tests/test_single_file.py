"""Single-file checkpoints (A1111 / ComfyUI / SGM ``.safetensors``) against diffusers' own single-file reader.

For each family (SD 1.x epsilon, SD 2.x v-prediction with OpenCLIP, SDXL base, the SDXL refiner, SD and SDXL
inpainting with a 9-channel UNet) a tiny diffusers pipeline is saved to a folder, loaded with eqxdiff and written as
one file in the LDM/SGM layout (``save_single_file``). Then: eqxdiff reads the file (``config=`` the folder's
configs and tokenizers, no weights) into exactly the folder's weights and generates the same images; diffusers'
``from_single_file`` reads the file back into the very weights the folder holds (so the layout is diffusers'), and
its images are within 2/255 of ours; ``save_pipeline`` of the file's pipeline gives a folder diffusers loads. Also:
configs inferred from the tensors (every value the tensors show; a pipeline built with its family's published
values loads from the file alone), an SDXL-Lightning-style all-in-one file with trailing Euler, a sharded load and
the errors a user meets.
"""

import dataclasses
import json
import shutil
from types import SimpleNamespace

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eqxdiff
from eqxdiff.core import ConfigError
from eqxdiff.loading import (
    CheckpointError,
    SafetensorsFile,
    TensorDict,
    model_class,
    state_dict,
    write_safetensors,
)
from eqxdiff.loading import single_file as layouts
from eqxdiff.models.unet2d import UNet2DConditionConfig
from eqxdiff.parallel import MeshConfig, make_mesh
from eqxdiff.pipelines import (
    StableDiffusionInpaintPipeline,
    StableDiffusionPipeline,
    StableDiffusionXLImg2ImgPipeline,
    StableDiffusionXLInpaintPipeline,
    StableDiffusionXLPipeline,
    save_pipeline,
    save_single_file,
)
from eqxdiff.pipelines._latents import noise_draws

from . import _tiny_sdxl as tiny
from ._single_file_util import (
    PUBLISHED,
    assert_same_torch,
    assert_same_weights,
    build_sd1_published,
    make_case,
    pixels_off,
    torch_model_on_meta,
    torch_shapes,
    without_weights_and_configs,
)
from ._tiny_sd import build_pipeline, randomize_
from ._util import nhwc_to_nchw

PROMPTS = ["a red cat", "two dogs"]
SD_LATENTS = (2, 8, 8, 4)  # 16x16 images from the tiny SD VAE
XL_LATENTS = (2, 16, 16, 4)  # 32x32 images from the tiny SDXL VAE


def _noise(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _images(ref, **kwargs):
    with torch.no_grad():
        return ref(output_type="np", **kwargs).images


def _check_pipeline(case, reference_cls, tmp_path, run_ours, run_reference):
    """The checks every family shares (see the module docstring); ``run_*`` generate from a pipeline."""
    assert type(case.single) is type(case.pipe)
    assert_same_weights(case.pipe, case.single, case.models)
    theirs = reference_cls.from_single_file(str(case.file), config=str(case.configs))
    theirs.set_progress_bar_config(disable=True)
    assert_same_torch(case.ref, theirs, case.models)

    ours = run_ours(case.single)
    np.testing.assert_array_equal(ours, run_ours(case.pipe))
    assert pixels_off(ours, run_reference(theirs)) <= 2
    assert np.std(ours) > 1

    save_pipeline(case.single, tmp_path / "saved")
    assert_same_torch(case.ref, reference_cls.from_pretrained(tmp_path / "saved"), case.models)


# -- the families -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    return make_case(tmp_path_factory.mktemp("sd1"), lambda folder: build_pipeline(folder, scheduler="pndm"))


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    return make_case(tmp_path_factory.mktemp("sdxl"), tiny.build_base)


def _sd_runner(latents, **kwargs):
    common = dict(num_inference_steps=2, guidance_scale=6.0, height=16, width=16, **kwargs)
    return (lambda pipe: pipe(PROMPTS, latents=latents, progress=False, **common),
            lambda ref: _images(ref, prompt=PROMPTS, latents=nhwc_to_nchw(latents), **common))


def test_sd1_matches_the_folder_and_diffusers(sd1, tmp_path):
    from diffusers import StableDiffusionPipeline as Reference

    assert sorted({n.split(".")[0] for n in SafetensorsFile(sd1.file).names()}) == [
        "cond_stage_model", "first_stage_model", "model"]
    assert type(sd1.single) is StableDiffusionPipeline
    assert layouts.detect(SafetensorsFile(sd1.file), "file") is layouts.SD1  # quick-GELU CLIP: not SD 2.x's OpenCLIP
    _check_pipeline(sd1, Reference, tmp_path, *_sd_runner(_noise(SD_LATENTS), negative_prompt=["blurry", "dark"]))


def test_sd2_v_prediction_with_openclip(tmp_path_factory, tmp_path):
    """SD 2.x: the OpenCLIP tower under cond_stage_model.model (fused q/k/v), written with SD 2.x's unused last
    block (zeros) that the reader drops; v-prediction from the configs' DDIM scheduler."""
    from diffusers import StableDiffusionPipeline as Reference

    case = make_case(tmp_path_factory.mktemp("sd2"), lambda folder: build_pipeline(
        folder, scheduler="ddim", prediction_type="v_prediction", sd2=True, seed=3))
    names = SafetensorsFile(case.file).names()
    layers = case.pipe.text_encoder.config.num_hidden_layers
    assert f"cond_stage_model.model.transformer.resblocks.{layers}.attn.in_proj_weight" in names
    assert not any(n.startswith(f"cond_stage_model.model.transformer.resblocks.{layers + 1}.") for n in names)
    assert case.single.scheduler.config.prediction_type == "v_prediction"
    _check_pipeline(case, Reference, tmp_path, *_sd_runner(_noise(SD_LATENTS, 1)))


def test_sdxl_base_matches_the_folder_and_diffusers(sdxl, tmp_path):
    from diffusers import StableDiffusionXLPipeline as Reference

    assert type(sdxl.single) is StableDiffusionXLPipeline and sdxl.single.force_zeros_for_empty_prompt
    latents = _noise(XL_LATENTS, 2)
    common = dict(num_inference_steps=2, guidance_scale=5.0, height=32, width=32, prompt_2=["green", "blue sky"])
    _check_pipeline(sdxl, Reference, tmp_path,
                    lambda pipe: pipe(PROMPTS, latents=latents, progress=False, **common),
                    lambda ref: _images(ref, prompt=PROMPTS, latents=nhwc_to_nchw(latents), **common))


def test_sdxl_refiner_from_its_single_file(sdxl, tmp_path_factory, tmp_path):
    """The refiner's file: OpenCLIP bigG alone under conditioner.embedders.0.model, an aesthetic-score UNet (five
    time ids); it refines latents from denoising_start (no noise drawn)."""
    from diffusers import StableDiffusionXLImg2ImgPipeline as Reference

    case = make_case(tmp_path_factory.mktemp("refiner"), lambda folder: tiny.build_refiner(folder, sdxl.ref))
    assert not any(n.startswith("conditioner.embedders.1.") for n in SafetensorsFile(case.file).names())
    single = case.single
    assert type(single) is StableDiffusionXLImg2ImgPipeline and single.text_encoder is None
    assert single.requires_aesthetics_score and not single.force_zeros_for_empty_prompt
    assert single.unet.config.projection_class_embeddings_input_dim == 5 * 8 + tiny.POOLED
    latents = _noise(XL_LATENTS, 3)
    common = dict(num_inference_steps=4, denoising_start=0.5, guidance_scale=5.0, aesthetic_score=7.0)
    _check_pipeline(case, Reference, tmp_path,
                    lambda pipe: pipe(PROMPTS, image=latents, progress=False, **common),
                    lambda ref: _images(ref, prompt=PROMPTS, image=nhwc_to_nchw(latents), **common))


def test_sd_inpainting_nine_channel_unet(tmp_path_factory, tmp_path, monkeypatch):
    """An SD inpainting file (conv_in with 9 input channels) loads as StableDiffusionInpaintPipeline; diffusers
    draws the masked image's latents and the noise from our key."""
    from diffusers import StableDiffusionInpaintPipeline as Reference
    from diffusers import UNet2DConditionModel
    from diffusers.pipelines.stable_diffusion import pipeline_stable_diffusion_inpaint as module

    def build(folder):
        ref = build_pipeline(folder.parent / "plain", scheduler="ddim", seed=4)
        unet = UNet2DConditionModel.from_config({**ref.unet.config, "in_channels": 9})
        randomize_(unet, seed=9)
        inpaint = Reference(**{**ref.components, "unet": unet.eval()})
        inpaint.save_pretrained(folder, safe_serialization=True)
        return inpaint

    case = make_case(tmp_path_factory.mktemp("inpaint"), build)
    assert type(case.single) is StableDiffusionInpaintPipeline and case.single.unet.config.in_channels == 9
    rng = np.random.default_rng(5)
    image = rng.integers(0, 256, (2, 16, 16, 3), dtype=np.uint8)
    mask = np.zeros((2, 16, 16), np.uint8)
    mask[0, 2:10, 4:15] = 255
    mask[1, 5:16, 0:7] = 255
    draws = noise_draws(jax.random.key(1), SD_LATENTS)
    common = dict(num_inference_steps=2, guidance_scale=6.0, height=16, width=16)

    def reference(ref):
        monkeypatch.setattr(module, "randn_tensor", lambda *a, **k: nhwc_to_nchw(draws.noise))
        monkeypatch.setattr(module, "retrieve_latents", lambda out, generator=None, sample_mode="sample":
                            out.latent_dist.mean + out.latent_dist.std * nhwc_to_nchw(draws.masked_image))
        return _images(ref, prompt=PROMPTS, image=torch.from_numpy(image).permute(0, 3, 1, 2).float() / 255,
                       mask_image=torch.from_numpy(mask[:, None].astype(np.float32) / 255), **common)

    _check_pipeline(case, Reference, tmp_path,
                    lambda pipe: pipe(PROMPTS, image=image, mask_image=mask, seed=1, progress=False, **common),
                    reference)


def test_sdxl_inpainting_nine_channel_unet(tmp_path_factory, tmp_path, monkeypatch):
    """An SDXL inpainting file (the SDXL layout, conv_in with 9 input channels) loads as
    StableDiffusionXLInpaintPipeline; at diffusers' default strength 0.9999 diffusers draws the image's and the
    masked image's latents and the noise from our key."""
    from diffusers import StableDiffusionXLInpaintPipeline as Reference
    from diffusers.pipelines.stable_diffusion_xl import pipeline_stable_diffusion_xl_inpaint as module

    case = make_case(tmp_path_factory.mktemp("xl_inpaint"), tiny.build_inpaint)
    single = case.single
    assert type(single) is StableDiffusionXLInpaintPipeline and single.unet.config.in_channels == 9
    assert single.force_zeros_for_empty_prompt and not single.requires_aesthetics_score
    rng = np.random.default_rng(6)
    image = rng.integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    mask = np.zeros((2, 32, 32), np.uint8)
    mask[0, 4:20, 8:30] = 255
    mask[1, 10:32, 0:14] = 255
    draws = noise_draws(jax.random.key(2), XL_LATENTS)
    common = dict(num_inference_steps=2, guidance_scale=5.0, original_size=(40, 40))

    def reference(ref):
        posterior = iter([draws.image, draws.masked_image])
        monkeypatch.setattr(module, "randn_tensor", lambda *a, **k: nhwc_to_nchw(draws.noise))
        monkeypatch.setattr(module, "retrieve_latents", lambda out, generator=None, sample_mode="sample":
                            out.latent_dist.mean + out.latent_dist.std * nhwc_to_nchw(next(posterior)))
        return _images(ref, prompt=PROMPTS, image=torch.from_numpy(image).permute(0, 3, 1, 2).float() / 255,
                       mask_image=torch.from_numpy(mask[:, None].astype(np.float32) / 255), **common)

    _check_pipeline(case, Reference, tmp_path,
                    lambda pipe: pipe(PROMPTS, image=image, mask_image=mask, seed=2, progress=False, **common),
                    reference)


def test_lightning_all_in_one_file_with_trailing_euler(sdxl, tmp_path):
    """ComfyUI's all-in-one SDXL-Lightning file: the SDXL layout with a distilled UNet. Loaded with the base's
    configs and its recipe's scheduler (Euler, trailing timesteps), run at guidance 0: equal to diffusers from the
    same file, not to the base."""
    from diffusers import EulerDiscreteScheduler, UNet2DConditionModel
    from diffusers import StableDiffusionXLPipeline as Reference

    distilled = tiny.unet(tiny.UNET_A, seed=40)
    distilled.save_pretrained(tmp_path / "unet", safe_serialization=True)
    aio = StableDiffusionXLPipeline.from_pipe(sdxl.pipe, unet=eqxdiff.load(tmp_path / "unet"))
    file = save_single_file(aio, tmp_path / "sdxl_lightning_4step.safetensors")

    fast = eqxdiff.load_pipeline(file, config=sdxl.configs, scheduler="euler",
                                 scheduler_options={"timestep_spacing": "trailing"})
    assert fast.scheduler.config.timestep_spacing == "trailing"
    theirs = Reference.from_single_file(str(file), config=str(sdxl.configs))
    theirs.scheduler = EulerDiscreteScheduler.from_config(theirs.scheduler.config, timestep_spacing="trailing")
    theirs.set_progress_bar_config(disable=True)
    assert_same_torch(theirs, type(sdxl.ref)(**{**sdxl.ref.components, "unet": distilled}), ["unet"])
    assert isinstance(theirs.unet, UNet2DConditionModel)

    latents = _noise(XL_LATENTS, 4)
    common = dict(num_inference_steps=4, guidance_scale=0.0, height=32, width=32)
    ours = fast(PROMPTS, latents=latents, progress=False, **common)
    assert pixels_off(ours, _images(theirs, prompt=PROMPTS, latents=nhwc_to_nchw(latents), **common)) <= 2
    assert pixels_off(ours, _images(sdxl.ref, prompt=PROMPTS, latents=nhwc_to_nchw(latents), **common)) > 2


def test_scheduler_keys_its_class_does_not_read_are_kept(sd1, tmp_path):
    """A file's scheduler is read as a folder's (build_scheduler): config keys its class does not read (a DDPM
    config's variance_type under a PNDM scheduler) are kept, for a swap and for saving, as for the folder."""
    configs = shutil.copytree(sd1.configs, tmp_path / "configs")
    raw = json.loads((configs / "scheduler" / "scheduler_config.json").read_text())
    (configs / "scheduler" / "scheduler_config.json").write_text(json.dumps({**raw, "variance_type": "fixed_small"}))
    pipe = eqxdiff.load_pipeline(sd1.file, config=configs)
    assert pipe.scheduler_extras == {"variance_type": "fixed_small"}
    save_pipeline(pipe, tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "scheduler" / "scheduler_config.json").read_text())["variance_type"] \
        == "fixed_small"


# -- configs inferred from the tensors --------------------------------------------------------------------------------

# What a single file's tensors cannot show; the rest of each config.json must be inferred exactly.
NOT_SHOWN = {"unet": {"attention_head_dim", "norm_num_groups", "sample_size", "upcast_attention"},
             "vae": {"norm_num_groups", "sample_size", "scaling_factor"},
             "text_encoder": {"num_attention_heads", "bos_token_id", "eos_token_id", "pad_token_id",
                              "projection_dim"}}
NOT_SHOWN["text_encoder_2"] = NOT_SHOWN["text_encoder"] - {"projection_dim"}


def _infer_all(layout, view) -> dict:
    """Each part's config inferred in the layout's order, each seeing the ones before it (the SDXL UNet's time ids
    read the pooled text encoder's projection width)."""
    out = {}
    for part in layout.parts:
        out[part.name] = part.infer(view, where="file", configs={k: SimpleNamespace(**v) for k, v in out.items()})
    return out


def _inferred(case) -> dict:
    file = SafetensorsFile(case.file)
    return _infer_all(layouts.detect(file, "file"), file)


def _freeze(value):
    return tuple(value) if isinstance(value, list) else value


DEPTHS = {"transformer_layers_per_block", "reverse_transformer_layers_per_block"}


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_configs_inferred_from_the_tensors(family, sd1, sdxl):
    """Every value a config.json holds that the tensors show is inferred. Transformer depths are compared as the
    blocks they build: a block without attention may say any depth (the tiny SDXL UNet's (1, 2) is inferred as 2)."""
    case = {"sd1": sd1, "sdxl": sdxl}[family]
    for name, inferred in _inferred(case).items():
        given = json.loads((case.folder / name / "config.json").read_text())
        for key, value in inferred.items():
            if key not in NOT_SHOWN[name] | DEPTHS:
                assert _freeze(value) == _freeze(given.get(key)), f"{name}.{key}: {value} != {given.get(key)}"
        if name == "unet":
            ours = UNet2DConditionConfig.from_dict({**inferred, **{k: given[k] for k in NOT_SHOWN[name]}})
            theirs = UNet2DConditionConfig.from_dict(given)
            assert (ours.down_blocks, ours.mid_block, ours.up_blocks) == \
                (theirs.down_blocks, theirs.mid_block, theirs.up_blocks)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A tiny SD 1.x pipeline with SD 1.x's published values for what tensors do not show, its single file and a
    config folder of tokenizers and scheduler only."""
    root = tmp_path_factory.mktemp("published")
    case = make_case(root, build_sd1_published)
    case.configs = without_weights_and_configs(case.configs, root / "bare")
    return case


def test_a_pipeline_with_published_values_loads_from_the_file_alone(published):
    """With config= giving only tokenizers and scheduler, every model's config is inferred from the file (the
    family's published values filling in what tensors cannot show) and equals the folder's."""
    assert not (published.configs / "unet" / "config.json").exists()
    single = eqxdiff.load_pipeline(published.file, config=published.configs)
    assert_same_weights(published.pipe, single, published.models)
    for name in ("unet", "vae"):
        assert getattr(single, name).config == getattr(published.pipe, name).config, name
    ids = {"bos_token_id", "eos_token_id", "pad_token_id"}  # CLIP's own ids; SD 1.x never pools the text
    ours, theirs = single.text_encoder.config.to_dict(), published.pipe.text_encoder.config.to_dict()
    assert {k: v for k, v in ours.items() if k not in ids} == {k: v for k, v in theirs.items() if k not in ids}
    assert published.ref.unet.config.attention_head_dim == single.unet.config.attention_head_dim == 8


# -- full-size layouts on the meta device --------------------------------------------------------------------------

DIFFUSERS_TYPES = {"sd1": "v1", "sd1_inpaint": "inpainting", "sd2": "v2", "sdxl": "xl_base",
                   "sdxl_inpaint": "xl_inpaint", "sdxl_refiner": "xl_refiner"}
TOKEN_IDS = {"bos_token_id", "eos_token_id", "pad_token_id"}  # the tokenizer's; CLIP's own are assumed


@pytest.mark.parametrize("family", list(DIFFUSERS_TYPES))
def test_full_size_layouts_are_the_ones_diffusers_reads(family):
    """The published SD 1.5 / inpainting / 2.1 / SDXL base / SDXL inpainting / refiner configs at full size, names
    and shapes only: the file eqxdiff would write is the family diffusers detects, diffusers' own converters turn it
    into exactly its models' names and shapes, and eqxdiff infers the published configs back from it (SD 2.x with
    its unused last OpenCLIP block)."""
    from diffusers.loaders import single_file_utils as reader

    published = PUBLISHED[family]
    layout = layouts.BY_NAME[family]
    shapes = {}
    for part in layout.parts:
        cls = model_class(published[part.name][0])
        config = cls.config_class.from_dict(published[part.name][1])
        abstract = eqx.filter_eval_shape(lambda c=config, m=cls: m(c, key=jax.random.key(0)))
        shapes.update(layouts.layout_shapes(abstract, part.rules(config)))
        shapes.update({k: v.shape for k, v in part.extra_tensors(config).items()})  # SD 2.x's unused last block
    assert any(n.startswith("cond_stage_model.model.transformer.resblocks.23.") for n in shapes) == (family == "sd2")
    meta = {n: torch.empty(s, device="meta") for n, s in shapes.items()}
    assert reader.infer_diffusers_model_type(meta) == DIFFUSERS_TYPES[family]

    for part in layout.parts:
        model = torch_model_on_meta(*published[part.name])
        if isinstance(part, layouts.LdmUNet):
            converted = reader.convert_ldm_unet_checkpoint(meta, model.config)
        elif isinstance(part, layouts.LdmVae):
            converted = reader.convert_ldm_vae_checkpoint(meta, model.config)
        elif isinstance(part, layouts.ClipText):
            converted = {k: v for k, v in reader.convert_ldm_clip_checkpoint(meta).items() if k.startswith("text_")}
        else:
            converted = reader.convert_open_clip_checkpoint(model, meta, prefix=part.prefix)
            converted = {k: v for k, v in converted.items() if f"layers.{model.config.num_hidden_layers}." not in k}
        assert {k: tuple(v.shape) for k, v in converted.items()} == torch_shapes(model), part.name

    view = TensorDict({n: np.broadcast_to(np.float32(0), s) for n, s in shapes.items()})
    assert layouts.detect(view, "file") == layout
    for part, inferred in zip(layout.parts, _infer_all(layout, view).values()):
        cls = model_class(published[part.name][0])
        ours = cls.config_class.from_dict(inferred).to_dict()
        theirs = cls.config_class.from_dict(published[part.name][1]).to_dict()
        skip = TOKEN_IDS | ({"projection_dim"} if family == "sd2" and part.name == "text_encoder" else set())
        assert {k: v for k, v in ours.items() if k not in skip} == \
            {k: v for k, v in theirs.items() if k not in skip}, part.name


# -- loading onto a mesh ----------------------------------------------------------------------------------------------


def test_sharded_load_of_a_single_file(sdxl):
    """FSDP over the 8 devices: each weight read from the file straight onto its sharding, values unchanged; the
    repeated layers stacked (scan_layers) straight from the file's per-layer tensors. In bfloat16, each weight is
    the float32 one rounded."""
    mesh = make_mesh(MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=-1))
    pipe = eqxdiff.load_pipeline(sdxl.file, config=sdxl.configs, mesh=mesh, scan_layers=True)
    assert isinstance(pipe.text_encoder_2.text_model.layers, eqxdiff.nn.Stacked)
    assert_same_weights(sdxl.pipe, pipe, sdxl.models)
    for name in sdxl.models:
        leaves = jax.tree.leaves(getattr(pipe, name))
        assert all(leaf.sharding.mesh.shape == mesh.shape for leaf in leaves)
        assert any(not leaf.sharding.is_fully_replicated for leaf in leaves), name

    half = eqxdiff.load_pipeline(sdxl.file, config=sdxl.configs, dtype="bfloat16")
    for name in sdxl.models:
        ours, full = state_dict(getattr(half, name)), state_dict(getattr(sdxl.pipe, name))
        for k, v in ours.items():
            assert v.dtype == jnp.bfloat16, k
            np.testing.assert_array_equal(v, full[k].astype(jnp.bfloat16), err_msg=k)


# -- errors -----------------------------------------------------------------------------------------------------------


def _rewrite(file, target, *, drop=(), keep=None):
    f = SafetensorsFile(file)
    names = [n for n in f.names() if n not in drop and (keep is None or keep(n))]
    write_safetensors({n: np.asarray(f.get(n)) for n in names}, target)
    return target


def _other_unet(configs, target):
    """``configs`` with UNet B's config.json: a file with UNet A does not fit it."""
    shutil.copytree(configs, target)
    config = json.loads((target / "unet" / "config.json").read_text())
    config.update({k: list(v) if isinstance(v, tuple) else v for k, v in tiny.UNET_B.items()})
    (target / "unet" / "config.json").write_text(json.dumps(config))
    return target


def test_layouts_are_declared_in_the_order_their_configs_are_read():
    """A part whose config reads another's (the SDXL UNet's added embedding: the pooled text encoder's width) comes
    after it in its layout; a layout declaring them the other way round is refused where it is declared."""
    te2, unet = (p for p in layouts.SDXL.parts if p.name in ("text_encoder_2", "unet"))
    assert unet.needs == ("text_encoder_2",)
    with pytest.raises(ValueError, match=r"layout 'sdxl': the unet needs \['text_encoder_2'\], which are not parts "
                                         r"declared before it"):
        dataclasses.replace(layouts.SDXL, parts=(unet, te2))


def test_errors_name_the_problem_and_the_fix(sd1, sdxl, published, tmp_path, monkeypatch):
    # a file in none of the layouts (a UNet in diffusers' names): the known prefixes are listed
    plain = tmp_path / "unet.safetensors"
    write_safetensors(state_dict(sd1.pipe.unet), plain)
    with pytest.raises(CheckpointError, match=r"not in a single-file layout.*'model\.diffusion_model\.'.*"
                                              r"'conditioner\.embedders\.1\.model\.'.*eqxdiff\.load"):
        eqxdiff.load_pipeline(plain, config=sd1.configs)

    # a missing tensor, named in the file's own names, with a config inferred and one given
    gone = "model.diffusion_model.input_blocks.1.0.in_layers.0.weight"
    cut = _rewrite(published.file, tmp_path / "cut.safetensors", drop={gone})
    with pytest.raises(CheckpointError, match=rf"the unet .* 1 tensor\(s\) missing: '{gone}'.*download it again"):
        eqxdiff.load_pipeline(cut, config=published.configs)
    cut = _rewrite(sd1.file, tmp_path / "cut_sd1.safetensors", drop={gone})
    with pytest.raises(CheckpointError, match=rf"missing: '{gone}'.*does not describe this file's unet"):
        eqxdiff.load_pipeline(cut, config=sd1.configs)
    encoder = "cond_stage_model.transformer.text_model.final_layer_norm.weight"
    with pytest.raises(CheckpointError, match=rf"the text_encoder .*missing: '{encoder}'"):
        eqxdiff.load_pipeline(_rewrite(sd1.file, tmp_path / "cut2.safetensors", drop={encoder}), config=sd1.configs)
    no_text = _rewrite(sd1.file, tmp_path / "no_text.safetensors", keep=lambda n: not n.startswith("cond_stage"))
    with pytest.raises(CheckpointError, match=r"under 'model\.diffusion_model\.', 'first_stage_model\.' but not a "
                                              r"whole pipeline .*sd1: 'cond_stage_model\.transformer\.'.*load\("):
        eqxdiff.load_pipeline(no_text, config=sd1.configs)
    no_vae = _rewrite(sd1.file, tmp_path / "no_vae.safetensors", keep=lambda n: not n.startswith("first_stage"))
    with pytest.raises(CheckpointError, match=r"holds no vae \(no tensor under 'first_stage_model\.'\)"):
        eqxdiff.load_pipeline(no_vae, config=sd1.configs)

    # a config that belongs to another model
    with pytest.raises(CheckpointError, match=r"of another shape: 'model\.diffusion_model\..*does not describe"):
        eqxdiff.load_pipeline(sdxl.file, config=_other_unet(sdxl.configs, tmp_path / "other"))

    # a pickle
    pickle = tmp_path / "model.ckpt"
    torch.save({"state_dict": {}}, pickle)
    with pytest.raises(CheckpointError, match=r"PyTorch pickle; eqxdiff reads only \.safetensors.*from_single_file"
                                              r".*save_file"):
        eqxdiff.load_pipeline(pickle)

    # a config the tensors cannot give: the tiny VAE's 8 norm groups are not SD 1.x's published 32
    with pytest.raises(CheckpointError, match=r"cannot infer the config of the vae in file .*norm_num_groups.*"
                                              r"Pass config="):
        eqxdiff.load_pipeline(sd1.file, config=without_weights_and_configs(sd1.configs, tmp_path / "bare"))

    # no config=: the family's tokenizer is fetched from the Hub; without a network the error says what to pass
    asked = []

    def offline(repo, **kwargs):
        asked.append((repo, kwargs["allow_patterns"]))
        raise OSError("no network")

    monkeypatch.setattr("eqxdiff.pipelines._single_file.snapshot_download", offline)
    with pytest.raises(CheckpointError, match=r"no config= was given.*stable-diffusion-v1-5.*no network.*pass "
                                              r"config= a local diffusers folder"):
        eqxdiff.load_pipeline(published.file)
    assert asked == [("stable-diffusion-v1-5/stable-diffusion-v1-5", ["tokenizer/*"])]

    # a scheduler option the scheduler does not have
    with pytest.raises(ConfigError, match=r"EulerDiscreteScheduler has no config option\(s\) \['spacing'\]"):
        eqxdiff.load_pipeline(sdxl.file, config=sdxl.configs, scheduler_options={"spacing": "trailing"})

    # config= is for single files only
    with pytest.raises(CheckpointError, match="config= is for single .safetensors files"):
        eqxdiff.load_pipeline(sd1.folder, config=sd1.configs)
