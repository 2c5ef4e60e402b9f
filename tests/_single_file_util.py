"""Helpers for the single-file tests: one tiny pipeline per family, its folder, a copy of the folder without weights
(what ``config=`` a Hub id fetches), the single file eqxdiff writes from it, and weight comparisons."""

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import torch

import eqxdiff
from eqxdiff.loading import state_dict
from eqxdiff.pipelines import save_single_file

from ._tiny_sd import randomize_

MODELS = ("text_encoder", "text_encoder_2", "unet", "vae")


@dataclasses.dataclass
class Case:
    """A family's tiny pipeline four ways: diffusers' (``ref``, saved in ``folder``), eqxdiff's from the folder
    (``pipe``), the single file eqxdiff wrote from it (``file``) and eqxdiff's from that file with ``config=`` the
    folder's configs and tokenizers alone (``configs``: no weights, so every weight comes from the file)."""

    folder: Path
    configs: Path
    file: Path
    ref: object
    pipe: object
    single: object

    @property
    def models(self) -> list[str]:
        return [m for m in MODELS if getattr(self.pipe, m, None) is not None]


def configs_only(folder: Path, target: Path) -> Path:
    """``folder`` without its weights: model_index.json, config.json files, tokenizers, the scheduler."""
    shutil.copytree(folder, target, ignore=lambda _, names: [n for n in names if n.endswith(".safetensors")])
    return target


def make_case(root: Path, build) -> Case:
    """``build(folder)`` saves a diffusers pipeline in ``root/folder`` and returns it; the rest as :class:`Case`."""
    ref = build(root / "folder")
    ref.set_progress_bar_config(disable=True)
    pipe = eqxdiff.load_pipeline(root / "folder")
    file = save_single_file(pipe, root / "model.safetensors")
    configs = configs_only(root / "folder", root / "configs")
    return Case(root / "folder", configs, file, ref, pipe, eqxdiff.load_pipeline(file, config=configs))


def assert_same_weights(ours, theirs, models) -> None:
    """Two eqxdiff pipelines hold the same tensors under the same names."""
    for m in models:
        a, b = state_dict(getattr(ours, m)), state_dict(getattr(theirs, m))
        assert sorted(a) == sorted(b), m
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{m}.{k}")


def assert_same_torch(ref, other, models) -> None:
    """Two diffusers pipelines hold the same tensors (transformers' ``position_ids`` buffers aside)."""
    for m in models:
        a = {k: v for k, v in getattr(ref, m).state_dict().items() if not k.endswith("position_ids")}
        b = {k: v for k, v in getattr(other, m).state_dict().items() if not k.endswith("position_ids")}
        assert sorted(a) == sorted(b), f"{m}: {sorted(set(a) ^ set(b))[:4]}"
        for k in a:
            assert torch.equal(a[k], b[k]), f"{m}.{k} differs"


def pixels_off(ours_uint8, ref_float) -> int:
    return int(np.max(np.abs(ours_uint8.astype(int) - (np.asarray(ref_float) * 255).round().astype(int))))


def build_sd1_published(folder):
    """A tiny SD 1.x pipeline whose values the tensors do not show are SD 1.x's published ones (8 heads a UNet
    block, 32 norm groups, sample sizes 64 / 512, VAE scaling 0.18215; a CLIP of 64 channels a head, quick-GELU),
    so a config inferred from its single file is its own."""
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from eqxdiff.data import character_tokenizer

    tokenizer = character_tokenizer()
    torch.manual_seed(0)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=1,
        max_position_embeddings=tokenizer.model_max_length, projection_dim=64, hidden_act="quick_gelu",
        bos_token_id=0, eos_token_id=1, pad_token_id=1))
    unet = UNet2DConditionModel(
        sample_size=64, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=64, attention_head_dim=8, norm_num_groups=32)
    vae = AutoencoderKL(block_out_channels=(32, 64), layers_per_block=1, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=32,
                        sample_size=512)
    for i, m in enumerate((text_encoder, unet, vae)):
        randomize_(m, seed=30 + i)
    scheduler = PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", skip_prk_steps=True,
                              set_alpha_to_one=False, steps_offset=1)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.save_pretrained(folder, safe_serialization=True)
    return pipe


def without_weights_and_configs(configs: Path, target: Path) -> Path:
    """``configs`` less its component config.json files: tokenizers, scheduler and model_index.json only, so every
    model's config is inferred from the file."""
    shutil.copytree(configs, target, ignore=lambda d, names: ["config.json"] if Path(d) != configs else [])
    return target


# -- full-size published configs (diffusers' Hub folders), for names and shapes on the meta device -------------------

_CLIP_L = {"vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
           "num_attention_heads": 12, "max_position_embeddings": 77, "hidden_act": "quick_gelu", "projection_dim": 768}
