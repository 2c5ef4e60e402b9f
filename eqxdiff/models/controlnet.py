"""``ControlNetModel``: a UNet's encoder (its down and mid blocks, with the UNet's own names) that reads a control
image and returns residuals for the UNet's skips and mid block; SD 1.x/2.x and SDXL (``text_time``), loadable from
diffusers folders.

>>> controlnet = eqxdiff.load("path/to/controlnet")
>>> down, mid = controlnet(latents, t, text_states, control_image)    # control_image [batch, H, W, 3] in [0, 1]
>>> eps = unet(latents, t, text_states, down_block_additional_residuals=down, mid_block_additional_residual=mid)
"""

import dataclasses
import itertools
from typing import ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._typing import Array, Float, Int, PRNGKeyArray, typechecked
from ..core import ConfigError, Plan, constrain
from ..nn import Conv2d, Embedding, Linear, TimestepEmbedding, build_abstract, silu
from ._base import PretrainedModel
from ._unet_blocks import DownBlock, MidBlock
from ._unet_encoder import (
    IMAGE,
    build_class_embedding,
    build_encoder,
    check_conditioning,
    embed_class,
    embed_time,
    run_encoder,
)
from .unet2d import MID_BLOCK_TYPES, TimestepLike, UNet2DConditionConfig, UNet2DConditionModel

__all__ = ["ControlNetConditioningEmbedding", "ControlNetConfig", "ControlNetModel", "ControlNetOutput",
           "MultiControlNetModel"]

# Keys of a UNet config that diffusers' ControlNetModel does not have. A ControlNet config keeps them at their
# defaults (the encoder they describe is the one ControlNetModel builds) and never writes them.
_UNET_ONLY = ("sample_size", "out_channels", "center_input_sample", "up_block_types", "dropout",
              "reverse_transformer_layers_per_block", "dual_cross_attention", "resnet_skip_time_act",
              "resnet_out_scale_factor", "time_embedding_type", "time_embedding_dim", "time_embedding_act_fn",
              "timestep_post_act", "time_cond_proj_dim", "conv_in_kernel", "conv_out_kernel", "attention_type",
              "class_embeddings_concat", "mid_block_only_cross_attention", "cross_attention_norm")
_DERIVED = ("up_block_types", "reverse_transformer_layers_per_block")  # set from the down path, never read
# Of those, the ones a UNet's encoder depends on: from_unet refuses a UNet that sets them.
_ENCODER_KEYS = ("center_input_sample", "time_embedding_type", "time_embedding_dim", "time_embedding_act_fn",
                 "timestep_post_act", "time_cond_proj_dim", "conv_in_kernel", "dual_cross_attention",
                 "class_embeddings_concat")


