"""Single-file Stable Diffusion checkpoints (A1111 / ComfyUI / SGM ``.safetensors``) as layouts of conversion rules.

The files people download from model sites hold a whole pipeline in one ``.safetensors``, each model under its own
prefix and in the original (CompVis LDM / Stability SGM) names:

================================================  ===========================================================
``model.diffusion_model.``                         the UNet (``input_blocks``, ``middle_block``, ``output_blocks``)
``first_stage_model.``                             the VAE (``encoder.down.{i}.block.{j}``, 1x1-conv attention)
``cond_stage_model.transformer.``                  SD 1.x: CLIP ViT-L in transformers' names
``cond_stage_model.model.``                        SD 2.x: OpenCLIP ViT-H (its last block unused)
``conditioner.embedders.0.transformer.``           SDXL base: CLIP ViT-L in transformers' names
``conditioner.embedders.1.model.``                 SDXL base: OpenCLIP bigG (with its text projection)
``conditioner.embedders.0.model.``                 SDXL refiner: OpenCLIP bigG alone
================================================  ===========================================================

Each family's layout is data (:data:`LAYOUTS`, :class:`~eqxdiff.loading._layout.Layout`): the text encoders that
tell it, its models as parts (:class:`LdmUNet` and :class:`LdmVae`, whose rules :func:`ldm_unet` / :func:`ldm_vae`
generate from a config as both number their layers through the whole network; :class:`ClipText`,
:class:`OpenClipText`), and what the tensors do not show, from the family's published configs: attention heads
(SD 1.x: 8 per block; SD 2.x and SDXL: 64 channels a head), sample sizes, the VAE's scaling factor, SD 2.x's
attention upcast and unused last OpenCLIP block, SDXL's time ids; the scheduler and the Hub repository its
tokenizers come from. An inpainting file is its family's layout with a 9-channel UNet. The rules'
:func:`~eqxdiff.loading.inverse` writes a model back in the file's layout (:func:`layout_tensors`), so eqxdiff writes
files that diffusers' ``from_single_file`` reads. The pipeline-level entry is
``eqxdiff.load_pipeline("file.safetensors", config=...)``; other families declare their layouts beside their
pipelines (:data:`eqxdiff.core.SINGLE_FILE_LAYOUTS` lists them all).
"""

import dataclasses
from collections.abc import Mapping

from ._errors import PICKLE_SUFFIXES as PICKLE_SUFFIXES
from ._layout import Layout as Layout
from ._layout import Part as Part
from ._layout import Shapes as Shapes
from ._layout import Sized as Sized
from ._layout import check_tensors as check_tensors
from ._layout import detect as detect_in
from ._layout import layout_shapes as layout_shapes
from ._layout import layout_tensors as layout_tensors
from ._ldm import UNET as UNET
from ._ldm import VAE as VAE
from ._ldm import LdmUNet as LdmUNet
from ._ldm import LdmVae as LdmVae
from ._ldm import infer_unet_config as infer_unet_config
from ._ldm import infer_vae_config as infer_vae_config
from ._ldm import ldm_unet as ldm_unet
from ._ldm import ldm_vae as ldm_vae
from ._text_layouts import ClipText as ClipText
from ._text_layouts import OpenClipText as OpenClipText
from ._text_layouts import clip_text as clip_text
from ._text_layouts import openclip_padding_block as openclip_padding_block
from ._text_layouts import openclip_text_rules as openclip_text_rules
from .formats import SD1_CLIP, SD2_OPENCLIP, SDXL_CLIP, SDXL_OPENCLIP

SDXL_REFINER_OPENCLIP = "conditioner.embedders.0.model."  # the SDXL refiner's only text encoder (OpenCLIP bigG)
TOKENIZERS: Mapping[str, str] = {"tokenizer": "text_encoder", "tokenizer_2": "text_encoder_2"}  # and what each serves
CONV_IN = UNET + "input_blocks.0.0.weight"  # the UNet's conv_in: 9 input channels in an inpainting file


def _scheduler(class_name: str, **extra) -> dict:
    return {"_class_name": class_name, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
            "num_train_timesteps": 1000, "steps_offset": 1, "set_alpha_to_one": False, "clip_sample": False,
            "skip_prk_steps": True, "prediction_type": "epsilon", **extra}


def _inpainting(layout: Layout, pipeline: str, hub_id: str, **changes) -> Layout:
    """``layout``'s inpainting variant: the same file with a 9-channel UNet, loaded as ``pipeline``."""
    return dataclasses.replace(layout, name=f"{layout.name}_inpaint", pipelines=(pipeline,), hub_id=hub_id,
                               signature=(*layout.signature, Sized(CONV_IN, 1, 9)), **changes)


