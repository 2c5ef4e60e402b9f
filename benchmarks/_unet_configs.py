"""What the UNet benchmarks (``unet_step.py``, ``controlnet_step.py``, ``train_step.py``) share: the UNet presets,
the flags they take, the inputs of a classifier-free-guided step, and both frameworks' models built from the same
random weights (diffusers builds and saves them, eqxdiff loads the folder).

The scripts import this as ``from _unet_configs import ...``: run as ``python benchmarks/<script>.py``, the
script's own folder is first on ``sys.path``.
"""

import dataclasses
import tempfile
import time
from typing import Literal

import numpy as np

from _bench import TorchDevice, torch_sync

# stabilityai/stable-diffusion-xl-base-1.0 unet/config.json (the keys that differ from diffusers' defaults):
# 1024x1024 images as 128x128x4 latents, transformer depths 1/2/10 (the 1280-wide level and the mid block hold 10
# transformer layers each), text 2048 wide (CLIP ViT-L 768 + OpenCLIP bigG 1280), the pooled bigG embedding (1280)
# and six time ids (original size, crop corner, target size) through the "text_time" embedding: 1280 + 6 * 256.
SDXL = dict(addition_embed_type="text_time", addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816,
            attention_head_dim=(5, 10, 20), block_out_channels=(320, 640, 1280), cross_attention_dim=2048,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), layers_per_block=2,
            sample_size=128, transformer_layers_per_block=(1, 2, 10), use_linear_projection=True)

PRESETS = {
    # runwayml/stable-diffusion-v1-5 unet: 512x512 images, 64x64x4 latents, 860M parameters
    "sd15": dict(attention_head_dim=8, block_out_channels=(320, 640, 1280, 1280), cross_attention_dim=768,
                 down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",), layers_per_block=2,
                 up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3, sample_size=64),
    # SDXL base at 1024x1024: 2.57B parameters (its ControlNet from_unet: 1.25B)
    "sdxl": SDXL,
    # SDXL reduced for the CPU: every block, width, head and conditioning of SDXL, but 2 transformer layers (not 10)
    # at the 1280-wide level and in the mid block, and 512x512 images (64x64 latents): 0.90B parameters
    # (ControlNet 0.42B), so both frameworks' float32 copies fit a 23 GB machine beside others' jobs.
    "sdxl-small": dict(SDXL, transformer_layers_per_block=(1, 2, 2), sample_size=64),
    # smoke runs (seconds)
    "tiny": dict(attention_head_dim=2, block_out_channels=(32, 64), cross_attention_dim=32, norm_num_groups=8,
                 down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), layers_per_block=1,
                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), sample_size=16),
    "sdxl-tiny": dict(SDXL, attention_head_dim=(2, 4), block_out_channels=(32, 64), cross_attention_dim=32,
                      norm_num_groups=8, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                      up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), layers_per_block=1, sample_size=16,
                      transformer_layers_per_block=(1, 2), addition_time_embed_dim=8,
                      projection_class_embeddings_input_dim=6 * 8 + 24),
}
Preset = Literal["sd15", "sdxl", "sdxl-small", "tiny", "sdxl-tiny"]

# ControlNets keep diffusers' default conditioning embedding (16, 32, 96, 256): it downsamples the control image by
# 2 ** 3, the VAE's factor, so control images are 8x the latents' size (1024x1024x3 for SDXL).
CONTROL_FACTOR = 8


@dataclasses.dataclass(frozen=True)
class UNetBenchmarkArgs:
    """The flags the UNet benchmarks take; each script's ``Args`` adds its own."""

    preset: Preset = "sd15"
    """UNet config: "sd15" (full SD 1.5, 64x64 latents), "sdxl" (full SDXL base, 128x128 latents = 1024x1024
    images), "sdxl-small" (SDXL with 2 transformer layers instead of 10 at the lowest level, 64x64 latents: the
    CPU's reduced config), "tiny" / "sdxl-tiny" (seconds-long smoke runs)."""
    batch: int = 1
    """Images per step (unet_step: the UNet runs on 2 * batch latents, unconditional + conditional)."""
    repeats: int = 3
    """Timed steps per framework (after one untimed warm-up step); the median is reported."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights and activations dtype in both frameworks (train_step: gradients and AdamW moments too; pure, not
    mixed precision)."""
    text_tokens: int = 77
    """Text sequence length."""
    skip_diffusers: bool = False
    """Time eqxdiff only."""
    torch_device: TorchDevice = "auto"
    """Where diffusers runs ("auto": CUDA if PyTorch sees a GPU, else the CPU)."""
    tf32: bool = True
    """On a GPU, float32 matmuls and convolutions in TF32 in both frameworks (JAX's GPU default); --no-tf32: full
    float32 in both. Nothing changes on the CPU."""


