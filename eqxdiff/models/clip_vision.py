"""CLIP image encoders (Wan 2.1 image-to-video's ``image_encoder``), loaded from transformers folders.

>>> import eqxdiff
>>> image_encoder = eqxdiff.load("path/to/wan-i2v", subfolder="image_encoder")   # CLIPVisionModel
>>> out = image_encoder(pixel_values, output_hidden_states=True)  # [batch, 224, 224, 3], normalised, channels-last
>>> out.hidden_states[-2]                                         # what Wan's transformer takes: [batch, 257, 1280]

State-dict names are transformers' (``vision_model.encoder.layers.0.self_attn.q_proj.weight`` ...). Numerics follow
``transformers.CLIPVisionModel`` / ``CLIPVisionModelWithProjection`` in eval mode: a patch embedding (a convolution
with stride = kernel = patch, no bias), a learned class token and position table, ``pre_layrnorm`` (transformers'
spelling), CLIP's pre-norm encoder layers (non-causal, shared with the text encoder), ``post_layernorm`` on the class
token only (the pooled output) and, with projection, ``visual_projection``. Images are channels-last and already
normalised as ``CLIPImageProcessor`` does (resize, center crop, mean/std).
"""

import dataclasses
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from .. import nn
from .._typing import Array, Float, PRNGKeyArray, typechecked
from ..core import ModelConfig, Plan, checkpoint_block, constrain
from ._base import PretrainedModel
from .clip import CLIPEncoderLayer


@dataclasses.dataclass(frozen=True)
class CLIPVisionConfig(ModelConfig):
    """The ``config.json`` transformers writes for ``CLIPVisionModel`` / ``CLIPVisionModelWithProjection``
    (defaults are transformers'). ``attention_dropout`` is never applied (eval mode); it is kept to be written
    back."""

    SUPPORTED_VALUES: ClassVar = {"hidden_act": nn.ACTIVATIONS, "model_type": ("clip_vision_model",)}
    model_type: ClassVar[str] = "clip_vision_model"

    hidden_size: int = 768
    intermediate_size: int = 3072
    projection_dim: int = 512
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    initializer_factor: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        for key in ("hidden_size", "intermediate_size", "projection_dim", "num_hidden_layers", "num_attention_heads",
                    "num_channels", "image_size", "patch_size"):
            value = getattr(self, key)
            self.check(not isinstance(value, bool) and value > 0, key, "must be a positive integer")
        self.check(self.hidden_size % self.num_attention_heads == 0, "hidden_size",
                   f"must be divisible by num_attention_heads={self.num_attention_heads}")
        self.check(self.patch_size <= self.image_size, "patch_size", f"must be at most image_size={self.image_size}")
        self.check(self.layer_norm_eps > 0, "layer_norm_eps", "must be a positive number")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_patches(self) -> int:
        """Patches per image: the convolution drops a remainder of fewer than ``patch_size`` pixels."""
        return (self.image_size // self.patch_size) ** 2

    def to_dict(self) -> dict:
        return {**super().to_dict(), "model_type": self.model_type}


class CLIPVisionOutput(eqx.Module):
    """What the CLIP image encoders return. ``pooler_output`` is the class token after ``post_layernorm``;
    ``hidden_states`` (if asked for) are the embeddings after ``pre_layrnorm`` and then each layer's output
    (``hidden_states[-1]`` is ``last_hidden_state``: no norm after the last layer), as transformers'."""

    last_hidden_state: Float[Array, "batch tokens embed"]
    pooler_output: Float[Array, "batch embed"]
    hidden_states: tuple[Float[Array, "batch tokens embed"], ...] | None = None
    image_embeds: Float[Array, "batch proj"] | None = None  # CLIPVisionModelWithProjection only


class CLIPVisionEmbeddings(eqx.Module):
    """Patch embeddings of a channels-last image, the class token in front, plus the position table."""

    PARAM_AXES: ClassVar = {"class_embedding": ("embed",)}

    class_embedding: Float[Array, " embed"]
    patch_embedding: nn.Conv2d
    position_embedding: nn.Embedding

    def __init__(self, config: CLIPVisionConfig, *, dtype, key: PRNGKeyArray):
        kc, kp, ke = jax.random.split(key, 3)
        self.class_embedding = nn.init_normal(kc, (config.hidden_size,), dtype)
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size,
                                         stride=config.patch_size, use_bias=False, dtype=dtype, key=kp)
        self.position_embedding = nn.Embedding(config.num_patches + 1, config.hidden_size, axes=("position", "embed"),
                                               dtype=dtype, key=ke)

    def __call__(self, pixel_values: Float[Array, "batch height width channels"]) -> Float[Array, "batch tokens embed"]:
        patches = self.patch_embedding(pixel_values.astype(self.patch_embedding.weight.dtype))
        batch, rows, cols, dim = patches.shape
        patches = patches.reshape(batch, rows * cols, dim)  # row-major patches, as torch's flatten(2)
        cls = jnp.broadcast_to(self.class_embedding.astype(patches.dtype), (batch, 1, dim))
        return jnp.concatenate([cls, patches], axis=1) + self.position_embedding.weight.astype(patches.dtype)


