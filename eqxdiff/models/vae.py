"""``AutoencoderKL``: the KL-regularised VAE of latent diffusion, with diffusers' parameter names and numerics.

Images and latents are channels-last: ``[batch, height, width, channels]``. ``encode`` returns a
:class:`DiagonalGaussian` over latents, ``decode`` maps latents back to images; ``decode_tiled`` /
``encode_tiled`` and ``batch_slice_size`` bound memory as diffusers' ``enable_tiling()`` / ``enable_slicing()``
do, with the same results. ``scale_latents`` / ``unscale_latents`` move between the VAE's latent space and the
normalised one a diffusion model works in.

:func:`eqxdiff.parallel.with_plan` gives the encoder and decoder a plan: their images are constrained to the
rules' ``("batch", "height", "width", "channels")`` sharding at every block boundary (the batch over data+fsdp, image
rows whole by default) and each block is rematerialised by the plan's remat policy.
"""

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from .._typing import Array, Float, PRNGKeyArray, typechecked
from ..core import ConfigError, ModelConfig, Plan, checkpoint_block, constrain
from ..nn import (
    Conv2d,
    Downsample2D,
    GroupNorm,
    ResnetBlock2D,
    SelfAttention,
    Upsample2D,
    silu,
)
from ._base import PretrainedModel, check_channels_last
from ._posterior import DiagonalGaussian
from ._tiling import blend_tiles

_EPS = 1e-6  # every norm in diffusers' VAE
_ACTIVATIONS = ("silu", "swish", "mish", "gelu", "relu")  # diffusers' get_activation table
_IMAGE = ("batch", "height", "width", "channels")  # logical axes of every image-shaped activation


@dataclasses.dataclass(frozen=True)
class AutoencoderKLConfig(ModelConfig):
    """diffusers' ``AutoencoderKL`` config.json. ``latents_mean``/``latents_std``/``force_upcast`` are carried for
    pipelines; the model itself only uses them in :meth:`AutoencoderKL.scale_latents`."""

    in_channels: int = 3
    out_channels: int = 3
    down_block_types: tuple[str, ...] = ("DownEncoderBlock2D",)
    up_block_types: tuple[str, ...] = ("UpDecoderBlock2D",)
    block_out_channels: tuple[int, ...] = (64,)
    layers_per_block: int = 1
    act_fn: str = "silu"
    latent_channels: int = 4
    norm_num_groups: int = 32
    sample_size: int | tuple[int, ...] = 32
    scaling_factor: float = 0.18215
    shift_factor: float | None = None
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None
    force_upcast: bool = True
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True

    def __post_init__(self):
        super().__post_init__()
        n = len(self.block_out_channels)
        self.check(n >= 1 and all(c > 0 for c in self.block_out_channels), "block_out_channels",
                   "must be a non-empty list of positive widths")
        self.check(all(t == "DownEncoderBlock2D" for t in self.down_block_types), "down_block_types",
                   "is not supported; eqxdiff supports only 'DownEncoderBlock2D' blocks")
        self.check(all(t == "UpDecoderBlock2D" for t in self.up_block_types), "up_block_types",
                   "is not supported; eqxdiff supports only 'UpDecoderBlock2D' blocks")
        self.check(len(self.down_block_types) == n, "down_block_types",
                   f"must have one entry per block_out_channels entry ({n})")
        self.check(len(self.up_block_types) == n, "up_block_types",
                   f"must have one entry per block_out_channels entry ({n})")
        self.check(self.act_fn in _ACTIVATIONS, "act_fn", f"is not supported; use one of {list(_ACTIVATIONS)}")
        self.check(self.layers_per_block >= 1, "layers_per_block", "must be at least 1")
        self.check(self.norm_num_groups > 0 and all(c % self.norm_num_groups == 0 for c in self.block_out_channels),
                   "norm_num_groups", f"must divide every block_out_channels entry {list(self.block_out_channels)}")
        for key in ("latents_mean", "latents_std"):
            value = getattr(self, key)
            self.check(value is None or len(value) == self.latent_channels, key,
                       f"must have latent_channels={self.latent_channels} entries")
        self.check(self.scaling_factor != 0, "scaling_factor", "must be non-zero")

    @property
    def downsample_factor(self) -> int:
        """Image pixels per latent pixel along each axis."""
        return 2 ** (len(self.block_out_channels) - 1)

    @property
    def temporal_factor(self) -> int:
        """Frames per latent frame: 1, an image VAE (the latent pipelines' VAE protocol: a video VAE says how it
        compresses time)."""
        return 1

    @property
    def tile_sample_min_size(self) -> int:
        """diffusers' default tile size for tiled encode/decode: ``sample_size`` (its first entry if a list)."""
        size = self.sample_size
        return int(size[0] if isinstance(size, tuple) else size)