def is_sdxl(config: dict) -> bool:
    """Whether a UNet config takes SDXL's pooled text embedding and time ids (``text_time``)."""
    return config.get("addition_embed_type") == "text_time"


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """The inputs of one classifier-free-guided step, as NumPy float32 (PyTorch's layouts: latents channels-first).

    ``latents [batch, 4, s, s]`` (one copy: the step runs the UNet on ``[latents, latents]``), ``text [2 * batch,
    tokens, cross]`` (unconditional half first), SDXL's ``text_embeds [2 * batch, pooled]`` and ``time_ids
    [2 * batch, 6]`` (original size = target size = the image, no crop), and the control image
    ``control [2 * batch, 3, f * s, f * s]`` in ``[0, 1]`` for a ControlNet (``f``: its conditioning factor)."""

    latents: np.ndarray
    text: np.ndarray
    timestep: int = 981
    text_embeds: np.ndarray | None = None
    time_ids: np.ndarray | None = None
    control: np.ndarray | None = None


def make_inputs(config: dict, batch: int, text_tokens: int, *, control_factor: int | None = None,
                seed: int = 0) -> StepInputs:
    rng = np.random.default_rng(seed)
    side = config["sample_size"]
    latents = rng.standard_normal((batch, config.get("in_channels", 4), side, side), np.float32)
    text = rng.standard_normal((2 * batch, text_tokens, config["cross_attention_dim"]), np.float32)
    extra = {}
    if is_sdxl(config):
        pooled = config["projection_class_embeddings_input_dim"] - 6 * config["addition_time_embed_dim"]
        image = 8 * side
        extra = dict(text_embeds=rng.standard_normal((2 * batch, pooled), np.float32),
                     time_ids=np.tile(np.asarray([image, image, 0, 0, image, image], np.float32), (2 * batch, 1)))
    if control_factor is not None:
        c = control_factor * side
        extra["control"] = rng.uniform(0, 1, (2 * batch, 3, c, c)).astype(np.float32)
    return StepInputs(latents=latents, text=text, **extra)


def torch_inputs(inputs: StepInputs, device, dtype) -> dict:
    """The step's inputs as PyTorch tensors: ``latents``, ``text`` and ``added_cond_kwargs`` (SDXL, else None),
    ``control`` (or None)."""
    import torch

    def t(a):
        return None if a is None else torch.from_numpy(a).to(device=device, dtype=dtype)

    added = None if inputs.text_embeds is None else {"text_embeds": t(inputs.text_embeds),
                                                     "time_ids": t(inputs.time_ids)}
    return dict(latents=t(inputs.latents), text=t(inputs.text), added_cond_kwargs=added, control=t(inputs.control))


def jax_inputs(inputs: StepInputs, dtype) -> dict:
    """The step's inputs as JAX arrays in eqxdiff's layouts (channels-last): ``latents``, ``text``, ``added`` (the
    keyword arguments ``text_embeds``/``time_ids``, empty for SD) and ``control`` (or None)."""
    import jax.numpy as jnp

    added = {} if inputs.text_embeds is None else {"text_embeds": jnp.asarray(inputs.text_embeds, dtype),
                                                   "time_ids": jnp.asarray(inputs.time_ids, dtype)}
    control = None if inputs.control is None else jnp.asarray(np.moveaxis(inputs.control, 1, -1), dtype)
    return dict(latents=jnp.asarray(np.moveaxis(inputs.latents, 1, -1), dtype), text=jnp.asarray(inputs.text, dtype),
                added=added, control=control)


