"""The family table: the eqxdiff class that serves each checkpoint class, imported only when asked for.

Keys are what a checkpoint calls its class: diffusers' ``_class_name`` (``config.json``, ``model_index.json``) or
transformers' ``architectures[0]``. Values are ``"module:Class"``. A new family adds its lines here; nothing else
in the loader or the pipeline machinery names a family. Importing eqxdiff never imports every family.
"""

import importlib
from collections.abc import Mapping

FAMILY_TABLE: dict[str, str] = {
    # Stable Diffusion 1.x / 2.x
    "StableDiffusionPipeline": "eqxdiff.pipelines.stable_diffusion:StableDiffusionPipeline",
    "StableDiffusionImg2ImgPipeline": "eqxdiff.pipelines.stable_diffusion:StableDiffusionPipeline",
    "StableDiffusionInpaintPipeline": "eqxdiff.pipelines.stable_diffusion:StableDiffusionInpaintPipeline",
    # Stable Diffusion XL (base, refiner, inpainting)
    "StableDiffusionXLPipeline": "eqxdiff.pipelines.stable_diffusion_xl:StableDiffusionXLPipeline",
    "StableDiffusionXLImg2ImgPipeline": "eqxdiff.pipelines.stable_diffusion_xl:StableDiffusionXLImg2ImgPipeline",
    "StableDiffusionXLInpaintPipeline": "eqxdiff.pipelines.stable_diffusion_xl:StableDiffusionXLInpaintPipeline",
    "UNet2DConditionModel": "eqxdiff.models.unet2d:UNet2DConditionModel",
    "AutoencoderKL": "eqxdiff.models.vae:AutoencoderKL",
    "CLIPTextModel": "eqxdiff.models.clip:CLIPTextModel",
    "CLIPTextModelWithProjection": "eqxdiff.models.clip:CLIPTextModelWithProjection",
    "CLIPVisionModel": "eqxdiff.models.clip_vision:CLIPVisionModel",
    "CLIPVisionModelWithProjection": "eqxdiff.models.clip_vision:CLIPVisionModelWithProjection",
    # T5 / UMT5 text encoders (Flux, LTX-Video, Wan)
    "T5EncoderModel": "eqxdiff.models.t5:T5EncoderModel",
    "UMT5EncoderModel": "eqxdiff.models.t5:UMT5EncoderModel",
    # Flux.1
    "FluxTransformer2DModel": "eqxdiff.models.flux:FluxTransformer2DModel",
    "FluxPipeline": "eqxdiff.pipelines.flux:FluxPipeline",
    "FluxImg2ImgPipeline": "eqxdiff.pipelines.flux_image:FluxImg2ImgPipeline",
    "FluxKontextPipeline": "eqxdiff.pipelines.flux_image:FluxKontextPipeline",
    "FluxControlPipeline": "eqxdiff.pipelines.flux_control:FluxControlPipeline",
    "FluxControlImg2ImgPipeline": "eqxdiff.pipelines.flux_control:FluxControlImg2ImgPipeline",
    "FluxControlInpaintPipeline": "eqxdiff.pipelines.flux_control:FluxControlInpaintPipeline",
    "FluxInpaintPipeline": "eqxdiff.pipelines.flux_inpaint:FluxInpaintPipeline",
    "FluxFillPipeline": "eqxdiff.pipelines.flux_inpaint:FluxFillPipeline",
    # Wan 2.1 / 2.2 (text encoder: UMT5 above; 2.1 image-to-video's image encoder: CLIP vision above)
    "WanTransformer3DModel": "eqxdiff.models.wan:WanTransformer3DModel",
    "AutoencoderKLWan": "eqxdiff.models.wan_vae:AutoencoderKLWan",
    "WanPipeline": "eqxdiff.pipelines.wan:WanPipeline",
    "WanImageToVideoPipeline": "eqxdiff.pipelines.wan_i2v:WanImageToVideoPipeline",
    "WanVideoToVideoPipeline": "eqxdiff.pipelines.wan_v2v:WanVideoToVideoPipeline",
    # LTX-Video
    "LTXVideoTransformer3DModel": "eqxdiff.models.ltx:LTXVideoTransformer3DModel",
    "AutoencoderKLLTXVideo": "eqxdiff.models.ltx_vae:AutoencoderKLLTXVideo",
    "LTXLatentUpsamplerModel": "eqxdiff.models.ltx_upsampler:LTXLatentUpsamplerModel",
    "LTXPipeline": "eqxdiff.pipelines.ltx:LTXPipeline",
    "LTXImageToVideoPipeline": "eqxdiff.pipelines.ltx_i2v:LTXImageToVideoPipeline",
    "LTXConditionPipeline": "eqxdiff.pipelines.ltx_condition:LTXConditionPipeline",
    "LTXLatentUpsamplePipeline": "eqxdiff.pipelines.ltx_upsample:LTXLatentUpsamplePipeline",
    # ControlNet
    "ControlNetModel": "eqxdiff.models.controlnet:ControlNetModel",
    "StableDiffusionControlNetPipeline": "eqxdiff.pipelines.controlnet:StableDiffusionControlNetPipeline",
    "StableDiffusionControlNetImg2ImgPipeline": "eqxdiff.pipelines.controlnet:StableDiffusionControlNetImg2ImgPipeline",
    "StableDiffusionControlNetInpaintPipeline": "eqxdiff.pipelines.controlnet:StableDiffusionControlNetInpaintPipeline",
    "StableDiffusionXLControlNetPipeline": "eqxdiff.pipelines.controlnet:StableDiffusionXLControlNetPipeline",
    "StableDiffusionXLControlNetImg2ImgPipeline":
        "eqxdiff.pipelines.controlnet:StableDiffusionXLControlNetImg2ImgPipeline",
    "StableDiffusionXLControlNetInpaintPipeline":
        "eqxdiff.pipelines.controlnet:StableDiffusionXLControlNetInpaintPipeline",
    # ControlNet-Union (SDXL)
    "ControlNetUnionModel": "eqxdiff.models.controlnet_union:ControlNetUnionModel",
    "StableDiffusionXLControlNetUnionPipeline":
        "eqxdiff.pipelines.controlnet_union:StableDiffusionXLControlNetUnionPipeline",
    "StableDiffusionXLControlNetUnionImg2ImgPipeline":
        "eqxdiff.pipelines.controlnet_union:StableDiffusionXLControlNetUnionImg2ImgPipeline",
    "StableDiffusionXLControlNetUnionInpaintPipeline":
        "eqxdiff.pipelines.controlnet_union:StableDiffusionXLControlNetUnionInpaintPipeline",
}