class VAEAttentionBlock(eqx.Module):
    """diffusers' single-head spatial self-attention: ``x + attn(group_norm(x))`` over the ``height*width`` tokens."""

    CHECKPOINT_NAMES: ClassVar[tuple[str, ...]] = ("attention",)
    TORCH_RENAMES: ClassVar[dict[str, str]] = {"attn": ""}  # to_q, to_k ... sit beside group_norm

    group_norm: GroupNorm
    attn: SelfAttention
    plan: Plan | None = eqx.field(static=True, default=None)  # eqxdiff.parallel.with_plan sets it

    def __init__(self, channels: int, *, groups: int, dtype=jnp.float32, key: PRNGKeyArray):
        self.group_norm = GroupNorm(groups, channels, eps=_EPS, dtype=dtype)
        self.attn = SelfAttention(channels, heads=1, dim_head=channels, bias=True, dtype=dtype, key=key)

    @typechecked
    def __call__(self, x: Float[Array, "batch height width channels"]) -> Float[Array, "batch height width channels"]:
        b, h, w, c = x.shape
        tokens = constrain(self.group_norm(x).reshape(b, h * w, c), self.plan, ("batch", "seq", "embed"))
        # Back in image shape the rows are whole again (the rules' "height"), whatever "seq" split.
        out = constrain(self.attn(tokens).reshape(b, h, w, c), self.plan, _IMAGE)
        return checkpoint_name(x + out, "attention")


def _resnet(cin: int, cout: int, config: AutoencoderKLConfig, dtype, key) -> ResnetBlock2D:
    return ResnetBlock2D(cin, cout, temb_channels=None, groups=config.norm_num_groups, eps=_EPS,
                         act_fn=config.act_fn, dtype=dtype, key=key)


class MidBlock(eqx.Module):
    """``resnets[0]``, then (``attentions[0]`` if any, ``resnets[1]``), at the bottleneck width."""

    CHECKPOINT_NAMES: ClassVar[tuple[str, ...]] = ("resnet",)

    resnets: list[ResnetBlock2D]
    attentions: list[VAEAttentionBlock | None]

    def __init__(self, channels: int, config: AutoencoderKLConfig, *, dtype, key: PRNGKeyArray):
        k0, k1, ka = jax.random.split(key, 3)
        self.resnets = [_resnet(channels, channels, config, dtype, k0), _resnet(channels, channels, config, dtype, k1)]
        self.attentions = [VAEAttentionBlock(channels, groups=config.norm_num_groups, dtype=dtype, key=ka)
                           if config.mid_block_add_attention else None]

    @typechecked
    def __call__(self, x: Float[Array, "batch height width channels"]) -> Float[Array, "batch height width channels"]:
        x = checkpoint_name(self.resnets[0](x), "resnet")
        for attn, resnet in zip(self.attentions, self.resnets[1:]):
            x = checkpoint_name(resnet(x if attn is None else attn(x)), "resnet")
        return x


class DownEncoderBlock2D(eqx.Module):
    CHECKPOINT_NAMES: ClassVar[tuple[str, ...]] = ("resnet",)

    resnets: list[ResnetBlock2D]
    downsamplers: list[Downsample2D] | None

    def __init__(self, cin: int, cout: int, num_layers: int, add_downsample: bool, config: AutoencoderKLConfig, *,
                 dtype, key: PRNGKeyArray):
        keys = jax.random.split(key, num_layers + 1)
        self.resnets = [_resnet(cin if i == 0 else cout, cout, config, dtype, keys[i]) for i in range(num_layers)]
        self.downsamplers = [Downsample2D(cout, padding=0, dtype=dtype, key=keys[-1])] if add_downsample else None

    @typechecked
    def __call__(self, x: Float[Array, "batch height width cin"]) -> Float[Array, "batch h2 w2 cout"]:
        for resnet in self.resnets:
            x = checkpoint_name(resnet(x), "resnet")
        return x if self.downsamplers is None else self.downsamplers[0](x)


