"""What the Flux benchmarks (``flux_step.py``, ``flux_pipeline.py``) share: the presets (FLUX.1-dev and -schnell at
full size, a reduced transformer for the CPU, tiny smoke configs), the analytic FLOP count of a transformer step,
and the random-weight models built with diffusers/transformers.

The model FLOPs (:func:`transformer_flops`) count the matrix products only (multiply-add = 2 FLOPs; norms, RoPE,
softmax, activations and modulation arithmetic are left out, as MFU figures usually do). With ``N`` image tokens,
``T`` text tokens, ``S = N + T``, width ``D = heads * head_dim``, MLP width ``4D``:

- double-stream block: q/k/v ``6SD^2`` + attention output ``2SD^2`` + MLP ``16SD^2`` (both streams together cover
  the ``S`` tokens) + attention ``4S^2D`` (``QK^T`` and ``PV`` over the joint sequence) = ``24SD^2 + 4S^2D``;
- single-stream block: q/k/v + MLP-in ``2SD(3D + 4D)`` + ``proj_out`` ``2S(D + 4D)D`` + attention ``4S^2D`` =
  ``24SD^2 + 4S^2D``;
- around them: ``x_embedder`` ``2N C_in D``, ``context_embedder`` ``2T J D`` (``J`` = T5's width), ``proj_out``
  ``2N D C_out``, and per image the time/guidance/pooled embedders and every block's modulation (``12D^2`` a double
  block, ``6D^2`` a single one, ``4D^2`` for ``norm_out``).

FLUX.1-dev at 1024x1024 (``N`` = 4096, ``T`` = 512, ``D`` = 3072, 19 + 38 blocks): 74.4 TFLOP per step, 2.08 PFLOP
for 28 steps: 2.64 s at the 790 TFLOP/s an H100/H200 matmul reaches here (/work/.library/device KINDS.md), 2.11 s at
the 989 TFLOP/s datasheet peak.
"""

import contextlib
import dataclasses
import time

# black-forest-labs/FLUX.1-dev and FLUX.1-schnell transformer/config.json
DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
           num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
           axes_dims_rope=(16, 56, 56))
SCHNELL = dict(DEV, guidance_embeds=False)
# their vae/config.json (16 latent channels, no quant convs, a shift factor)
VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
           up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
           latent_channels=16, norm_num_groups=32, sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159,
           use_quant_conv=False, use_post_quant_conv=False)
# text_encoder (CLIP ViT-L/14's text model; the character tokenizer's start/end ids 0/1, no real vocabulary offline)
CLIP = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
            max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768, bos_token_id=0, eos_token_id=1,
            pad_token_id=1)
# text_encoder_2: google/t5-v1_1-xxl's encoder (4.76B parameters)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
              layer_norm_epsilon=1e-6, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)
# scheduler_config.json: dev shifts the sigmas by the image's token count, schnell does not
DEV_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15, shift=3.0,
                     use_dynamic_shifting=True)
SCHNELL_SCHEDULER = dict(shift=1.0, use_dynamic_shifting=False)

# The tiny smoke configs (diffusers' own tiny Flux test transformer, with a guidance embedder; a one-level VAE)
TINY_TRANSFORMER = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                        axes_dims_rope=(4, 4, 8), guidance_embeds=True)
TINY_VAE = dict(block_out_channels=(4,), layers_per_block=1, latent_channels=1, norm_num_groups=1,
                use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035,
                sample_size=32)
TINY_CLIP = dict(CLIP, vocab_size=64, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                 num_attention_heads=4, projection_dim=32, hidden_act="gelu")
TINY_T5 = dict(T5_XXL, vocab_size=64, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
               relative_attention_num_buckets=8)


