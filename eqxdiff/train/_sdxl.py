"""Stable Diffusion XL, as diffusers' ``train_text_to_image_sdxl.py``: the UNet on both text encoders' penultimate
hidden states (concatenated) and ``text_encoder_2``'s pooled projection, prompts encoded as the pipeline encodes
them, the micro-conditioning ``time_ids = original_size + crop_top_left + target_size`` of each training image,
and the DDPM noise-prediction objective on the folder's noise schedule."""

from typing import Any, ClassVar

import jax.numpy as jnp

from .._typing import Array, Int
from ..loading.lora import Naming
from ..pipelines.stable_diffusion_xl import encode_prompt
from ..schedulers import DDPMScheduler
from ._family import NullCondition, TextInput, TrainModel


class SDXLLatentDiffusion(TrainModel):
    """SDXL's UNet, ``text_encoder`` (CLIP ViT-L), ``text_encoder_2`` (with projection), VAE, and the empty
    prompt's token ids for each. Batches carry each image's ``original_size`` and ``crop_top_left`` (int
    ``[batch, 2]``: the facts ``IMAGE_KEYS`` asks the data transforms for); the target size is the training
    resolution."""

    DENOISER: ClassVar[str] = "unet"
    TEXT: ClassVar = (TextInput("input_ids", "tokenizer", "text_encoder"),
                      TextInput("input_ids_2", "tokenizer_2", "text_encoder_2"))
    CONDITION_KEYS: ClassVar = ("encoder_hidden_states", "text_embeds")
    IMAGE_KEYS: ClassVar = ("original_size", "crop_top_left")
    PIPELINE: ClassVar[str] = "StableDiffusionXLPipeline"
    NOISE_SCHEDULER: ClassVar = DDPMScheduler
    LORA_KOHYA: ClassVar = (Naming("lora_unet_", "unet", "sgm", underscored=True, label="kohya (SGM names)"),
                            Naming("lora_te1_", "text_encoder", underscored=True, label="kohya"),
                            Naming("lora_te2_", "text_encoder_2", underscored=True, label="kohya"))

    unet: Any
    text_encoder: Any
    text_encoder_2: Any
    vae: Any
    null_input_ids: Int[Array, " seq"]
    null_input_ids_2: Int[Array, " seq2"]
    null_embeds: NullCondition | None = None

    def encode_text(self, ids):
        first, _ = encode_prompt(self.text_encoder, ids["input_ids"])
        second, pooled = encode_prompt(self.text_encoder_2, ids["input_ids_2"])
        return {"encoder_hidden_states": jnp.concatenate([first, second], axis=-1), "text_embeds": pooled}

    def time_ids(self, cond, height: int, width: int) -> Array:
        """``[batch, 6]``: each image's ``original_size + crop_top_left``, then the target size (``height x width``
        latents times the VAE's factor: the training resolution)."""
        f = self.vae.config.downsample_factor
        size = cond["original_size"]
        target = jnp.broadcast_to(jnp.asarray([height * f, width * f], jnp.float32), size.shape)
        return jnp.concatenate([size.astype(jnp.float32), cond["crop_top_left"].astype(jnp.float32), target], -1)

    def denoise(self, x, t, cond):
        return self.unet(x, t, cond["encoder_hidden_states"], text_embeds=cond["text_embeds"],
                         time_ids=self.time_ids(cond, x.shape[1], x.shape[2]))

    @classmethod
    def from_pipeline(cls, pipe, options=None):
        """The shared :meth:`~eqxdiff.train.TrainModel.from_pipeline`, for an SDXL base pipeline only."""
        if pipe.text_encoder is None or getattr(pipe, "requires_aesthetics_score", False):
            raise ValueError(f"{type(pipe).__name__} without text_encoder or with aesthetic-score conditioning (an "
                             "SDXL refiner): eqxdiff fine-tunes SDXL base UNets (both text encoders, size and crop "
                             "conditioning)")
        c = pipe.unet.config
        pooled = pipe.text_encoder_2.config.projection_dim
        width = c.projection_class_embeddings_input_dim
        if width != 6 * c.addition_time_embed_dim + pooled:
            raise ValueError(f"the UNet's projection_class_embeddings_input_dim={width} is not 6 time ids x "
                             f"{c.addition_time_embed_dim} + pooled {pooled}: not an SDXL base UNet (original size, "
                             "crop, target size)")
        return super().from_pipeline(pipe, options)