class UpDecoderBlock2D(eqx.Module):
    CHECKPOINT_NAMES: ClassVar[tuple[str, ...]] = ("resnet",)

    resnets: list[ResnetBlock2D]
    upsamplers: list[Upsample2D] | None

    def __init__(self, cin: int, cout: int, num_layers: int, add_upsample: bool, config: AutoencoderKLConfig, *,
                 dtype, key: PRNGKeyArray):
        keys = jax.random.split(key, num_layers + 1)
        self.resnets = [_resnet(cin if i == 0 else cout, cout, config, dtype, keys[i]) for i in range(num_layers)]
        self.upsamplers = [Upsample2D(cout, dtype=dtype, key=keys[-1])] if add_upsample else None

    @typechecked
    def __call__(self, x: Float[Array, "batch height width cin"]) -> Float[Array, "batch h2 w2 cout"]:
        for resnet in self.resnets:
            x = checkpoint_name(resnet(x), "resnet")
        return x if self.upsamplers is None else self.upsamplers[0](x)


class Encoder(eqx.Module):
    """Image -> Gaussian moments ``[mean, logvar]`` (``2 * latent_channels``), before ``quant_conv``."""

    conv_in: Conv2d
    down_blocks: list[DownEncoderBlock2D]
    mid_block: MidBlock
    conv_norm_out: GroupNorm
    conv_out: Conv2d
    plan: Plan | None = eqx.field(static=True, default=None)  # eqxdiff.parallel.with_plan sets it

    def __init__(self, config: AutoencoderKLConfig, *, dtype, key: PRNGKeyArray):
        widths = config.block_out_channels
        kin, kmid, kout, *kblocks = jax.random.split(key, 3 + len(widths))
        self.conv_in = Conv2d(config.in_channels, widths[0], 3, padding=1, dtype=dtype, key=kin)
        self.down_blocks = [
            DownEncoderBlock2D(widths[max(i - 1, 0)], w, config.layers_per_block, i < len(widths) - 1, config,
                               dtype=dtype, key=k) for i, (w, k) in enumerate(zip(widths, kblocks))]
        self.mid_block = MidBlock(widths[-1], config, dtype=dtype, key=kmid)
        self.conv_norm_out = GroupNorm(config.norm_num_groups, widths[-1], eps=_EPS, dtype=dtype)
        self.conv_out = Conv2d(widths[-1], 2 * config.latent_channels, 3, padding=1, dtype=dtype, key=kout)

    @typechecked
    def __call__(self, x: Float[Array, "batch height width channels"]) -> Float[Array, "batch h w moments"]:
        plan = self.plan
        x = constrain(self.conv_in(constrain(x, plan, _IMAGE)), plan, _IMAGE)
        for block in (*self.down_blocks, self.mid_block):  # block boundaries: sharding constraints and remat
            x = constrain(checkpoint_block(block, plan)(x), plan, _IMAGE)
        x = self.conv_out(silu(self.conv_norm_out(x)))  # diffusers' conv_act is SiLU whatever act_fn
        return constrain(x, plan, _IMAGE)


class Decoder(eqx.Module):
    """Latents (after ``post_quant_conv``) -> image."""

    conv_in: Conv2d
    mid_block: MidBlock
    up_blocks: list[UpDecoderBlock2D]
    conv_norm_out: GroupNorm
    conv_out: Conv2d
    plan: Plan | None = eqx.field(static=True, default=None)  # eqxdiff.parallel.with_plan sets it

    def __init__(self, config: AutoencoderKLConfig, *, dtype, key: PRNGKeyArray):
        widths = tuple(reversed(config.block_out_channels))
        kin, kmid, kout, *kblocks = jax.random.split(key, 3 + len(widths))
        self.conv_in = Conv2d(config.latent_channels, widths[0], 3, padding=1, dtype=dtype, key=kin)
        self.mid_block = MidBlock(widths[0], config, dtype=dtype, key=kmid)
        self.up_blocks = [
            UpDecoderBlock2D(widths[max(i - 1, 0)], w, config.layers_per_block + 1, i < len(widths) - 1, config,
                             dtype=dtype, key=k) for i, (w, k) in enumerate(zip(widths, kblocks))]
        self.conv_norm_out = GroupNorm(config.norm_num_groups, widths[-1], eps=_EPS, dtype=dtype)
        self.conv_out = Conv2d(widths[-1], config.out_channels, 3, padding=1, dtype=dtype, key=kout)

    @typechecked
    def __call__(self, z: Float[Array, "batch h w latent"]) -> Float[Array, "batch height width channels"]:
        plan = self.plan
        x = constrain(self.conv_in(constrain(z, plan, _IMAGE)), plan, _IMAGE)
        for block in (self.mid_block, *self.up_blocks):  # block boundaries: sharding constraints and remat
            x = constrain(checkpoint_block(block, plan)(x), plan, _IMAGE)
        return constrain(self.conv_out(silu(self.conv_norm_out(x))), plan, _IMAGE)


