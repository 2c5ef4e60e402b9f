"""3-D convolutions on channels-last video ``[batch, frames, height, width, channels]``: a plain one (Wan's patch
embedding) and a causal one for the video VAEs (time padded in front only); :func:`per_frame` runs an image function
on each frame, :func:`unfold_channels` turns groups of channels into frames (or pixels)."""

import math
from collections.abc import Mapping, Sequence
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from .._typing import Array, Float, PRNGKeyArray, typechecked
from ..core import VIDEO_AXES, Plan, constrain
from ._adapters import Adapters, adapted_conv
from ._init import init_uniform


def per_frame(fn, x: Float[Array, "batch frames height width channels"], plan: Plan | None = None) -> Array:
    """``fn`` (an image function of ``[n, h, w, c]``) on each frame of ``x``: frames folded into the batch and back,
    the result constrained to the video layout (:data:`~eqxdiff.core.VIDEO_AXES`, frames whole) under ``plan``.

    The constraint is not only layout: a kernel inside ``fn`` may split the folded batch (``batch x frames``) over
    the batch axes (the VAEs' per-frame attention does), and unfolded unconstrained, that split lands on the frames.
    Inside a loop body (a tiled decode's ``lax.map``, a frame-chunked decode's ``lax.scan``), XLA's Shardy
    partitioner (jax 0.10.2) then computes the next causal time convolution wrongly: frames off by up to 0.5 of the
    output range on 8 simulated devices (tests/test_wan_vae.py::test_mesh_decodes_equal_one_device)."""
    b, t = x.shape[:2]
    x = constrain(x, plan, VIDEO_AXES)
    y = fn(x.reshape(b * t, *x.shape[2:]))
    return constrain(y.reshape(b, t, *y.shape[1:]), plan, VIDEO_AXES)


def unfold_channels(x: Float[Array, "*shape channels"], factor: int, axis: int) -> Array:
    """The channels of ``x [..., factor * c]`` as ``factor`` consecutive groups of ``c``, interleaved along ``axis``:
    element ``i`` of ``axis`` becomes ``factor`` elements, ``i * factor + k`` holding group ``k`` (einops'
    ``b t h w (k c) -> b (t k) h w c`` at ``axis=1``: a video VAE's time upsampler doubles its frames so, from a
    convolution to twice the channels).

    Written as ``factor`` channel slices stacked next to ``axis``, not as a reshape of the channel axis into
    ``(factor, c)``: that channel axis is often sharded (the output of a convolution whose weights are split over
    ``fsdp``), and both of XLA's partitioners (Shardy and GSPMD, jax 0.10.2) then compute the reshape-and-transpose
    wrongly in a whole decoder (Wan 2.1's tiny VAE on 8 simulated devices, weights sharded without a plan, one video:
    up to 1.2 relative error; tests/test_wan_vae.py::test_mesh_decode_without_plan_equals_one_device). The stacked
    slices partition correctly."""
    axis = axis % x.ndim
    y = jnp.stack(jnp.split(x, factor, axis=-1), axis=axis + 1)
    return y.reshape(*x.shape[:axis], x.shape[axis] * factor, *x.shape[axis + 1:-1], x.shape[-1] // factor)


def _triple(value: int | Sequence[int], what: str) -> tuple[int, int, int]:
    out = (value,) * 3 if isinstance(value, int) else tuple(value)
    if len(out) != 3 or not all(isinstance(v, int) and v >= 0 for v in out):
        raise ValueError(f"{what}={value!r}: expected a non-negative int or three of them (frames, height, width)")
    return out


class Conv3d(eqx.Module):
    """3-D convolution with symmetric zero ``padding``; ``weight`` is ``[kd, kh, kw, in, out]`` (DHWIO), read from
    PyTorch's ``[out, in, kd, kh, kw]``. ``kernel_size``, ``stride`` and ``padding`` are an int or a
    ``(frames, height, width)`` triple, as ``torch.nn.Conv3d`` takes them. ``adapters``: as
    :class:`~eqxdiff.nn.Conv2d`'s."""

    TORCH_PERMUTATIONS: ClassVar[dict[str, tuple[int, ...]]] = {"weight": (2, 3, 4, 1, 0)}
    PARAM_AXES: ClassVar = {"weight": ("kernel", "kernel", "kernel", "conv_in", "conv_out"), "bias": ("conv_out",)}

    weight: Float[Array, "kd kh kw cin cout"]
    bias: Float[Array, " cout"] | None
    adapters: Adapters | None
    stride: tuple[int, int, int] = eqx.field(static=True)
    padding: tuple[int, int, int] = eqx.field(static=True)

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | Sequence[int], *,
                 stride: int | Sequence[int] = 1, padding: int | Sequence[int] = 0, use_bias: bool = True,
                 dtype=jnp.float32, key: PRNGKeyArray):
        kernel = _triple(kernel_size, "Conv3d kernel_size")
        self.stride = _triple(stride, "Conv3d stride")
        self.padding = _triple(padding, "Conv3d padding")
        if min(kernel) < 1 or min(self.stride) < 1:
            raise ValueError(f"Conv3d: kernel_size={kernel} and stride={self.stride} must be positive")
        wkey, bkey = jax.random.split(key)
        bound = 1.0 / math.sqrt(in_channels * math.prod(kernel))
        self.weight = init_uniform(wkey, (*kernel, in_channels, out_channels), bound, dtype)
        self.bias = init_uniform(bkey, (out_channels,), bound, dtype) if use_bias else None
        self.adapters = None

    @typechecked
    def __call__(self, x: Float[Array, "batch frames height width cin"]) -> Float[Array, "batch f2 h2 w2 cout"]:
        return adapted_conv(x, self.weight, self.bias, self.adapters, self.TORCH_PERMUTATIONS["weight"], layer="Conv3d",
                            window_strides=self.stride, padding=[(p, p) for p in self.padding],
                            dimension_numbers=("NDHWC", "DHWIO", "NDHWC"))


