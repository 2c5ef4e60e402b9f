"""The config of :class:`~eqxdiff.models.ltx_vae.AutoencoderKLLTXVideo` and the block layout it describes.

diffusers builds the encoder and decoder from parallel tuples (widths, layers, scalings, noise, residual upsampling,
factors), the decoder's read in reverse. :meth:`AutoencoderKLLTXVideoConfig.encoder_blocks` and
:meth:`~AutoencoderKLLTXVideoConfig.decoder_blocks` turn them into one record per block, in the order the blocks
run; the model is built from these records, and so are the original (Lightricks) checkpoint names
(:func:`eqxdiff.loading.formats.ltx_vae`), which number the same sub-blocks in that order.
"""

import dataclasses
import math
from typing import ClassVar, NamedTuple

from ..core import ModelConfig

BLOCK_TYPES = ("LTXVideoDownBlock3D", "LTXVideo095DownBlock3D")
DOWNSAMPLE_STRIDES = {"conv": (2, 2, 2), "spatial": (1, 2, 2), "temporal": (2, 1, 1), "spatiotemporal": (2, 2, 2)}


class EncoderBlock(NamedTuple):
    """One encoder block: ``layers`` ResNet blocks of ``cin``, a downsampler (``None``, ``"conv"``: a stride-2
    convolution; ``"spatial"``, ``"temporal"``, ``"spatiotemporal"``: 0.9.5's space-to-depth to ``cout``), and
    ``conv_out`` (a ResNet block ``cin -> cout``: the 0.9.0 block when the width changes)."""

    cin: int
    cout: int
    layers: int
    downsample: str | None
    conv_out: bool


class DecoderBlock(NamedTuple):
    """One decoder block: ``conv_in`` (a ResNet block ``cin -> cout``), an upsampler (depth-to-space by 2 in
    time and space from ``cout * factor`` channels; ``residual``: 0.9.1+), ``layers`` ResNet blocks of ``cout``;
    ``inject``: its ResNet blocks add noise."""

    cin: int
    cout: int
    layers: int
    upsample: bool
    residual: bool
    factor: int
    inject: bool

    @property
    def conv_in(self) -> bool:
        return self.cin != self.cout