def _mirror(down_block_types: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(t.replace("Down", "Up") for t in reversed(down_block_types))


@dataclasses.dataclass(frozen=True)
class ControlNetConfig(UNet2DConditionConfig):
    """diffusers' ``ControlNetModel`` config.json: the encoder keys of :class:`UNet2DConditionConfig` (same names,
    defaults and checks) plus the control image's. The up path a UNet config describes is here the mirror of the
    down path (the UNet this ControlNet was made from); it is not written to config.json.

    ``conditioning_embedding_out_channels``: widths of the control image's embedding, which downsamples by
    ``2 ** (len - 1)`` (the VAE's factor, 8 for the default ``(16, 32, 96, 256)``).
    ``controlnet_conditioning_channel_order="bgr"``: the control image's channels are reversed first.
    ``global_pool_conditions``: residuals are spatial means (the "shuffle" ControlNets).

    As diffusers' ``ControlNetModel``: the class embedding (``class_labels``) is always added, a ``"timestep"`` one
    uses SiLU whatever ``act_fn``, and ``"simple_projection"`` builds none (no class embedding);
    ``encoder_hid_dim`` builds ``encoder_hid_proj`` but the forward never applies it, so the text states are
    ``cross_attention_dim`` wide."""

    SUPPORTED_VALUES: ClassVar = {
        **UNet2DConditionConfig.SUPPORTED_VALUES,
        "mid_block_type": tuple(t for t in MID_BLOCK_TYPES if t is not None),
        "controlnet_conditioning_channel_order": ("rgb", "bgr"),
    }

    up_block_types: tuple[str, ...] | None = None  # derived: the mirror of down_block_types (_DERIVED)
    conditioning_channels: int = 3
    controlnet_conditioning_channel_order: str = "rgb"
    conditioning_embedding_out_channels: tuple[int, ...] = (16, 32, 96, 256)
    global_pool_conditions: bool = False

    def __post_init__(self):
        for f in dataclasses.fields(UNet2DConditionConfig):
            if f.name in _UNET_ONLY and f.name not in _DERIVED and getattr(self, f.name) != f.default:
                raise ConfigError(f"{type(self).__name__}: {f.name}={getattr(self, f.name)!r} is not a ControlNet "
                                  f"setting (diffusers' ControlNetModel has no {f.name}); leave it at "
                                  f"{f.default!r}")
        # The up path, derived from the down path whatever was passed (dataclasses.replace passes the old one).
        object.__setattr__(self, "up_block_types", _mirror(tuple(self.down_block_types)))
        tl, reverse = self.transformer_layers_per_block, None
        if isinstance(tl, (list, tuple)) and any(isinstance(t, (list, tuple)) for t in tl):
            # per-layer depths: mirror them too (the up path has one more layer per block than the down path)
            reverse = tuple(tuple(t) + tuple(t[-1:]) if isinstance(t, (list, tuple)) else t for t in reversed(tl))
        object.__setattr__(self, "reverse_transformer_layers_per_block", reverse)
        super().__post_init__()
        self.check(isinstance(self.layers_per_block, int), "layers_per_block", "must be one number for a ControlNet "
                   "(diffusers' ControlNetModel takes no per-block list)")
        self.check(isinstance(self.cross_attention_dim, int), "cross_attention_dim", "must be one number for a "
                   "ControlNet (diffusers' ControlNetModel takes no per-block list)")
        self.check(len(self.conditioning_embedding_out_channels) >= 1, "conditioning_embedding_out_channels",
                   "must list at least one width")

    @classmethod
    def from_unet_config(cls, unet: UNet2DConditionConfig, **controlnet_keys) -> "ControlNetConfig":
        """The config of a ControlNet made from a UNet of config ``unet`` (diffusers' ``ControlNetModel.from_unet``);
        ``controlnet_keys`` set ``conditioning_embedding_out_channels``, ``conditioning_channels`` ..."""
        changed = [f.name for f in dataclasses.fields(UNet2DConditionConfig)
                   if f.name in _ENCODER_KEYS and getattr(unet, f.name) != f.default]
        if changed:
            raise ConfigError(f"{cls.__name__}: a ControlNet cannot copy this UNet's encoder: it sets "
                              f"{', '.join(f'{k}={getattr(unet, k)!r}' for k in changed)}, which diffusers' "
                              "ControlNetModel does not have")
        keys = {f.name: getattr(unet, f.name) for f in dataclasses.fields(UNet2DConditionConfig)
                if f.name not in _UNET_ONLY}
        return cls(**keys, **controlnet_keys)

    def to_dict(self) -> dict:
        return {k: v for k, v in super().to_dict().items() if k not in _UNET_ONLY}

    @property
    def has_class_embedding(self) -> bool:
        return super().has_class_embedding and self.class_embed_type != "simple_projection"

    @property
    def context_dim(self) -> int | None:
        """The text states' width: ``cross_attention_dim`` (``encoder_hid_proj`` is never applied)."""
        return self.cross_attention_dim if self.attention_specs else None

    @property
    def conditioning_downscale(self) -> int:
        """How much smaller than the control image the latents are."""
        return 2 ** (len(self.conditioning_embedding_out_channels) - 1)

    @property
    def num_residuals(self) -> int:
        """How many down residuals a ControlNet returns: one per skip of the UNet (conv_in's, each layer's, each
        downsampler's)."""
        return 1 + sum(b.num_layers + b.downsample for b in self.down_blocks)


class ControlNetOutput(NamedTuple):
    """Residuals for the UNet, channels-last: one per skip (``down_block_additional_residuals``) and the mid
    block's (``mid_block_additional_residual``)."""

    down_block_res_samples: tuple[Float[Array, "batch _ _ _"], ...]
    mid_block_res_sample: Float[Array, "batch _ _ _"]


def _zero_conv(cin: int, cout: int, kernel: int, *, dtype) -> Conv2d:
    """A convolution with zero weights and bias (diffusers' ``zero_module``): a new ControlNet starts as a no-op."""
    shapes = eqx.filter_eval_shape(Conv2d, cin, cout, kernel, padding=kernel // 2, dtype=dtype, key=jax.random.key(0))
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


class ControlNetConditioningEmbedding(eqx.Module):
    """The control image to ``conv_in``'s width and the latents' size: ``conv_in``, then per stage a 3x3 conv and a
    stride-2 3x3 conv (``blocks.{2i}``, ``blocks.{2i+1}``), SiLU after each, and a zero-initialised ``conv_out``."""

    conv_in: Conv2d
    blocks: list[Conv2d]
    conv_out: Conv2d

    def __init__(self, out_channels: int, *, conditioning_channels: int = 3,
                 block_out_channels: tuple[int, ...] = (16, 32, 96, 256), dtype=jnp.float32, key: PRNGKeyArray):
        kin, kb = jax.random.split(key)
        widths = block_out_channels
        self.conv_in = Conv2d(conditioning_channels, widths[0], 3, padding=1, dtype=dtype, key=kin)
        keys = iter(jax.random.split(kb, 2 * max(len(widths) - 1, 1)))
        self.blocks = []
        for cin, cout in itertools.pairwise(widths):
            self.blocks.append(Conv2d(cin, cin, 3, padding=1, dtype=dtype, key=next(keys)))
            self.blocks.append(Conv2d(cin, cout, 3, stride=2, padding=1, dtype=dtype, key=next(keys)))
        self.conv_out = _zero_conv(widths[-1], out_channels, 3, dtype=dtype)

    @typechecked
    def __call__(self, x: Float[Array, "batch height width cin"]) -> Float[Array, "batch h w cout"]:
        x = silu(self.conv_in(x))
        for conv in self.blocks:
            x = silu(conv(x))
        return self.conv_out(x)


class ControlNetModel(PretrainedModel):
    """A ControlNet on channels-last latents; parameter names are diffusers' state-dict names (the UNet's for
    ``conv_in``, ``time_embedding``, ``add_embedding``, ``down_blocks``, ``mid_block``).

    Built zero-initialised where diffusers is (``controlnet_cond_embedding.conv_out``, ``controlnet_down_blocks``,
    ``controlnet_mid_block``): a new ControlNet adds nothing to its UNet until trained."""

    config_class: ClassVar[type] = ControlNetConfig
    CHECKPOINT_NAMES: ClassVar[tuple[str, ...]] = ("resnet", "transformer")  # tagged by its down and mid blocks

    conv_in: Conv2d
    time_embedding: TimestepEmbedding
    add_embedding: TimestepEmbedding | None
    class_embedding: TimestepEmbedding | Embedding | None
    encoder_hid_proj: Linear | None  # built and loaded, never applied (as diffusers)
    controlnet_cond_embedding: ControlNetConditioningEmbedding
    down_blocks: list[DownBlock]
    controlnet_down_blocks: list[Conv2d]
    mid_block: MidBlock
    controlnet_mid_block: Conv2d
    config: ControlNetConfig = eqx.field(static=True)
    plan: Plan | None = eqx.field(static=True, default=None)  # eqxdiff.parallel.with_plan sets it

    def __init__(self, config: ControlNetConfig, *, dtype=jnp.float32, key: PRNGKeyArray):
        c = config
        kin, kt, ka, kd, km, kc = jax.random.split(key, 6)
        self.conv_in, self.time_embedding, self.add_embedding, self.down_blocks, self.mid_block = build_encoder(
            c, dtype=dtype, keys=(kin, kt, ka, kd, km))
        self.class_embedding = build_class_embedding(c, dtype, jax.random.fold_in(key, 7), act_fn="silu") \
            if c.has_class_embedding else None
        self.encoder_hid_proj = Linear(c.encoder_hid_dim, c.cross_attention_dim, dtype=dtype, key=jax.random.fold_in(
            key, 8)) if c.encoder_hid_dim_type == "text_proj" else None
        self.controlnet_cond_embedding = ControlNetConditioningEmbedding(
            c.block_out_channels[0], conditioning_channels=c.conditioning_channels,
            block_out_channels=c.conditioning_embedding_out_channels, dtype=dtype, key=kc)
        widths = [c.block_out_channels[0]] + [b.out_channels for b in c.down_blocks
                                              for _ in range(b.num_layers + b.downsample)]
        self.controlnet_down_blocks = [_zero_conv(w, w, 1, dtype=dtype) for w in widths]
        self.controlnet_mid_block = _zero_conv(c.block_out_channels[-1], c.block_out_channels[-1], 1, dtype=dtype)
        self.config = config

    @classmethod
    def from_unet(cls, unet: UNet2DConditionModel, *, conditioning_embedding_out_channels=(16, 32, 96, 256),
                  controlnet_conditioning_channel_order: str = "rgb", conditioning_channels: int = 3,
                  load_weights_from_unet: bool = True, key: PRNGKeyArray | None = None) -> "ControlNetModel":
        """A new ControlNet for ``unet`` (diffusers' ``ControlNetModel.from_unet``): its config, and with
        ``load_weights_from_unet`` its encoder's weights; the control-specific layers are new (``key``), their
        last convolutions zero."""
        config = ControlNetConfig.from_unet_config(
            unet.config, conditioning_embedding_out_channels=tuple(conditioning_embedding_out_channels),
            controlnet_conditioning_channel_order=controlnet_conditioning_channel_order,
            conditioning_channels=conditioning_channels)
        dtype, key = unet.conv_in.weight.dtype, jax.random.key(0) if key is None else key
        if not load_weights_from_unet:
            return cls(config, dtype=dtype, key=key)
        return cls.with_unet_encoder(config, unet, key=key)

    @classmethod
    def with_unet_encoder(cls, config: ControlNetConfig, unet: UNet2DConditionModel, *,
                          key: PRNGKeyArray) -> "ControlNetModel":
        """A ControlNet of ``config`` (made from ``unet``'s: :meth:`ControlNetConfig.from_unet_config`) holding
        ``unet``'s encoder weights (``conv_in``, the time, added and class embeddings, ``encoder_hid_proj``, the down
        and mid blocks); the control image's embedding is new (``key``), the residual convolutions zeros."""
        dtype = unet.conv_in.weight.dtype
        model = build_abstract(cls, config, dtype=dtype, key=key)  # built abstractly: nothing random is overwritten
        fresh = lambda m: (m.controlnet_cond_embedding, m.controlnet_down_blocks, m.controlnet_mid_block)
        embedding = ControlNetConditioningEmbedding(
            config.block_out_channels[0], conditioning_channels=config.conditioning_channels,
            block_out_channels=config.conditioning_embedding_out_channels, dtype=dtype, key=key)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), fresh(model)[1:])
        shared = lambda m: (m.conv_in, m.time_embedding, m.add_embedding, m.class_embedding, m.encoder_hid_proj,
                            m.down_blocks, m.mid_block)
        parts = shared(unet)
        if model.class_embedding is None:  # "simple_projection": diffusers' ControlNet builds (and copies) none
            parts = (*parts[:3], None, *parts[4:])
        model = eqx.tree_at(shared, model, parts, is_leaf=lambda x: x is None)
        return eqx.tree_at(fresh, model, (embedding, *zeros))

    @typechecked
    def __call__(
        self,
        sample: Float[Array, "batch height width channels"],
        timestep: TimestepLike,
        encoder_hidden_states: Float[Array, "batch seq cross_dim"],
        controlnet_cond: Float[Array, "batch cond_height cond_width cond_channels"],
        *,
        conditioning_scale: float | int | Float[Array, ""] = 1.0,  # noqa: PYI041 (beartype: an int is no float)
        guess_mode: bool = False,
        text_embeds: Float[Array, "batch text_embed"] | None = None,
        time_ids: Float[Array, "batch num_time_ids"] | Int[Array, "batch num_time_ids"] | None = None,
        class_labels: Float[Array, "..."] | Int[Array, "..."] | None = None,
    ) -> ControlNetOutput:
        """Residuals for a UNet denoising ``sample`` at ``timestep``, steered by ``controlnet_cond`` (the control
        image, channels-last, ``conditioning_downscale`` times the latents' size, in ``[0, 1]`` as the pipelines
        prepare it).

        ``conditioning_scale`` multiplies every residual (a number, or a traced scalar: the pipelines turn a
        ControlNet off outside its ``control_guidance_start/end`` with it). ``guess_mode`` scales the residuals from
        0.1 (first skip) to 1 (mid block) on a log scale, unless the config has ``global_pool_conditions``. SDXL
        ControlNets (``text_time``) also need the pooled ``text_embeds`` and the ``time_ids``; one with a class
        embedding its ``class_labels`` (as :class:`~eqxdiff.models.unet2d.UNet2DConditionModel`).
        """
        c = self.config
        check_conditioning(self, sample, encoder_hidden_states, text_embeds, time_ids)
        b = sample.shape[0]
        self.check_control_image(sample, controlnet_cond)
        dtype = sample.dtype
        if c.controlnet_conditioning_channel_order == "bgr":
            controlnet_cond = jnp.flip(controlnet_cond, axis=-1)
        emb = embed_time(self, timestep, b, dtype, text_embeds=text_embeds, time_ids=time_ids,
                         class_emb=embed_class(self, class_labels, b))
        context = encoder_hidden_states.astype(dtype)

        plan = self.plan
        h = self.conv_in(constrain(sample, plan, IMAGE))
        h = h + self.controlnet_cond_embedding(controlnet_cond.astype(dtype))
        return self.residuals(h, emb, context, conditioning_scale=conditioning_scale, guess_mode=guess_mode)

    def check_control_image(self, sample, controlnet_cond, what: str = "controlnet_cond") -> None:
        """Raise ``ValueError`` naming the fix unless ``controlnet_cond`` fits ``sample`` (channels-last, the
        latents' size times :attr:`ControlNetConfig.conditioning_downscale`)."""
        c = self.config
        b, height, width, _ = sample.shape
        f = c.conditioning_downscale
        want = (b, height * f, width * f, c.conditioning_channels)
        if controlnet_cond.shape != want:
            raise ValueError(f"{type(self).__name__}: {what} must be {list(want)} = [batch, height * {f}, "
                             f"width * {f}, conditioning_channels] (channels-last, the latents' size times "
                             f"2 ** (len(conditioning_embedding_out_channels) - 1)), got shape "
                             f"{controlnet_cond.shape}")

    def residuals(self, h, emb, context, *, conditioning_scale, guess_mode: bool) -> ControlNetOutput:
        """The residuals from ``h`` (``conv_in``'s output with the control image's embedding added), the time
        embedding ``emb`` and the text ``context``: the down and mid blocks, the zero convolutions, the scales and
        the pooling of :meth:`__call__` (a ControlNet variant fusing its controls its own way reuses them)."""
        c, plan = self.config, self.plan
        h, skips = run_encoder(self, constrain(h, plan, IMAGE), emb, context, None)
        down = [conv(s) for conv, s in zip(self.controlnet_down_blocks, skips)]
        mid = self.controlnet_mid_block(h)

        n = len(down)
        if guess_mode and not c.global_pool_conditions:
            scales = jnp.asarray(np.logspace(-1, 0, n + 1), jnp.float32) * conditioning_scale
        else:
            scales = jnp.full((n + 1,), conditioning_scale, jnp.float32)
        scales = scales.astype(h.dtype)
        down = [r * scales[i] for i, r in enumerate(down)]
        mid = mid * scales[n]
        if c.global_pool_conditions:
            down = [jnp.mean(r, axis=(1, 2), keepdims=True) for r in down]
            mid = jnp.mean(mid, axis=(1, 2), keepdims=True)
        return ControlNetOutput(tuple(constrain(r, plan, IMAGE) for r in down), constrain(mid, plan, IMAGE))


