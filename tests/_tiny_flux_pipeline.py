"""Tiny random Flux.1 pipelines built with diffusers/transformers and saved to folders (the Flux pipeline tests).

Four variants, every weight random (``randomize_torch``):

- ``"dev"``: diffusers' own tiny pipeline-test transformer (:data:`tests._tiny_flux.TRANSFORMER`) with a guidance
  embedder (FLUX.1-dev style), its one-level VAE (1 latent channel, vae scale factor 1, a shift factor) and a
  dynamically shifted flow-matching scheduler (dev's ``scheduler_config.json``).
- ``"control"``: ``"dev"`` whose transformer takes the control image's packed latents beside the noisy ones
  (``in_channels`` 8, ``out_channels`` 4: FLUX.1-Canny-dev / Depth-dev style), saved as a ``FluxControlPipeline``.
- ``"fill"``: ``"dev"``'s transformer and scheduler with ``"schnell"``'s VAE, the transformer taking the masked
  image's packed latents and the packed 2x2 mask pixels beside the noisy ones (``in_channels`` 8 + 8 + 16 = 32,
  ``out_channels`` 8: FLUX.1-Fill-dev style), saved as a ``FluxFillPipeline``.
- ``"schnell"``: no guidance embedder (FLUX.1-schnell style), 2 + 2 blocks of 4 heads of 8 channels, a two-level
  VAE (2 latent channels packed into 8: vae scale factor 2) and a static shift.

Both have a CLIP text encoder (pooled output) and a T5 encoder (sequence) with character tokenizers saved into the
folder, so diffusers and eqxdiff tokenize identically offline.
"""

import diffusers
import torch
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from eqxdiff.data import character_tokenizer

from . import _tiny_flux
from ._util import randomize_torch

TRANSFORMERS = {
    "dev": dict(_tiny_flux.TRANSFORMER, guidance_embeds=True),
    "control": dict(_tiny_flux.TRANSFORMER, guidance_embeds=True, in_channels=8, out_channels=4),
    "fill": dict(_tiny_flux.TRANSFORMER, guidance_embeds=True, in_channels=32, out_channels=8),
    "schnell": dict(patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=8,
                    num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[2, 2, 4],
                    guidance_embeds=False),
}
VAES = {
    "dev": _tiny_flux.VAE,
    "control": _tiny_flux.VAE,
    "fill": dict(block_out_channels=(4, 8), layers_per_block=1, latent_channels=2, norm_num_groups=2,
                    down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                    use_quant_conv=False, use_post_quant_conv=False, shift_factor=-0.12, scaling_factor=0.8,
                    sample_size=32),
}
VAES["schnell"] = VAES["fill"]
# black-forest-labs/FLUX.1-dev's scheduler_config.json; schnell's is the static shift 1.
SCHEDULERS = {
    "dev": dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15, shift=3.0,
                use_dynamic_shifting=True),
    "control": dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15, shift=3.0,
                    use_dynamic_shifting=True),
    "schnell": dict(shift=1.0, use_dynamic_shifting=False),
}
SCHEDULERS["fill"] = SCHEDULERS["dev"]
MAX_LENGTH = 16  # the CLIP tokenizer's (and text encoder's positions)


def components(variant: str, seed: int = 0) -> dict:
    """diffusers/transformers components of a tiny Flux pipeline (``variant``: ``"dev"`` or ``"schnell"``)."""
    tokenizer, tokenizer_2 = character_tokenizer(MAX_LENGTH), character_tokenizer(MAX_LENGTH)
    torch.manual_seed(seed)
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=MAX_LENGTH, projection_dim=32, hidden_act="gelu", bos_token_id=0, eos_token_id=1,
        pad_token_id=1))
    t5 = T5EncoderModel(T5Config(vocab_size=len(tokenizer_2) + 7, d_model=32, d_kv=8, d_ff=37, num_layers=2,
                                 num_heads=4, relative_attention_num_buckets=8, feed_forward_proj="relu",
                                 pad_token_id=1, eos_token_id=1))
    transformer = diffusers.FluxTransformer2DModel(**TRANSFORMERS[variant])
    vae = diffusers.AutoencoderKL(**VAES[variant])
    for i, model in enumerate((clip, t5, transformer, vae)):
        randomize_torch(model, seed=seed + 1 + i)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(**SCHEDULERS[variant])
    return dict(scheduler=scheduler, vae=vae.eval(), text_encoder=clip.eval(), tokenizer=tokenizer,
                text_encoder_2=t5.eval(), tokenizer_2=tokenizer_2, transformer=transformer.eval())


def build(folder, variant: str, seed: int = 0) -> diffusers.FluxPipeline:
    """A tiny ``FluxPipeline`` (``FluxControlPipeline`` for ``"control"``, ``FluxFillPipeline`` for ``"fill"``)
    saved in ``folder``; returns the diffusers pipeline."""
    cls = {"control": diffusers.FluxControlPipeline, "fill": diffusers.FluxFillPipeline}.get(variant,
                                                                                            diffusers.FluxPipeline)
    pipe = cls(**components(variant, seed))
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(folder, safe_serialization=True)
    return pipe