class CausalConv3d(eqx.Module):
    """A :class:`Conv3d` whose time axis is padded in front only (``causal``), so frame ``t`` sees frames ``<= t``.

    ``padding`` (default ``kernel_size // 2`` per axis) is ``(frames, height, width)`` as torch's: height and width
    get that many zeros each side; time gets ``2 * frames`` in front (``causal``) or ``frames`` each side (not
    causal, LTX's decoder). ``pad_mode`` fills the time padding with ``"zeros"`` (diffusers' ``WanCausalConv3d``) or
    by repeating the edge frame, ``"replicate"`` (``LTXVideoCausalConv3d``). ``torch_prefix`` is where the
    convolution's parameters sit in the checkpoint: ``""`` (Wan: ``weight``) or ``"conv"`` (LTX: ``conv.weight``).
    """

    conv: Conv3d
    time_padding: tuple[int, int] = eqx.field(static=True)
    pad_mode: str = eqx.field(static=True)
    torch_prefix: str = eqx.field(static=True)

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | Sequence[int], *,
                 stride: int | Sequence[int] = 1, padding: int | Sequence[int] | None = None, causal: bool = True,
                 pad_mode: str = "zeros", torch_prefix: str = "", use_bias: bool = True, dtype=jnp.float32,
                 key: PRNGKeyArray):
        if pad_mode not in ("zeros", "replicate"):
            raise ValueError(f"CausalConv3d: pad_mode={pad_mode!r}; choose 'zeros' (Wan) or 'replicate' (LTX)")
        kernel = _triple(kernel_size, "CausalConv3d kernel_size")
        pt, ph, pw = tuple(k // 2 for k in kernel) if padding is None else _triple(padding, "CausalConv3d padding")
        self.conv = Conv3d(in_channels, out_channels, kernel, stride=stride, padding=(0, ph, pw), use_bias=use_bias,
                           dtype=dtype, key=key)
        self.time_padding = (2 * pt, 0) if causal else (pt, pt)
        self.pad_mode = pad_mode
        self.torch_prefix = torch_prefix

    def torch_renames(self) -> Mapping[str, str]:
        return {"conv": self.torch_prefix}

    @typechecked
    def __call__(self, x: Float[Array, "batch frames height width cin"],
                 cache: Float[Array, "batch cached height width cin"] | None = None
                 ) -> Float[Array, "batch f2 h2 w2 cout"]:
        """``cache``: the last input frames of the previous chunk (a chunked encoder/decoder, as diffusers'
        ``WanCausalConv3d(x, cache_x)``); they stand in for that many frames of the front padding."""
        front, back = self.time_padding
        if cache is not None and front > 0:
            if back or cache.shape[1] > front:
                raise ValueError(f"CausalConv3d: a cache of {cache.shape[1]} frames for a causal time padding of "
                                 f"{front}; give at most {front} cached frames (and only to a causal conv)")
            x = jnp.concatenate([cache.astype(x.dtype), x], axis=1)
            front -= cache.shape[1]
        if self.pad_mode == "zeros":
            x = jnp.pad(x, ((0, 0), (front, back), (0, 0), (0, 0), (0, 0)))
        else:
            x = jnp.concatenate([jnp.repeat(x[:, :1], front, axis=1), x, jnp.repeat(x[:, -1:], back, axis=1)], 1)
        return self.conv(x)


__all__ = ["CausalConv3d", "Conv3d", "per_frame"]