class MultiControlNetModel(eqx.Module):
    """Several ControlNets steering one UNet, each with its own control image and scale; their residuals are
    summed (diffusers' ``MultiControlNetModel``; a pipeline folder holds them as ``controlnet``, ``controlnet_1``,
    ...)."""

    nets: tuple[ControlNetModel, ...]

    def __init__(self, nets):
        self.nets = tuple(nets)
        if not self.nets or not all(isinstance(n, ControlNetModel) for n in self.nets):
            raise TypeError(f"MultiControlNetModel takes ControlNetModels, got {[type(n).__name__ for n in nets]}")

    def __call__(self, sample, timestep, encoder_hidden_states, controlnet_cond, *, conditioning_scale,
                 guess_mode: bool = False, text_embeds=None, time_ids=None, class_labels=None) -> ControlNetOutput:
        """As :meth:`ControlNetModel.__call__`, with one control image and one scale (numbers or a ``[nets]``
        array) per net."""
        if len(controlnet_cond) != len(self.nets) or len(conditioning_scale) != len(self.nets):
            raise ValueError(f"MultiControlNetModel: {len(self.nets)} ControlNets need as many control images and "
                             f"scales, got {len(controlnet_cond)} images and {len(conditioning_scale)} scales")
        down = mid = None
        for net, image, scale in zip(self.nets, controlnet_cond, conditioning_scale):
            d, m = net(sample, timestep, encoder_hidden_states, image, conditioning_scale=scale,
                       guess_mode=guess_mode, text_embeds=text_embeds, time_ids=time_ids, class_labels=class_labels)
            down, mid = (d, m) if down is None else (tuple(a + b for a, b in zip(down, d)), mid + m)
        return ControlNetOutput(down, mid)
