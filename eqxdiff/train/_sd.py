"""Stable Diffusion 1.x/2.x (and the from-scratch digits model): a UNet on one CLIP text encoder's last hidden
state, the DDPM noise-prediction objective on the folder's noise schedule."""

from typing import Any, ClassVar

from .._typing import Array, Int
from ..schedulers import DDPMScheduler
from ._family import NullCondition, TextInput, TrainModel


class LatentDiffusion(TrainModel):
    """What a Stable Diffusion train step needs: the UNet, the text encoder, the VAE, and the token ids of the
    empty prompt (caption dropout swaps them in, so the model learns the unconditional branch of guidance)."""

    DENOISER: ClassVar[str] = "unet"
    TEXT: ClassVar = (TextInput("input_ids", "tokenizer", "text_encoder"),)
    CONDITION_KEYS: ClassVar = ("encoder_hidden_states",)
    PIPELINE: ClassVar[str] = "StableDiffusionPipeline"

    unet: Any
    text_encoder: Any
    vae: Any
    null_input_ids: Int[Array, " seq"]
    null_embeds: NullCondition | None = None

    def encode_text(self, ids):
        return {"encoder_hidden_states": self.text_encoder(ids["input_ids"]).last_hidden_state}

    def denoise(self, x, t, cond):
        return self.unet(x, t, cond["encoder_hidden_states"])

    @classmethod
    def from_pipeline(cls, pipe, **settings):
        tokenizers = {"tokenizer": pipe.tokenizer}
        bundle = cls(pipe.unet, pipe.text_encoder, pipe.vae, *cls.null_token_ids(tokenizers, **settings))
        return bundle, tokenizers, DDPMScheduler.from_config(pipe.scheduler.config.to_dict())