_SD_VAE = {"block_out_channels": [128, 256, 512, 512], "down_block_types": ["DownEncoderBlock2D"] * 4,
           "up_block_types": ["UpDecoderBlock2D"] * 4, "layers_per_block": 2, "latent_channels": 4,
           "norm_num_groups": 32, "sample_size": 512, "scaling_factor": 0.18215}
_SD1_UNET = {"block_out_channels": [320, 640, 1280, 1280], "layers_per_block": 2, "cross_attention_dim": 768,
             "attention_head_dim": 8, "norm_num_groups": 32, "sample_size": 64, "in_channels": 4,
             "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
             "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3}
_XL_VAE = {**_SD_VAE, "sample_size": 1024, "scaling_factor": 0.13025}
_BIG_G = {"vocab_size": 49408, "hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
          "num_attention_heads": 20, "max_position_embeddings": 77, "hidden_act": "gelu", "projection_dim": 1280}
_SDXL_UNET = {"block_out_channels": [320, 640, 1280], "layers_per_block": 2, "cross_attention_dim": 2048,
              "attention_head_dim": [5, 10, 20], "transformer_layers_per_block": [1, 2, 10],
              "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
              "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
              "use_linear_projection": True, "addition_embed_type": "text_time", "addition_time_embed_dim": 256,
              "projection_class_embeddings_input_dim": 2816, "norm_num_groups": 32, "sample_size": 128}

PUBLISHED = {  # family: {component: (checkpoint class, config.json)}
    "sd1": {"text_encoder": ("CLIPTextModel", _CLIP_L), "unet": ("UNet2DConditionModel", _SD1_UNET),
            "vae": ("AutoencoderKL", _SD_VAE)},
    "sd1_inpaint": {"text_encoder": ("CLIPTextModel", _CLIP_L),
                    "unet": ("UNet2DConditionModel", {**_SD1_UNET, "in_channels": 9}),
                    "vae": ("AutoencoderKL", _SD_VAE)},
    "sd2": {"text_encoder": ("CLIPTextModel", {**_CLIP_L, "hidden_size": 1024, "intermediate_size": 4096,
                                               "num_hidden_layers": 23, "num_attention_heads": 16,
                                               "hidden_act": "gelu", "projection_dim": 512}),
            "unet": ("UNet2DConditionModel", {**_SD1_UNET, "attention_head_dim": [5, 10, 20, 20],
                                              "cross_attention_dim": 1024, "use_linear_projection": True,
                                              "upcast_attention": True, "sample_size": 96}),
            "vae": ("AutoencoderKL", {**_SD_VAE, "sample_size": 768})},
    "sdxl": {"text_encoder": ("CLIPTextModel", _CLIP_L), "text_encoder_2": ("CLIPTextModelWithProjection", _BIG_G),
             "unet": ("UNet2DConditionModel", _SDXL_UNET), "vae": ("AutoencoderKL", _XL_VAE)},
    # diffusers/stable-diffusion-xl-1.0-inpainting-0.1 (trained from the base): the base's configs, 9 UNet inputs
    "sdxl_inpaint": {"text_encoder": ("CLIPTextModel", _CLIP_L),
                     "text_encoder_2": ("CLIPTextModelWithProjection", _BIG_G),
                     "unet": ("UNet2DConditionModel", {**_SDXL_UNET, "in_channels": 9}),
                     "vae": ("AutoencoderKL", _XL_VAE)},
    "sdxl_refiner": {"text_encoder_2": ("CLIPTextModelWithProjection", _BIG_G),
                     "unet": ("UNet2DConditionModel", {
                         "block_out_channels": [384, 768, 1536, 1536], "layers_per_block": 2,
                         "cross_attention_dim": 1280, "attention_head_dim": [6, 12, 24, 24],
                         "transformer_layers_per_block": 4,
                         "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                              "DownBlock2D"],
                         "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
                         "use_linear_projection": True, "addition_embed_type": "text_time",
                         "addition_time_embed_dim": 256, "projection_class_embeddings_input_dim": 2560,
                         "norm_num_groups": 32, "sample_size": 128}),
                     "vae": ("AutoencoderKL", _XL_VAE)},
}


def torch_model_on_meta(class_name: str, config: dict):
    """diffusers' / transformers' model of ``config`` on the meta device (names and shapes, no memory)."""
    import diffusers
    import transformers

    with torch.device("meta"):
        if class_name.startswith("CLIP"):
            return getattr(transformers, class_name)(transformers.CLIPTextConfig(**config))
        return getattr(diffusers, class_name)(**config)


def torch_shapes(model) -> dict[str, tuple[int, ...]]:
    """A torch model's state-dict shapes under eqxdiff's names (transformers 5 drops CLIPTextModel's
    ``text_model.``; the checkpoints and eqxdiff keep it)."""
    out = {}
    for k, v in model.state_dict().items():
        if k.endswith("position_ids"):
            continue
        if type(model).__name__ == "CLIPTextModel" and not k.startswith("text_model."):
            k = "text_model." + k
        out[k] = tuple(v.shape)
    return out