class CLIPVisionTransformer(eqx.Module):
    """Embeddings, ``pre_layrnorm``, encoder layers and ``post_layernorm``: transformers' ``vision_model``."""

    TORCH_RENAMES: ClassVar[dict[str, str]] = {"layers": "encoder.layers"}
    SCAN_FIELDS: ClassVar[tuple[str, ...]] = ("layers",)  # eqxdiff.nn.scan_layers stacks them
    CHECKPOINT_NAMES: ClassVar[tuple[str, ...]] = ("clip_vision_layer",)  # each layer's output, for Remat.NAMED

    embeddings: CLIPVisionEmbeddings
    pre_layrnorm: nn.LayerNorm
    layers: tuple[CLIPEncoderLayer, ...] | nn.Stacked[CLIPEncoderLayer]
    post_layernorm: nn.LayerNorm
    config: CLIPVisionConfig = eqx.field(static=True)
    plan: Plan | None = eqx.field(static=True, default=None)  # eqxdiff.parallel.with_plan sets it

    def __init__(self, config: CLIPVisionConfig, *, dtype=jnp.float32, key: PRNGKeyArray):
        ke, kl = jax.random.split(key)
        self.embeddings = CLIPVisionEmbeddings(config, dtype=dtype, key=ke)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        # CLIPEncoderLayer reads the sizes CLIPTextConfig and CLIPVisionConfig share
        self.layers = tuple(CLIPEncoderLayer(config, dtype=dtype, key=k)
                            for k in jax.random.split(kl, config.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        self.config = config

    def __call__(self, pixel_values, output_hidden_states: bool, caller: str) -> CLIPVisionOutput:
        size, channels = self.config.image_size, self.config.num_channels
        if pixel_values.shape[1:] != (size, size, channels):
            raise ValueError(f"{caller}: pixel_values must be [batch, {size}, {size}, {channels}] (channels-last, "
                             f"image_size={size}), got shape {pixel_values.shape}; resize and crop the images to "
                             f"{size}x{size} first (CLIPImageProcessor does); other sizes would need the position "
                             "table interpolated, which eqxdiff does not do")
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        tokens = ("batch", None, "embed")  # a few hundred tokens: not split over the context axis

        def step(layer, h):  # layer boundaries: sharding constraints and the remat policy
            h = checkpoint_block(layer, self.plan)(constrain(h, self.plan, tokens), None, causal=False)
            return checkpoint_name(h, "clip_vision_layer")

        embeddings = x
        x, outputs = nn.run_layers(self.layers, step, x, collect=output_hidden_states)
        return CLIPVisionOutput(last_hidden_state=x, pooler_output=self.post_layernorm(x[:, 0]),
                                hidden_states=(embeddings, *outputs) if output_hidden_states else None)


class CLIPVisionModel(PretrainedModel):
    """The CLIP image encoder without projection: Wan 2.1 image-to-video's ``image_encoder``.

    Reads both transformers 4 names (``vision_model.``-prefixed, perhaps with an old ``position_ids`` buffer) and
    the unprefixed names transformers 5 writes; writes the ``vision_model.`` names (which both load).
    """

    config_class: ClassVar[type] = CLIPVisionConfig
    CHECKPOINT_FORMAT: ClassVar[str] = "transformers"
    CHECKPOINT_KEY_MAP: ClassVar[tuple] = (
        (r"^(?=(embeddings|encoder|pre_layrnorm|post_layernorm)\.)", "vision_model."),)
    CHECKPOINT_IGNORE: ClassVar[tuple[str, ...]] = (r"vision_model\.embeddings\.position_ids",)

    vision_model: CLIPVisionTransformer
    config: CLIPVisionConfig = eqx.field(static=True)

    def __init__(self, config: CLIPVisionConfig, *, dtype=jnp.float32, key: PRNGKeyArray):
        self.vision_model = CLIPVisionTransformer(config, dtype=dtype, key=key)
        self.config = config

    @typechecked
    def __call__(self, pixel_values: Float[Array, "batch height width channels"], *,
                 output_hidden_states: bool = False) -> CLIPVisionOutput:
        """Encode ``pixel_values`` (``[batch, image_size, image_size, num_channels]``, normalised).
        ``output_hidden_states=True`` also returns the embeddings and each layer's output."""
        return self.vision_model(pixel_values, output_hidden_states, type(self).__name__)


class CLIPVisionModelWithProjection(PretrainedModel):
    """The CLIP image encoder with its ``visual_projection``: adds ``image_embeds`` (the projected
    ``pooler_output``) to the output."""

    config_class: ClassVar[type] = CLIPVisionConfig
    CHECKPOINT_FORMAT: ClassVar[str] = "transformers"
    CHECKPOINT_IGNORE: ClassVar[tuple[str, ...]] = (r"vision_model\.embeddings\.position_ids",)

    vision_model: CLIPVisionTransformer
    visual_projection: nn.Linear
    config: CLIPVisionConfig = eqx.field(static=True)

    def __init__(self, config: CLIPVisionConfig, *, dtype=jnp.float32, key: PRNGKeyArray):
        kv, kp = jax.random.split(key)
        self.vision_model = CLIPVisionTransformer(config, dtype=dtype, key=kv)
        self.visual_projection = nn.Linear(config.hidden_size, config.projection_dim, use_bias=False, dtype=dtype,
                                           key=kp)
        self.config = config

    @typechecked
    def __call__(self, pixel_values: Float[Array, "batch height width channels"], *,
                 output_hidden_states: bool = False) -> CLIPVisionOutput:
        """As :meth:`CLIPVisionModel.__call__`, plus ``image_embeds``."""
        out = self.vision_model(pixel_values, output_hidden_states, type(self).__name__)
        return dataclasses.replace(out, image_embeds=self.visual_projection(out.pooler_output))


__all__ = ["CLIPVisionConfig", "CLIPVisionModel", "CLIPVisionModelWithProjection", "CLIPVisionOutput"]
