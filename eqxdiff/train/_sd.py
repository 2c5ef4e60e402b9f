"""Stable Diffusion 1.x/2.x (and the from-scratch digits model): a UNet on one CLIP text encoder's last hidden
state, the DDPM noise-prediction objective on the folder's noise schedule."""

from typing import Any, ClassVar

from .._typing import Array, Int
from ..loading.lora import Naming
from ..schedulers import DDPMScheduler
from ._family import NullCondition, TextInput, TrainModel


class LatentDiffusion(TrainModel):
    """What a Stable Diffusion train step needs: the UNet, the text encoder, the VAE, and the token ids of the
    empty prompt (caption dropout swaps them in, so the model learns the unconditional branch of guidance)."""

    DENOISER: ClassVar[str] = "unet"
    TEXT: ClassVar = (TextInput("input_ids", "tokenizer", "text_encoder"),)
    CONDITION_KEYS: ClassVar = ("encoder_hidden_states",)
    PIPELINE: ClassVar[str] = "StableDiffusionPipeline"
    NOISE_SCHEDULER: ClassVar = DDPMScheduler
    LORA_KOHYA: ClassVar = (Naming("lora_unet_", "unet", underscored=True, label="kohya"),  # diffusers' names
                            Naming("lora_te_", "text_encoder", underscored=True, label="kohya"))

    unet: Any
    text_encoder: Any
    vae: Any
    null_input_ids: Int[Array, " seq"]
    null_embeds: NullCondition | None = None

    def encode_text(self, ids):
        return {"encoder_hidden_states": self.text_encoder(ids["input_ids"]).last_hidden_state}

    def denoise(self, x, t, cond):
        return self.unet(x, t, cond["encoder_hidden_states"])