_EULER = _scheduler("EulerDiscreteScheduler", interpolation_type="linear", timestep_spacing="leading",
                    use_karras_sigmas=False)
_XL_UNET = {"head_width": 64, "sample_size": 128, "pooled_from": "text_encoder_2"}
_XL_VAE = LdmVae(sample_size=1024, scaling_factor=0.13025)
_SD_VAE = LdmVae(sample_size=512, scaling_factor=0.18215)
SD1 = Layout(
    name="sd1", family="Stable Diffusion 1.x", pipelines=("StableDiffusionPipeline",), signature=(SD1_CLIP,),
    parts=(ClipText(name="text_encoder", prefix=SD1_CLIP), LdmUNet(head_width=None, sample_size=64), _SD_VAE),
    tokenizers=TOKENIZERS, hub_id="stable-diffusion-v1-5/stable-diffusion-v1-5", scheduler=_scheduler("PNDMScheduler"))
SD2 = Layout(
    name="sd2", family="Stable Diffusion 2.x", pipelines=("StableDiffusionPipeline",), signature=(SD2_OPENCLIP,),
    parts=(OpenClipText(name="text_encoder", model_class="CLIPTextModel", prefix=SD2_OPENCLIP, unused_blocks=1),
           LdmUNet(head_width=64, sample_size=96, upcast_attention=True),
           dataclasses.replace(_SD_VAE, sample_size=768)),
    tokenizers=TOKENIZERS, hub_id="stabilityai/stable-diffusion-2-1",
    scheduler=_scheduler("DDIMScheduler", prediction_type="v_prediction"))
SDXL = Layout(
    name="sdxl", family="Stable Diffusion XL", pipelines=("StableDiffusionXLPipeline",), signature=(SDXL_OPENCLIP,),
    parts=(ClipText(name="text_encoder", prefix=SDXL_CLIP), OpenClipText(name="text_encoder_2", prefix=SDXL_OPENCLIP),
           LdmUNet(time_ids=6, **_XL_UNET), _XL_VAE),
    tokenizers=TOKENIZERS, hub_id="stabilityai/stable-diffusion-xl-base-1.0", scheduler=_EULER,
    options={"force_zeros_for_empty_prompt": True})
SDXL_REFINER = Layout(
    name="sdxl_refiner", family="Stable Diffusion XL", pipelines=("StableDiffusionXLImg2ImgPipeline",),
    signature=(SDXL_REFINER_OPENCLIP,),
    parts=(OpenClipText(name="text_encoder_2", prefix=SDXL_REFINER_OPENCLIP), LdmUNet(time_ids=5, **_XL_UNET),
           _XL_VAE),
    tokenizers=TOKENIZERS, hub_id="stabilityai/stable-diffusion-xl-refiner-1.0", scheduler=_EULER,
    options={"requires_aesthetics_score": True, "force_zeros_for_empty_prompt": False})

# The Stable Diffusion layouts, in the order a file is matched against them (an inpainting variant before its plain
# layout); eqxdiff.core.SINGLE_FILE_LAYOUTS lists this table among every family's.
LAYOUTS: tuple[Layout, ...] = (
    _inpainting(SDXL, "StableDiffusionXLInpaintPipeline", "diffusers/stable-diffusion-xl-1.0-inpainting-0.1"),
    SDXL, SDXL_REFINER,
    _inpainting(SD2, "StableDiffusionInpaintPipeline", "stabilityai/stable-diffusion-2-inpainting",
                scheduler=_scheduler("DDIMScheduler")),
    SD2,
    _inpainting(SD1, "StableDiffusionInpaintPipeline", "stable-diffusion-v1-5/stable-diffusion-inpainting"),
    SD1,
)
BY_NAME: Mapping[str, Layout] = {layout.name: layout for layout in LAYOUTS}


def detect(view, where: str) -> Layout:
    """The Stable Diffusion layout (:data:`LAYOUTS`) of a single file (``view``: its ``names()/shape()``), or a
    :class:`~eqxdiff.loading.CheckpointError` saying what it lacks."""
    return detect_in(view, where, LAYOUTS)


__all__ = ["BY_NAME", "CONV_IN", "LAYOUTS", "PICKLE_SUFFIXES", "SD1", "SD2", "SDXL", "SDXL_REFINER",
           "SDXL_REFINER_OPENCLIP", "TOKENIZERS", "UNET", "VAE", "ClipText", "LdmUNet", "LdmVae", "Layout",
           "OpenClipText", "Part", "Shapes", "Sized", "check_tensors", "clip_text", "detect", "detect_in",
           "infer_unet_config", "infer_vae_config", "layout_shapes", "layout_tensors", "ldm_unet", "ldm_vae",
           "openclip_padding_block", "openclip_text_rules"]