@dataclasses.dataclass(frozen=True)
class FluxPreset:
    """A Flux model and generation setting: the transformer's config and, for the pipeline, the other components'
    configs; the image size, steps, distilled guidance (``None``: the model has no guidance embedder) and T5's
    prompt length (the text tokens)."""

    transformer: dict
    height: int
    width: int
    steps: int
    guidance_scale: float | None
    max_sequence_length: int
    vae: dict = dataclasses.field(default_factory=lambda: VAE)
    clip: dict = dataclasses.field(default_factory=lambda: CLIP)
    t5: dict = dataclasses.field(default_factory=lambda: T5_XXL)
    scheduler: dict = dataclasses.field(default_factory=lambda: DEV_SCHEDULER)

    @property
    def vae_factor(self) -> int:
        return 2 ** (len(self.vae["block_out_channels"]) - 1)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """The unpacked latents ``(h, w, C)`` (diffusers: ``h = 2 * (height // (2 * f))``)."""
        f = self.vae_factor
        return 2 * (self.height // (2 * f)), 2 * (self.width // (2 * f)), self.transformer["in_channels"] // 4

    @property
    def image_tokens(self) -> int:
        h, w, _ = self.latent_shape
        return (h // 2) * (w // 2)


PRESETS = {
    # FLUX.1-dev, 1024x1024, 28 steps, distilled guidance 3.5, T5 prompts of 512 tokens: 4096 + 512 tokens
    "dev": FluxPreset(DEV, 1024, 1024, steps=28, guidance_scale=3.5, max_sequence_length=512),
    # FLUX.1-schnell, 1024x1024, 4 steps, no guidance, T5 prompts of 256 tokens (its pipeline's usual length)
    "schnell": FluxPreset(SCHNELL, 1024, 1024, steps=4, guidance_scale=None, max_sequence_length=256,
                          scheduler=SCHNELL_SCHEDULER),
    # the CPU's reduced transformer: FLUX.1-dev's widths, heads, rope, embedders and guidance, 1 double + 2 single
    # blocks (the 1:2 ratio of 19:38) instead of 19 + 38, at 512x512 (1024 image tokens) with 512 text tokens
    "reduced": FluxPreset(dict(DEV, num_layers=1, num_single_layers=2), 512, 512, steps=28, guidance_scale=3.5,
                          max_sequence_length=512),
    # smoke runs (seconds): diffusers' tiny Flux, a one-level VAE (16x16 pixels = 8x8 tokens), tiny encoders
    "tiny": FluxPreset(TINY_TRANSFORMER, 16, 16, steps=4, guidance_scale=3.5, max_sequence_length=16,
                       vae=TINY_VAE, clip=TINY_CLIP, t5=TINY_T5),
    "tiny-schnell": FluxPreset(dict(TINY_TRANSFORMER, guidance_embeds=False), 16, 16, steps=2, guidance_scale=None,
                               max_sequence_length=16, vae=TINY_VAE, clip=TINY_CLIP, t5=TINY_T5,
                               scheduler=SCHNELL_SCHEDULER),
}


def transformer_flops(config: dict, image_tokens: int, text_tokens: int, batch: int = 1) -> float:
    """FLOPs of one forward pass of a Flux transformer (matrix products only; the formula is in the module
    docstring). ``config``: the diffusers config.json keys."""
    d = config["num_attention_heads"] * config["attention_head_dim"]
    n, t = image_tokens, text_tokens
    s = n + t
    c_in = config["in_channels"]
    c_out = config["patch_size"] ** 2 * (config.get("out_channels") or c_in)
    block = 24 * s * d * d + 4 * s * s * d
    blocks = (config["num_layers"] + config["num_single_layers"]) * block
    io = 2 * n * c_in * d + 2 * t * config["joint_attention_dim"] * d + 2 * n * d * c_out
    embedders = 2 * (256 * d + d * d) * (2 if config.get("guidance_embeds") else 1)
    embedders += 2 * (config["pooled_projection_dim"] * d + d * d)
    modulation = 12 * d * d * config["num_layers"] + 6 * d * d * config["num_single_layers"] + 4 * d * d
    return float(batch * (blocks + io + embedders + modulation))


@contextlib.contextmanager
def torch_defaults(device, dtype):
    """Build PyTorch modules straight on ``device`` in ``dtype`` (a full-size Flux in bf16 on the GPU: 24 GB, not
    48 GB of float32 first, and no minutes of host initialisation)."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def build_transformer(preset: FluxPreset, device, dtype, seed: int = 0):
    """diffusers' ``FluxTransformer2DModel`` at the preset's config with its default random initialisation."""
    import diffusers
    import torch

    torch.manual_seed(seed)
    with torch_defaults(device, dtype):
        return diffusers.FluxTransformer2DModel(**preset.transformer).eval()


def build_pipeline(preset: FluxPreset, device, dtype, seed: int = 0):
    """diffusers' ``FluxPipeline`` with every model random (PyTorch's default initialisation: random matrices,
    norm scales one) on ``device`` in ``dtype``, character tokenizers (no vocabulary files offline). Returns the
    pipeline and the build time in seconds."""
    import diffusers
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from eqxdiff.data import character_tokenizer

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    with torch_defaults(device, dtype):
        clip = CLIPTextModel(CLIPTextConfig(**preset.clip)).eval()
        t5 = T5EncoderModel(T5Config(**preset.t5)).eval()
        vae = diffusers.AutoencoderKL(**preset.vae).eval()
    transformer = build_transformer(preset, device, dtype, seed)
    pipe = diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**preset.scheduler), vae=vae, text_encoder=clip,
        tokenizer=character_tokenizer(preset.clip["max_position_embeddings"]), text_encoder_2=t5,
        tokenizer_2=character_tokenizer(preset.max_sequence_length), transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe, time.perf_counter() - t0


def parameters(module) -> int:
    return sum(p.numel() for p in module.parameters())