def randomize_zero_convs(controlnet, seed: int = 0) -> None:
    """Give a new diffusers ControlNet's zero-initialised layers (``controlnet_cond_embedding.conv_out``, the
    ``controlnet_down_blocks``, ``controlnet_mid_block``) random weights ~ 1/sqrt(fan_in): zeros would time an
    idle network (and can run faster than real weights)."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    convs = [controlnet.controlnet_cond_embedding.conv_out, *controlnet.controlnet_down_blocks,
             controlnet.controlnet_mid_block]
    with torch.no_grad():
        for conv in convs:
            w = torch.randn(conv.weight.shape, generator=g) / conv.weight[0].numel() ** 0.5
            conv.weight.copy_(w.to(conv.weight))
            conv.bias.copy_((0.1 * torch.randn(conv.bias.shape, generator=g)).to(conv.bias))


@dataclasses.dataclass
class Models:
    """Both frameworks' UNet (and ControlNet) with the same weights: diffusers' on ``device`` in the benchmark's
    dtype, eqxdiff's loaded from diffusers' saved folder."""

    ref_unet: object
    unet: object
    ref_controlnet: object = None
    controlnet: object = None
    parameters: int = 0
    controlnet_parameters: int = 0


def build_models(config: dict, dtype: str, device, *, controlnet: bool = False) -> Models:
    """diffusers' UNet at ``config`` (default random initialisation, built on ``device``) and with ``controlnet``
    its ``ControlNetModel.from_unet`` (zero layers randomised), saved in ``dtype`` and loaded by eqxdiff."""
    import diffusers
    import torch

    import eqxdiff

    t0 = time.perf_counter()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    torch.manual_seed(0)
    with torch.device(device):
        ref = diffusers.UNet2DConditionModel(**config).eval()
        ref_cn = None
        if controlnet:
            ref_cn = diffusers.ControlNetModel.from_unet(ref).eval()
            randomize_zero_convs(ref_cn)
    if torch_dtype != torch.float32:
        ref, ref_cn = (None if m is None else m.to(torch_dtype) for m in (ref, ref_cn))
    with tempfile.TemporaryDirectory() as folder:
        ref.save_pretrained(f"{folder}/unet")
        unet = eqxdiff.load(f"{folder}/unet", dtype=dtype)
        cn = None
        if ref_cn is not None:
            ref_cn.save_pretrained(f"{folder}/controlnet")
            cn = eqxdiff.load(f"{folder}/controlnet", dtype=dtype)
    models = Models(ref, unet, ref_cn, cn, sum(p.numel() for p in ref.parameters()),
                    0 if ref_cn is None else sum(p.numel() for p in ref_cn.parameters()))
    print(f"built and loaded both frameworks' models in {time.perf_counter() - t0:.1f}s (UNet "
          f"{models.parameters / 1e6:.0f}M parameters" + (f", ControlNet {models.controlnet_parameters / 1e6:.0f}M"
                                                          if ref_cn is not None else "") + ")")
    return models



def jax_step(modules, latents, text, added, control, scale, *, timestep: int):
    """One classifier-free-guided step in eqxdiff: ``modules = (unet, controlnet or None)``; the UNet (after the
    ControlNet, whose residuals it adds) runs on ``[latents, latents]`` and returns ``u + scale * (c - u)``."""
    import jax.numpy as jnp

    unet, controlnet = modules
    x = jnp.concatenate([latents, latents])
    residuals = {}
    if controlnet is not None:
        down, mid = controlnet(x, timestep, text, control, **added)
        residuals = dict(down_block_additional_residuals=down, mid_block_additional_residual=mid)
    eps = unet(x, timestep, text, **added, **residuals)
    uncond, cond = jnp.split(eps, 2)
    return uncond + scale * (cond - uncond)


def compile_jax_step(unet, controlnet, j: dict, scale: float, timestep: int):
    """:func:`jax_step` compiled with the weights as arguments (not constants); returns ``(run, compiled)``, where
    ``run()`` takes one step and returns its output once the device is done."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    params, static = eqx.partition((unet, controlnet), eqx.is_array)
    args = (j["latents"], j["text"], j["added"], j["control"], jnp.asarray(scale, j["latents"].dtype))

    def step(params, *args):
        return jax_step(eqx.combine(params, static), *args, timestep=timestep)

    compiled = jax.jit(step).lower(params, *args).compile()

    def run():
        return jax.block_until_ready(compiled(params, *args))

    return run, compiled


def torch_step_runner(unet, controlnet, t: dict, scale: float, timestep: int, device):
    """diffusers' counterpart of :func:`compile_jax_step`'s ``run`` (as its pipelines call the models: the
    ControlNet on both halves with ``conditioning_scale=1``, its residuals passed to the UNet)."""
    import torch

    def run():
        with torch.no_grad():
            x = torch.cat([t["latents"], t["latents"]])
            residuals = {}
            if controlnet is not None:
                down, mid = controlnet(x, timestep, encoder_hidden_states=t["text"], controlnet_cond=t["control"],
                                       conditioning_scale=1.0, added_cond_kwargs=t["added_cond_kwargs"],
                                       return_dict=False)
                residuals = dict(down_block_additional_residuals=down, mid_block_additional_residual=mid)
            eps = unet(x, timestep, t["text"], added_cond_kwargs=t["added_cond_kwargs"], **residuals).sample
            uncond, cond = eps.chunk(2)
            out = uncond + scale * (cond - uncond)
        torch_sync(device)
        return out

    return run


def to_numpy_nhwc(out) -> np.ndarray:
    """A step's output as float32 NumPy, channels-last (PyTorch's are channels-first)."""
    if hasattr(out, "detach"):
        return np.moveaxis(out.detach().float().cpu().numpy(), 1, -1)
    return np.asarray(out, np.float32)