def _batch_sliced(fn: Callable, x, size: int | None):
    """``fn(x)`` computed ``size`` samples at a time (``lax.map``), so only one slice's activations are live."""
    if size is not None and (not isinstance(size, int) or size < 1):
        raise ValueError(f"batch_slice_size must be a positive int or None, got {size!r}")
    if size is None or size >= x.shape[0]:
        return fn(x)
    n = x.shape[0] // size
    main = jax.lax.map(fn, x[:n * size].reshape(n, size, *x.shape[1:]))
    out = main.reshape(n * size, *main.shape[2:])
    return out if n * size == x.shape[0] else jnp.concatenate([out, fn(x[n * size:])])


def _tiled(fn: Callable, x, tile_in: int, tile_out: int, overlap_factor: float):
    """diffusers' tiled encode/decode: ``fn`` on overlapping ``tile_in`` tiles of ``x``, blended, cropped, joined
    (:func:`eqxdiff.models._tiling.blend_tiles`, which the video VAEs share). Tiles of equal shape go through one
    ``lax.map``, so ``fn`` is compiled once per tile shape and only one tile's activations are live at a time."""
    stride = int(tile_in * (1 - overlap_factor))
    extent = int(tile_out * overlap_factor)
    limit = tile_out - extent
    if stride < 1 or limit < 1:
        raise ValueError(f"tile size {tile_in} with tile_overlap_factor={overlap_factor} leaves no stride; use a "
                         "larger tile or a smaller overlap")
    return blend_tiles(fn, x, axes=(1, 2), tile=(tile_in, tile_in), stride=(stride, stride),
                       blend_extent=(extent, extent), keep=(limit, limit))