@dataclasses.dataclass(frozen=True)
class AutoencoderKLLTXVideoConfig(ModelConfig):
    """diffusers' ``AutoencoderKLLTXVideo`` config.json (defaults: LTX-Video 0.9.0). 0.9.1 adds decoder timestep
    conditioning, noise injection and residual upsampling with ``upsample_factor`` 2; 0.9.5+ encodes with
    ``LTXVideo095DownBlock3D`` and space-to-depth ``downsample_type`` s. ``latents_mean`` / ``latents_std`` are not
    config: they are tensors of the checkpoint (leaves of the model)."""

    SUPPORTED_VALUES: ClassVar = {"patch_size_t": (1,)}  # diffusers' own VAE runs only patch_size_t=1

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 128
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    down_block_types: tuple[str, ...] = ("LTXVideoDownBlock3D",) * 4
    decoder_block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: tuple[int, ...] = (4, 3, 3, 3, 4)
    decoder_layers_per_block: tuple[int, ...] = (4, 3, 3, 3, 4)
    spatio_temporal_scaling: tuple[bool, ...] = (True, True, True, False)
    decoder_spatio_temporal_scaling: tuple[bool, ...] = (True, True, True, False)
    decoder_inject_noise: tuple[bool, ...] = (False,) * 5
    downsample_type: tuple[str, ...] = ("conv",) * 4
    upsample_residual: tuple[bool, ...] = (False,) * 4
    upsample_factor: tuple[int, ...] = (1,) * 4
    timestep_conditioning: bool = False
    patch_size: int = 4
    patch_size_t: int = 1
    resnet_norm_eps: float = 1e-6
    scaling_factor: float = 1.0
    encoder_causal: bool = True
    decoder_causal: bool = False
    spatial_compression_ratio: int | None = None
    temporal_compression_ratio: int | None = None

    def __post_init__(self):
        super().__post_init__()
        for key in ("in_channels", "out_channels", "latent_channels", "patch_size"):
            self.check(getattr(self, key) > 0, key, "must be a positive integer")
        for key in ("block_out_channels", "decoder_block_out_channels", "upsample_factor"):
            self.check(all(v > 0 for v in getattr(self, key)), key, "must hold positive integers")
        for key in ("layers_per_block", "decoder_layers_per_block"):  # 0: a block of no ResNet blocks, as diffusers
            self.check(all(v >= 0 for v in getattr(self, key)), key, "must hold non-negative integers")
        self.check(all(t in BLOCK_TYPES for t in self.down_block_types), "down_block_types",
                   f"entries must be one of {BLOCK_TYPES}")
        self.check(all(t in DOWNSAMPLE_STRIDES for t in self.downsample_type), "downsample_type",
                   f"entries must be one of {tuple(DOWNSAMPLE_STRIDES)}")
        self._check_encoder_lengths()
        self.encoder_blocks()
        self.decoder_blocks()
        # diffusers' pipelines size latents by these (and its tiling and chunking): they must be the layers' factors
        for key, factor in (("spatial_compression_ratio", self.downsample_factor),
                            ("temporal_compression_ratio", self.temporal_factor)):
            self.check(getattr(self, key) in (None, factor), key, f"must be null or the encoder's factor, {factor} "
                       "(patch_size times the strides of its downsampling blocks)")

    # -- the encoder -------------------------------------------------------------------------------------------------

    @property
    def is_095(self) -> bool:
        """0.9.5+'s encoder: every block widens to ``block_out_channels[i + 1]`` (one more width than blocks)."""
        return bool(self.down_block_types) and self.down_block_types[-1] == "LTXVideo095DownBlock3D"

    @property
    def num_encoder_blocks(self) -> int:
        return len(self.block_out_channels) - (1 if self.is_095 else 0)

    def _check_encoder_lengths(self) -> None:
        n = self.num_encoder_blocks
        self.check(n >= 1, "block_out_channels", "must give at least one block's width (two for 0.9.5 blocks)")
        for key in ("down_block_types", "spatio_temporal_scaling", "downsample_type"):
            self.check(len(getattr(self, key)) >= n, key, f"must have an entry for each of the {n} encoder blocks")
        # diffusers reads entry i for encoder block i and the last for the mid block: n entries run (the last block's
        # count shared with the mid block), n + 1 as the released configs give them
        self.check(len(self.layers_per_block) >= n, "layers_per_block",
                   f"must have an entry for each of the {n} encoder blocks (and the mid block's last; the last "
                   f"block's serves both when there are only {n})")

    def encoder_blocks(self) -> tuple[EncoderBlock, ...]:
        """The encoder's blocks in order (the mid block, of ``layers_per_block[-1]`` ResNet blocks, follows)."""
        n, widths, out, blocks = self.num_encoder_blocks, self.block_out_channels, self.block_out_channels[0], []
        for i in range(n):
            cin, out = out, widths[i + 1] if (self.is_095 or i + 1 < n) else widths[i]
            scale = self.spatio_temporal_scaling[i]
            if self.down_block_types[i] == "LTXVideoDownBlock3D":
                blocks.append(EncoderBlock(cin, out, self.layers_per_block[i], "conv" if scale else None, cin != out))
                continue
            kind = self.downsample_type[i] if scale else None
            self.check(cin == out or kind not in (None, "conv"), "downsample_type",
                       f"must be a space-to-depth type for LTXVideo095DownBlock3D {i} ({cin} -> {out} channels): only "
                       "those change the width (diffusers' block would pass on the wrong width)")
            volume = math.prod(DOWNSAMPLE_STRIDES[kind]) if kind not in (None, "conv") else 1
            self.check(out % volume == 0 and (cin * volume) % out == 0, "block_out_channels",
                       f"gives LTXVideo095DownBlock3D {i} a {kind} space-to-depth downsampler from {cin} to {out} "
                       f"channels: the output width must be a multiple of the {volume} pixels it folds and divide "
                       f"{cin} x {volume} (the residual averages groups of channels; diffusers cannot run it either)")
            blocks.append(EncoderBlock(cin, out, self.layers_per_block[i], kind, False))
        return tuple(blocks)

    @property
    def encoder_width(self) -> int:
        """The encoder's width after its last block (its mid block's)."""
        return self.encoder_blocks()[-1].cout

    # -- the decoder -------------------------------------------------------------------------------------------------

    def decoder_blocks(self) -> tuple[DecoderBlock, ...]:
        """The decoder's up blocks in order (after the mid block, of ``decoder_layers_per_block[-1]`` ResNet blocks
        of ``decoder_block_out_channels[-1]``), checked to chain: each block's input is its predecessor's output."""
        m = len(self.decoder_block_out_channels)
        for key, need in (("decoder_layers_per_block", m + 1), ("decoder_inject_noise", m + 1),
                          ("decoder_spatio_temporal_scaling", m), ("upsample_residual", m), ("upsample_factor", m)):
            self.check(len(getattr(self, key)) >= need, key, f"must have at least {need} entries for {m} decoder "
                       "blocks (diffusers reads them from the end)")
        widths, layers, scaling = (tuple(reversed(getattr(self, k))) for k in (
            "decoder_block_out_channels", "decoder_layers_per_block", "decoder_spatio_temporal_scaling"))
        inject, residual, factors = (tuple(reversed(getattr(self, k))) for k in (
            "decoder_inject_noise", "upsample_residual", "upsample_factor"))
        out = channels = widths[0]
        blocks = []
        for i in range(m):
            cin, out = out // factors[i], widths[i] // factors[i]
            block = DecoderBlock(cin, out, layers[i + 1], scaling[i], residual[i], factors[i], inject[i + 1])
            self._check_chain(i, block, channels)
            self._check_residual(i, block)
            channels = out
            blocks.append(block)
        return tuple(blocks)

    def _check_chain(self, i: int, block: DecoderBlock, channels: int) -> None:
        """Up block ``i`` receives ``channels``; diffusers' sub-blocks expect what this checks."""
        fix = "decoder_block_out_channels and upsample_factor must chain as LTX-Video's do"
        if block.conv_in:
            self.check(channels == block.cin and (block.factor == 1 or not block.upsample), "upsample_factor",
                       f"up block {i} widens {block.cin} -> {block.cout} channels but receives {channels} (or "
                       f"upsamples by factor {block.factor}); {fix}")
            self.check(not (block.inject or self.timestep_conditioning),
                       "timestep_conditioning" if self.timestep_conditioning else "decoder_inject_noise",
                       f"up block {i} changes the width ({block.cin} -> {block.cout}) in a ResNet block that injects "
                       "noise or is timestep-conditioned, which diffusers cannot run; " + fix)
            return
        expected = block.cout * block.factor if block.upsample else block.cout
        self.check(channels == expected, "decoder_block_out_channels",
                   f"up block {i} expects {expected} channels but receives {channels}; {fix}")

    def _check_residual(self, i: int, block: DecoderBlock) -> None:
        """A residual upsampling adds the input's depth-to-space by (2, 2, 2), its channels tiled 8 / factor times."""
        width = block.cout * block.factor
        self.check(not (block.upsample and block.residual) or (width % 8 == 0 and 8 % block.factor == 0),
                   "upsample_residual", f"up block {i} adds a residual to its upsampling of {width} channels with "
                   f"upsample_factor {block.factor}: that needs a multiple of 8 channels and a factor dividing 8 "
                   "(diffusers cannot run it either); set its entry false or widen the block")

    @property
    def decoder_width(self) -> int:
        """The decoder's width at its mid block."""
        return self.decoder_block_out_channels[-1]

    # -- sizes -------------------------------------------------------------------------------------------------------

    @property
    def downsample_factor(self) -> int:
        """Pixels per latent along height and width: the patch size times the encoder's spatial strides."""
        return self.patch_size * math.prod(DOWNSAMPLE_STRIDES[b.downsample][1] for b in self.encoder_blocks()
                                           if b.downsample)

    @property
    def temporal_factor(self) -> int:
        """Frames per latent frame after the first: the encoder's temporal strides (a video of ``1 + 8k`` frames
        has ``1 + k`` latent frames at 8)."""
        return math.prod(DOWNSAMPLE_STRIDES[b.downsample][0] for b in self.encoder_blocks() if b.downsample)

    @property
    def injects_noise(self) -> bool:
        """Whether a decode draws noise (``decoder_inject_noise`` on the mid block or an up block that has ResNet
        blocks)."""
        mid = self.decoder_inject_noise[-1] and self.decoder_layers_per_block[-1] > 0
        return mid or any(b.inject and b.layers > 0 for b in self.decoder_blocks())

    @property
    def decoder_upsamplings(self) -> int:
        """How many times the decoder doubles frames (``F -> 2F - 1``), height and width."""
        return sum(b.upsample for b in self.decoder_blocks())


__all__ = ["AutoencoderKLLTXVideoConfig", "DecoderBlock", "EncoderBlock"]
