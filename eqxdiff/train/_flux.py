"""Flux.1 (dev, schnell), as diffusers' ``train_dreambooth_flux.py``: rectified-flow matching of the transformer
on the VAE's shifted and scaled latents ``z = (vae_z - shift) * scale``, packed into 2x2 patches; the noise level
``sigma`` from the flow-matching scheduler's training schedule at a density draw (``Objective.weighting_scheme``:
uniform, logit-normal, mode; SD3's loss weightings); ``x_t = (1 - sigma) x0 + sigma * noise`` and the target
``noise - x0``; text as the pipeline encodes it (CLIP's pooled output, T5's last hidden state at
``max_sequence_length`` tokens); a guidance-distilled transformer (FLUX.1-dev) at a constant guidance (3.5 by
default). Both settings are Flux's own options (:class:`FluxOptions`: ``--family.*`` under the ``flux-*``
presets)."""

import dataclasses
import math
from typing import Any, ClassVar

import jax.numpy as jnp

from .._typing import Array, Int
from ..loading.lora import Naming
from ..models.flux import image_ids, pack_latents, text_ids, unpack_latents
from ..pipelines.flux import clip_pooled, t5_embeddings
from ..schedulers import FlowMatchEulerDiscreteScheduler
from ._family import FamilyOptions, NullCondition, TextInput, TrainModel


@dataclasses.dataclass(frozen=True)
class FluxOptions(FamilyOptions):
    """Flux's training options (``--family.*`` under the ``flux-dev`` and ``flux-schnell`` presets)."""

    guidance_scale: float = 3.5
    """A guidance-distilled transformer (FLUX.1-dev's ``guidance_embeds``) trains at this constant guidance
    (diffusers' ``--guidance_scale``); one without (schnell) ignores it."""
    max_sequence_length: int = 512
    """T5's caption length in tokens, in training and in the samples (the pipeline's and diffusers'
    ``--max_sequence_length``: at most 512); CLIP takes its tokenizer's length (77)."""

    def __post_init__(self):
        if not 1 <= self.max_sequence_length <= 512:
            raise ValueError(f"max_sequence_length={self.max_sequence_length} must be in [1, 512] (T5's limit in the "
                             "Flux pipelines)")
        if not math.isfinite(self.guidance_scale):
            raise ValueError(f"guidance_scale={self.guidance_scale} must be finite")


class FluxFlowMatching(TrainModel):
    """Flux's ``transformer``, ``text_encoder`` (CLIP, pooled), ``text_encoder_2`` (T5), VAE, the empty prompt's
    token ids for each, and its :class:`FluxOptions`: the guidance embedded for a transformer with
    ``guidance_embeds`` (ignored by one without), T5's token count. ``train_text_encoder`` trains CLIP only, as
    diffusers' script does."""

    DENOISER: ClassVar[str] = "transformer"
    TEXT: ClassVar = (TextInput("input_ids", "tokenizer", "text_encoder"),
                      TextInput("input_ids_2", "tokenizer_2", "text_encoder_2", length="max_sequence_length"))
    CONDITION_KEYS: ClassVar = ("encoder_hidden_states", "pooled_projections")
    PIPELINE: ClassVar[str] = "FluxPipeline"
    NOISE_SCHEDULER: ClassVar = FlowMatchEulerDiscreteScheduler
    TRAINABLE_TEXT_ENCODERS: ClassVar = ("text_encoder",)
    OPTIONS: ClassVar = FluxOptions
    CALL_OPTIONS: ClassVar = ("max_sequence_length",)  # samples read T5 as it was trained
    LORA_KOHYA: ClassVar = (Naming("lora_unet_", "transformer", "bfl", underscored=True, label="kohya (BFL names)"),
                            Naming("lora_te1_", "text_encoder", underscored=True, label="kohya"))

    transformer: Any
    text_encoder: Any
    text_encoder_2: Any
    vae: Any
    null_input_ids: Int[Array, " seq"]
    null_input_ids_2: Int[Array, " seq2"]
    null_embeds: NullCondition | None = None

    def encode_text(self, ids):
        return {"encoder_hidden_states": t5_embeddings(self.text_encoder_2, ids["input_ids_2"]),
                "pooled_projections": clip_pooled(self.text_encoder, ids["input_ids"])}

    def denoise(self, x, t, cond):
        """The velocity at latents ``x`` ``[b, h, w, c]`` and flow-matching timesteps ``t`` (``1000 sigma``): the
        transformer on the packed latents at ``sigma = t / 1000``, unpacked."""
        b, h, w, _ = x.shape
        text = cond["encoder_hidden_states"]
        rope = self.transformer.rotary_embedding(image_ids(h // 2, w // 2), text_ids(text.shape[1]))
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = jnp.full((b,), self.options.guidance_scale, jnp.float32)
        velocity = self.transformer(pack_latents(x), text, cond["pooled_projections"],
                                    t.astype(jnp.float32) / 1000,
                                    rope=rope, guidance=guidance)
        return unpack_latents(velocity, h, w)
