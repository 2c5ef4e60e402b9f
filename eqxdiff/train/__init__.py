"""Training: train state, pure jitted train step, objectives, optimizer, a loop on a device mesh, checkpoints, metrics.

>>> from eqxdiff import train
>>> state, frozen, losses = train.run(train.TrainConfig(steps=1500))     # the digits model, from scratch
>>> train.run(train.TrainConfig(model="path/to/sdxl", data="my-images", cache_stream=True, ...))  # fine-tune
>>> train.run(train.TrainConfig(model="digits", data="thick/", lora=train.LoraConfig(rank=4)))   # a LoRA file
>>> train.run(train.TrainConfig(model=..., data="dog/", instance_prompt="a photo of sks dog",
...                             class_prompt="a photo of dog"))                  # DreamBooth, prior preservation

Each family trains through its bundle (:class:`TrainModel`: :class:`LatentDiffusion` for Stable Diffusion,
:class:`SDXLLatentDiffusion`, :class:`FluxFlowMatching`), found from the pipeline's class name
(:data:`TRAIN_FAMILIES`), with its own options (``TrainConfig.family``: :class:`FluxOptions` for Flux's guidance
and T5 length); the step, loop, optimizer, mesh, remat, checkpoints and export are shared, and so are LoRA
(:class:`LoraConfig`: adapters alone train, saved as a PEFT or kohya file) and DreamBooth (an instance prompt, prior
preservation on class images the model draws itself).
"""

from ..data import ArrayBatches as ArrayBatches
from ._autoencoder import fit_scaling_factor as fit_scaling_factor
from ._autoencoder import train_autoencoder as train_autoencoder
from ._autoencoder import vae_loss as vae_loss
from ._checkpoint import Checkpointer as Checkpointer
from ._checkpoint import CheckpointMismatchError as CheckpointMismatchError
from ._config import TrainConfig as TrainConfig
from ._data import DataError as DataError
from ._data import cache_arrays as cache_arrays
from ._data import cache_stream as cache_stream
from ._data import check_batch as check_batch
from ._digits import DigitsArchitecture as DigitsArchitecture
from ._digits import build_digits_model as build_digits_model
from ._dreambooth import PriorBatches as PriorBatches
from ._dreambooth import class_images as class_images
from ._families import TRAIN_FAMILIES as TRAIN_FAMILIES
from ._families import train_family as train_family
from ._family import FamilyOptions as FamilyOptions
from ._family import NullCondition as NullCondition
from ._family import TextInput as TextInput
from ._family import TrainModel as TrainModel
from ._family import encode_batch as encode_batch
from ._flux import FluxFlowMatching as FluxFlowMatching
from ._flux import FluxOptions as FluxOptions
from ._init import host_init as host_init
from ._interrupt import TrainingInterrupted as TrainingInterrupted
from ._loop import data_parallel_mesh as data_parallel_mesh
from ._loop import fit as fit
from ._loop import shard_batch as shard_batch
from ._loop import shard_state as shard_state
from ._loop import state_shardings as state_shardings
from ._lora import LoraConfig as LoraConfig
from ._lora import add_lora as add_lora
from ._lora import lora_filter as lora_filter
from ._lora import save_lora as save_lora
from ._metrics import MetricsLogger as MetricsLogger
from ._metrics import image_grid as image_grid
from ._metrics import step_flops as step_flops
from ._objectives import Objective as Objective
from ._objectives import TimestepBias as TimestepBias
from ._objectives import diffusion_loss as diffusion_loss
from ._objectives import flow_density as flow_density
from ._objectives import flow_loss_weights as flow_loss_weights
from ._objectives import flow_matching_loss as flow_matching_loss
from ._objectives import flow_matching_pair as flow_matching_pair
from ._objectives import flow_schedule_at as flow_schedule_at
from ._objectives import flow_timesteps as flow_timesteps
from ._objectives import min_snr_weights as min_snr_weights
from ._objectives import offset_noise as offset_noise
from ._objectives import sample_timesteps as sample_timesteps
from ._objectives import snr as snr
from ._objectives import target as target
from ._precheck import check_data_kind as check_data_kind
from ._precheck import check_frame_count as check_frame_count
from ._precheck import check_model as check_model
from ._precheck import check_size as check_size
from ._precheck import local_index as local_index
from ._resume import ResumePoint as ResumePoint
from ._resume import autoencoder_reuse as autoencoder_reuse
from ._resume import resume_point as resume_point
from ._run import run as run
from ._sd import LatentDiffusion as LatentDiffusion
from ._sdxl import SDXLLatentDiffusion as SDXLLatentDiffusion
from ._setup import Setup as Setup
from ._setup import build as build
from ._setup import export_pipeline as export_pipeline
from ._setup import family_options as family_options
from ._sources import load_data as load_data
from ._step import OptimizerConfig as OptimizerConfig
from ._step import TrainState as TrainState
from ._step import batch_loss as batch_loss
from ._step import init_state as init_state
from ._step import make_optimizer as make_optimizer
from ._step import train_step as train_step
from ._step import trainable_filter as trainable_filter
from ._wan import WanFlowMatching as WanFlowMatching
from ._wan import WanOptions as WanOptions
