"""Pipelines: model families strung together behind diffusers' argument names."""

from ._images import read_parameters as read_parameters
from ._images import save_images as save_images
from ._load import load_pipeline as load_pipeline
from ._load import load_tokenizer as load_tokenizer
from ._load import save_pipeline as save_pipeline
from .stable_diffusion import StableDiffusionPipeline as StableDiffusionPipeline
