"""Pipelines: model families strung together behind diffusers' argument names, on one base.

:class:`DiffusionPipeline` (components, loading, saving, mesh placement, timings), :func:`checked_call` (the
decorator on every family's ``__call__``) and :func:`denoise_loop` (the jitted sampling loop with classifier-free
guidance, driven by a family's :class:`Denoiser`) are what every family shares; ``load_pipeline`` finds a folder's
pipeline class through the family table.
"""

from ._arguments import seed_key as seed_key
from ._base import DiffusionPipeline as DiffusionPipeline
from ._base import load_pipeline as load_pipeline
from ._base import save_pipeline as save_pipeline
from ._call import checked_call as checked_call
from ._checks import CallLimits as CallLimits
from ._checks import InputError as InputError
from ._checks import InputTypeError as InputTypeError
from ._checks import InputWarning as InputWarning
from ._checks import NonFiniteError as NonFiniteError
from ._checks import check_arguments as check_arguments
from ._components import Component as Component
from ._components import SchedulerConfigWarning as SchedulerConfigWarning
from ._components import build_scheduler as build_scheduler
from ._components import load_tokenizer as load_tokenizer
from ._components import pipeline_class_for as pipeline_class_for
from ._denoise import Denoiser as Denoiser
from ._denoise import Guidance as Guidance
from ._denoise import Schedule as Schedule
from ._denoise import combine_guidance as combine_guidance
from ._denoise import denoise_loop as denoise_loop
from ._denoise import plan_schedule as plan_schedule
from ._denoise import rescale_noise_cfg as rescale_noise_cfg
from ._diffusers_api import UnsupportedPipelineAttribute as UnsupportedPipelineAttribute
from ._images import save_images as save_images
from ._ip_adapter_masks import downsample_mask as downsample_mask
from ._ip_adapter_masks import prepare_ip_adapter_masks as prepare_ip_adapter_masks
from ._media import read_image as read_image
from ._media import read_parameters as read_parameters
from ._media import read_video as read_video
from ._media import save_outputs as save_outputs
from ._media import save_videos as save_videos
from ._media import video_fps as video_fps
from ._media import write_video as write_video
from . import _lora_inspect as lora  # eqxdiff.lora: inspect(file), LoraReport, LoraWarning
from ._textual_inversion import embedding_path as embedding_path
from ._unet import UNetDenoiser as UNetDenoiser
from ._unet import UNetPipeline as UNetPipeline
from .stable_diffusion import StableDiffusionInpaintPipeline as StableDiffusionInpaintPipeline
from .stable_diffusion import StableDiffusionPipeline as StableDiffusionPipeline
from .stable_diffusion_xl import StableDiffusionXLImg2ImgPipeline as StableDiffusionXLImg2ImgPipeline
from .stable_diffusion_xl import StableDiffusionXLInpaintPipeline as StableDiffusionXLInpaintPipeline
from .stable_diffusion_xl import StableDiffusionXLPipeline as StableDiffusionXLPipeline

# Imported when first named: the single-file readers and writers, and huggingface_hub with them, are not needed to
# load or run a pipeline folder (``import eqxdiff`` + ``load_pipeline("digits")``).
_SINGLE_FILE = ("file_component_problem", "save_single_file", "single_file_class", "single_file_components")


def __getattr__(name: str):
    if name in _SINGLE_FILE:
        from . import _single_file

        return getattr(_single_file, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_SINGLE_FILE))