class AutoencoderKL(PretrainedModel):
    """diffusers' ``AutoencoderKL`` on channels-last tensors. Build with ``AutoencoderKL(config, key=...)`` or load
    with ``eqxdiff.load(folder)``."""

    config_class: ClassVar[type] = AutoencoderKLConfig

    encoder: Encoder
    decoder: Decoder
    quant_conv: Conv2d | None
    post_quant_conv: Conv2d | None
    config: AutoencoderKLConfig = eqx.field(static=True)

    def __init__(self, config: AutoencoderKLConfig, *, dtype=jnp.float32, key: PRNGKeyArray):
        kenc, kdec, kq, kpq = jax.random.split(key, 4)
        lat = config.latent_channels
        self.encoder = Encoder(config, dtype=dtype, key=kenc)
        self.decoder = Decoder(config, dtype=dtype, key=kdec)
        self.quant_conv = Conv2d(2 * lat, 2 * lat, 1, dtype=dtype, key=kq) if config.use_quant_conv else None
        self.post_quant_conv = Conv2d(lat, lat, 1, dtype=dtype, key=kpq) if config.use_post_quant_conv else None
        self.config = config

    # -- checks ------------------------------------------------------------------------------------------------
    def _check(self, x, channels: int, what: str, method: str) -> None:
        check_channels_last("AutoencoderKL", method, what, x, channels, "height, width")
        if x.shape[1] < 1 or x.shape[2] < 1:
            raise ValueError(f"AutoencoderKL.{method}: {what} has an empty spatial axis, shape {x.shape}")

    def _tile_sizes(self, tile_sample_min_size: int | None) -> tuple[int, int]:
        size = self.config.tile_sample_min_size if tile_sample_min_size is None else tile_sample_min_size
        factor = self.config.downsample_factor
        if not isinstance(size, int) or size < factor:
            raise ValueError(f"tile_sample_min_size must be an int of at least downsample_factor={factor}, "
                             f"got {size!r}")
        return size, int(size / factor)  # diffusers' tile_latent_min_size

    # -- encode ------------------------------------------------------------------------------------------------
    def _moments(self, x):
        h = self.encoder(x)
        return h if self.quant_conv is None else self.quant_conv(h)

    @typechecked
    def encode(self, x: Float[Array, "batch height width channels"], *,
               batch_slice_size: int | None = None) -> DiagonalGaussian:
        """The posterior over latents of images ``x``; ``batch_slice_size`` encodes that many images at a time."""
        self._check(x, self.config.in_channels, "images", "encode")
        return DiagonalGaussian.from_moments(_batch_sliced(self._moments, x, batch_slice_size))

    @typechecked
    def encode_tiled(self, x: Float[Array, "batch height width channels"], *, tile_sample_min_size: int | None = None,
                     tile_overlap_factor: float = 0.25) -> DiagonalGaussian:
        """``encode`` over overlapping tiles, blended as diffusers' ``enable_tiling()`` does (and, like it, the plain
        ``encode`` when ``x`` fits in one tile). Tiles default to ``config.sample_size`` pixels."""
        self._check(x, self.config.in_channels, "images", "encode_tiled")
        tile, latent = self._tile_sizes(tile_sample_min_size)
        if x.shape[1] <= tile and x.shape[2] <= tile:
            return self.encode(x)
        return DiagonalGaussian.from_moments(_tiled(self._moments, x, tile, latent, tile_overlap_factor))

    # -- decode ------------------------------------------------------------------------------------------------
    def _decode(self, z):
        return self.decoder(z if self.post_quant_conv is None else self.post_quant_conv(z))

    @typechecked
    def decode(self, z: Float[Array, "batch h w latent"], *,
               batch_slice_size: int | None = None) -> Float[Array, "batch height width out_channels"]:
        """Images from (unscaled) latents ``z``; ``batch_slice_size`` decodes that many at a time, same result."""
        self._check(z, self.config.latent_channels, "latents", "decode")
        return _batch_sliced(self._decode, z, batch_slice_size)

    @typechecked
    def decode_tiled(self, z: Float[Array, "batch h w latent"], *, tile_sample_min_size: int | None = None,
                     tile_overlap_factor: float = 0.25) -> Float[Array, "batch height width out_channels"]:
        """``decode`` over overlapping latent tiles of ``tile_sample_min_size // downsample_factor``, blended as
        diffusers' ``enable_tiling()`` does (and, like it, the plain ``decode`` when ``z`` fits in one tile)."""
        self._check(z, self.config.latent_channels, "latents", "decode_tiled")
        tile, latent = self._tile_sizes(tile_sample_min_size)
        if z.shape[1] <= latent and z.shape[2] <= latent:
            return self.decode(z)
        return _tiled(self._decode, z, latent, tile, tile_overlap_factor)

    @typechecked
    def __call__(self, x: Float[Array, "batch height width channels"], *, key: PRNGKeyArray | None = None,
                 sample_posterior: bool = False) -> Float[Array, "batch height2 width2 out_channels"]:
        """Reconstruct ``x``: decode the posterior's mode or, with ``sample_posterior=True``, a sample drawn with
        ``key`` (diffusers' ``forward``)."""
        if sample_posterior and key is None:
            raise ValueError("AutoencoderKL: sample_posterior=True needs a PRNG key: pass key=jax.random.key(0)")
        posterior = self.encode(x)
        return self.decode(posterior.sample(key=key) if sample_posterior else posterior.mode())

    # -- latent normalisation ----------------------------------------------------------------------------------
    def _latent_stats(self, z, norm: str):
        """``(mean, std)`` such that the diffusion model sees ``(z - mean) * scaling_factor / std``."""
        c = self.config
        if norm not in LATENT_NORMS:
            raise ValueError(f"AutoencoderKL: norm={norm!r}; use one of {list(LATENT_NORMS)}")
        if norm in ("full", "mean_std") and c.latents_mean is not None and c.latents_std is not None:
            return jnp.asarray(c.latents_mean, z.dtype), jnp.asarray(c.latents_std, z.dtype)
        return (c.shift_factor or 0.0) if norm in ("full", "shift") else 0.0, 1.0

    @typechecked
    def scale_latents(self, z: Float[Array, "*batch latent"], *, norm: str = "full") -> Float[Array, "*batch latent"]:
        """VAE latents -> diffusion latents: ``(z - shift_factor) * scaling_factor`` (per-channel ``latents_mean``
        and ``latents_std``, when the config sets both, take the place of the shift: ``(z - mean) * scale / std``).
        ``norm`` keeps what a pipeline family's diffusers code reads (:data:`LATENT_NORMS`): ``"full"`` both,
        ``"shift"`` the shift only (Flux), ``"mean_std"`` the statistics only (SDXL), ``"scale"`` neither (SD)."""
        mean, std = self._latent_stats(z, norm)
        return (z - mean) * self.config.scaling_factor / std

    @typechecked
    def unscale_latents(self, z: Float[Array, "*batch latent"], *, norm: str = "full") -> Float[Array, "*batch latent"]:
        """The inverse of :meth:`scale_latents`: ``z / scaling_factor + shift_factor``, ready for :meth:`decode`."""
        mean, std = self._latent_stats(z, norm)
        return z * std / self.config.scaling_factor + mean


LATENT_NORMS = ("full", "shift", "mean_std", "scale")

__all__ = ["AutoencoderKL", "AutoencoderKLConfig", "DiagonalGaussian", "ConfigError", "LATENT_NORMS"]