# Single .safetensors files holding a pipeline (eqxdiff.load_pipeline(file, config=...)): "module:NAME" of each
# family's declared layouts (a tuple of eqxdiff.loading.single_file.Layout: the tensors that tell a file, its models
# with their conversion rules and configs, what the rest of the pipeline comes from), imported on first use and
# matched in this order. One shared assembly (eqxdiff.pipelines._single_file) reads and writes every layout.
SINGLE_FILE_LAYOUTS: tuple[str, ...] = (
    "eqxdiff.pipelines.flux:SINGLE_FILE_LAYOUTS",  # Black Forest Labs and ComfyUI Flux.1 files
    "eqxdiff.pipelines.ltx_files:SINGLE_FILE_LAYOUTS",  # Lightricks' LTX-Video files (transformer + VAE)
    "eqxdiff.loading.single_file:LAYOUTS",  # A1111 / ComfyUI / SGM Stable Diffusion 1.x, 2.x, SDXL files
    "eqxdiff.pipelines.wan:SINGLE_FILE_LAYOUTS",  # Wan 2.1 / 2.2 original transformer and VAE files
)

_KINDS = {"model": "eqxdiff.models.", "pipeline": "eqxdiff.pipelines."}


def family_names(kind: str, table: Mapping[str, str] = FAMILY_TABLE) -> list[str]:
    """The checkpoint class names of ``kind`` (``"model"`` or ``"pipeline"``) that eqxdiff serves."""
    return sorted(k for k, v in table.items() if v.startswith(_KINDS[kind]))


def resolve_class(name: str, table: Mapping[str, str] = FAMILY_TABLE) -> type | None:
    """The eqxdiff class serving checkpoint class ``name``, or ``None`` if none does."""
    target = table.get(name)
    if target is None:
        return None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def single_file_layouts(table: tuple[str, ...] = SINGLE_FILE_LAYOUTS) -> tuple:
    """Every family's single-file layouts (:data:`SINGLE_FILE_LAYOUTS`), in the order a file is matched."""
    layouts = []
    for target in table:
        module, name = target.split(":")
        layouts.extend(getattr(importlib.import_module(module), name))
    return tuple(layouts)
