"""IP-Adapter masks (diffusers' ``ip_adapter_masks``), on the host: each masked adapter's images act where their
masks are.

diffusers takes ``cross_attention_kwargs={"ip_adapter_masks": [masks_0, ...]}``, one entry per adapter (``None``: no
mask), each ``[1, images, height, width]`` (``IPAdapterMaskProcessor().preprocess`` of the mask images, reshaped). Its
attention processor (``IPAdapterAttnProcessor2_0``) then attends to each image of a masked adapter alone and multiplies
that output by the mask resized to the layer's queries (``IPAdapterMaskProcessor.downsample``: bicubic to a grid of
about the mask's aspect with at most as many cells as queries, flattened, zero-padded to the query count) and by the
image's scale. Here the resized masks are computed once per call in NumPy (:func:`downsample_mask`: torch's bicubic to
within 5e-7) for every resolution the UNet runs at, and handed to the UNet as arrays (``{seq: [rows, images, seq]}`` per
adapter; the scales, per layer and image, are values in the UNet): a new mask or scale is a new value and compiles
nothing; a call with masks compiles once beside one without. Fuzzed against diffusers 0.42.1 at float32 (random tiny SD
and SDXL UNets; text-to-image, image-to-image, inpainting with 4 and 9 channels, ControlNet and its image-to-image and
inpainting; 1-2 adapters, plain and Plus, 1-3 images; masks of other sizes and aspects, soft, or none; scalar, per-image
and per-block scales; guidance, several images per prompt, a LoRA, from_pipe): within 1/255, and new mask values or
scales compiled nothing.
"""

import math
from collections.abc import Sequence

import numpy as np
from PIL import Image

from ._arguments import host_array
from ._checks import InputError

__all__ = ["AdapterMasks", "as_adapter_masks", "downsample_mask", "mask_weights", "prepare_ip_adapter_masks",
           "resolutions"]

_SHAPE = ("[1, images, height, width] (diffusers' IPAdapterMaskProcessor().preprocess(masks, height=, width=) "
          "reshaped to [1, n, h, w]; eqxdiff.pipelines.prepare_ip_adapter_masks), or [rows, images, height, width] "
          "with one row per row of the UNet's batch")


def _f32(x) -> np.ndarray:
    return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)


def _fma(a, x, c) -> np.ndarray:
    """``a * x + c`` rounded once to float32 (float32 inputs: the product is exact in float64)."""
    return _f32(np.asarray(a, np.float64) * x + c)


def _weights(t: np.ndarray) -> np.ndarray:
    """torch's cubic convolution weights (``a = -0.75``) ``[..., 4]`` of the taps at ``-1, 0, 1, 2`` for fractions
    ``t``, in float32 as its CPU kernel rounds them (measured: the downsampled masks within 4.8e-7 of diffusers',
    1.1e-6 with float64 weights): ``((a + 2) x - (a + 3)) x x + 1`` for the inner taps, ``((a x - 5 a) x + 8 a) x -
    4 a`` for the outer."""
    a = -0.75

    def inner(x):
        return _fma(_f32(_fma(a + 2, x, -(a + 3)) * x), x, 1.0)

    def outer(x):
        return _f32(_fma(_fma(a, x, -5 * a), x, 8 * a) * x - 4 * a)

    rest = _f32(1 - t)
    return np.stack([outer(_f32(t + 1)), inner(t), inner(rest), outer(_f32(rest + 1))], axis=-1)


def _taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Source indices and weights ``[out, 4]`` of torch's bicubic (``align_corners=False``, no antialias): the
    source position ``(i + 0.5) * in / out - 0.5`` in float32 (the scale rounded to float32, the product and the
    subtraction rounded once, as torch's fused multiply-add gives it: a large mask's positions are 1e-5 off when
    rounded twice), the taps at ``floor - 1 ... floor + 2`` clamped to the edge."""
    scale = np.float64(np.float32(in_size) / np.float32(out_size))
    src = (scale * (np.arange(out_size) + 0.5) - 0.5).astype(np.float32)
    index = np.minimum(np.floor(src).astype(np.int64), in_size - 1)
    t = _f32(np.clip(src - index, 0, 1))
    return np.clip(index[:, None] + np.arange(-1, 3), 0, in_size - 1), _weights(t)


def _bicubic(mask: np.ndarray, height: int, width: int) -> np.ndarray:
    """``mask`` ``[h, w]`` resized to ``[height, width]`` as ``torch.nn.functional.interpolate(mode="bicubic")``."""
    rows, wy = _taps(mask.shape[0], height)
    cols, wx = _taps(mask.shape[1], width)
    m = mask.astype(np.float64)
    across = np.einsum("wj,hwj->hw", wx, m[:, cols])  # each row along the width first, as torch
    return np.einsum("hi,hiw->hw", wy, across[rows])


def downsample_mask(mask: np.ndarray, num_queries: int) -> np.ndarray:
    """``mask`` ``[h, w]`` as ``num_queries`` weights, as diffusers' ``IPAdapterMaskProcessor.downsample``: resized
    (bicubic) to ``mask_h`` rows, ``mask_h = int(sqrt(num_queries / (w / h)))`` plus one unless it divides
    ``num_queries``, of ``num_queries // mask_h`` columns, flattened row by row, then zero-padded or cut to
    ``num_queries`` (where the mask's aspect is not the picture's). float32 ``[num_queries]``."""
    h, w = mask.shape
    mask_h = int(math.sqrt(num_queries / (w / h)))
    if mask_h == 0:
        raise InputError(f"an IP-Adapter mask of {w} x {h} pixels is too wide for a layer of {num_queries} queries "
                         "(diffusers divides by zero there): give masks of the picture's aspect")
    mask_h += int(num_queries % mask_h != 0)
    mask_w = num_queries // mask_h
    flat = _bicubic(mask, mask_h, mask_w).reshape(-1)[:num_queries]
    return np.pad(flat, (0, num_queries - flat.shape[0])).astype(np.float32)


def resolutions(unet, height: int, width: int) -> tuple[int, ...]:
    """The token counts (``h * w``) of every resolution ``unet`` runs at for latents ``height x width``: the input's
    and each downsampler's output (a stride-2 3x3 convolution; the up path returns through the same sizes)."""
    sizes, shape = {height * width}, (height, width)
    for block in unet.down_blocks:
        if block.downsampler is not None:
            pad = block.downsampler.padding
            shape = tuple((n + 2 * pad - 3) // 2 + 1 if pad else (n - 2) // 2 + 1 for n in shape)
            sizes.add(shape[0] * shape[1])
    return tuple(sorted(sizes))


def _is_images(entry) -> bool:
    """Whether a masks entry is a list of mask images (PIL, or uint8 ``[h, w]`` / ``[h, w, 3]`` arrays)."""
    return isinstance(entry, (list, tuple)) and all(
        isinstance(x, Image.Image) or (np.ndim(x) in (2, 3) and np.asarray(x).dtype == np.uint8) for x in entry)


class AdapterMasks(tuple):
    """``ip_adapter_masks`` resolved by :func:`as_adapter_masks`: one entry per adapter, checked. A call's check
    resolves them once and hands them on (:meth:`~eqxdiff.pipelines.DiffusionPipeline.check_call`); what takes
    them afterwards takes them as they are."""


def as_adapter_masks(masks, adapters: int, size: tuple[int, int] | None = None) -> AdapterMasks:
    """``ip_adapter_masks`` as one entry per adapter (``None`` or ``[1 or rows, images, h, w]`` float32: one row for
    every row of the UNet's batch, or one per row, :func:`mask_weights`), checked as diffusers
    checks them; a single array ``[adapters, 1, h, w]`` is one mask per adapter, as diffusers reads one. An entry may
    also be a list of mask images, one per image (eqxdiff-generate's ``--ip-adapter-mask`` files), made into masks
    at the output's ``size`` ``(height, width)`` (:func:`prepare_ip_adapter_masks`; without ``size`` kept as they
    are). Masks resolved already (:class:`AdapterMasks`) are not checked again: only their mask images are made
    into masks at ``size``."""
    masks = masks if isinstance(masks, AdapterMasks) else _checked_masks(masks, adapters)
    if size is None:
        return masks
    return AdapterMasks(prepare_ip_adapter_masks(m, height=size[0], width=size[1]) if _is_images(m) else m
                        for m in masks)


def _checked_masks(masks, adapters: int) -> AdapterMasks:
    """:func:`as_adapter_masks`'s checks and conversions, the lists of mask images kept as they are."""
    if not isinstance(masks, (list, tuple)):
        array = host_array(masks, np.float32)
        if array.ndim != 4:
            raise InputError(f"ip_adapter_masks of shape {tuple(array.shape)}: give a list with one entry per "
                             f"IP-Adapter, each {_SHAPE}, or None")
        masks = list(array[:, None])
    if len(masks) != adapters:
        raise InputError(f"ip_adapter_masks holds {len(masks)} entries for {adapters} IP-Adapter(s): give one per "
                         "adapter (None for an adapter without a mask)")
    out = []
    for a, mask in enumerate(masks):
        if mask is not None and not _is_images(mask):
            mask = host_array(mask, np.float32)
            if mask.ndim != 4 or mask.shape[0] < 1:
                raise InputError(f"ip_adapter_masks[{a}] has shape {tuple(mask.shape)}; each entry is {_SHAPE}, or "
                                 "a list of mask images")
        out.append(mask)
    return AdapterMasks(out)


def mask_weights(masks: Sequence, counts: Sequence[int], scales: Sequence, rows: int,
                 queries: Sequence[int]) -> tuple:
    """The UNet's ``ip_adapter_masks``: per adapter ``None`` (no mask) or ``{seq: [rows, images, seq]}``, each
    image's mask downsampled to ``seq`` queries (:func:`downsample_mask`). ``counts[a]``: the adapter's images, which
    its masks must match, and ``scales[a]`` its per-image scales (``None``: none), checked to match too: the UNet
    applies them (``ip_image_scale``, per layer). A mask entry ``[1, images, h, w]`` holds for every row of the
    UNet's batch (``rows``); ``[rows, images, h, w]`` holds one mask per row, row ``r`` for the UNet's row ``r``
    (with guidance ``[negative; positive]``, each half prompt by prompt, ``num_images_per_prompt`` rows each), as
    diffusers' ``IPAdapterMaskProcessor.downsample`` and attention read it. Other row counts are refused: diffusers
    tiles them ``rows`` times and fails to broadcast them against the batch."""
    out = []
    for a, (mask, count, scale) in enumerate(zip(masks, counts, scales)):
        if mask is None:
            out.append(None)
            continue
        if mask.shape[1] != count:
            raise InputError(f"ip_adapter_masks[{a}] holds {mask.shape[1]} masks for the adapter's {count} image(s): "
                             "give one mask per image, in the images' order")
        if scale is not None and len(scale) != count:
            raise InputError(f"IP-Adapter {a} has {len(scale)} per-image scales for {count} masked image(s): give one "
                             "scale per image (set_ip_adapter_scale([[s_1, ..., s_n]]))")
        if mask.shape[0] not in (1, rows):
            raise InputError(f"ip_adapter_masks[{a}] has {mask.shape[0]} rows for the UNet's batch of {rows} (with "
                             "guidance [negative; positive], num_images_per_prompt rows per prompt): give 1 row, or "
                             f"one per UNet row ({rows}), as diffusers, which fails on other counts")
        out.append({q: np.broadcast_to(np.stack([[downsample_mask(m, q) for m in row] for row in mask]),
                                       (rows, count, q)) for q in queries})
    return tuple(out)


def _nearest(in_size: int, out_size: int) -> np.ndarray:
    """Source indices of torch's ``interpolate(mode="nearest")``: ``floor(i * (in / out))`` in float32, clamped."""
    scale = np.float32(in_size) / np.float32(out_size)
    return np.minimum(np.floor(np.arange(out_size, dtype=np.float32) * scale).astype(np.int64), in_size - 1)


def _values(image, height: int, width: int) -> np.ndarray:
    """A mask given as values (a float or bool array, or a torch tensor: ``[h, w]``, ``[h, w, 1]`` or ``[1, h, w]``,
    values in [0, 1]) at ``height`` x ``width`` as diffusers' ``VaeImageProcessor`` resizes arrays (torch's nearest)."""
    values = host_array(image, np.float32)
    if values.ndim == 3 and 1 in (values.shape[0], values.shape[-1]):
        values = values.reshape(values.shape[:2] if values.shape[-1] == 1 else values.shape[1:])
    if values.ndim != 2:
        raise InputError(f"an IP-Adapter mask array of shape {tuple(values.shape)}: give [h, w] values in [0, 1] "
                         "(or [h, w, 1]), a PIL image, or a uint8 image [h, w] / [h, w, 3]")
    return values[_nearest(values.shape[0], height)][:, _nearest(values.shape[1], width)]


def prepare_ip_adapter_masks(images, *, height: int, width: int, vae_scale_factor: int = 8) -> np.ndarray:
    """One adapter's masks ``[1, n, height, width]`` from mask images (PIL images, uint8 arrays ``[h, w]`` or
    ``[h, w, 3]``, or paths; one per image of the adapter), as diffusers' ``IPAdapterMaskProcessor().preprocess(images,
    height=, width=)`` makes them of PIL images (the size rounded down to a multiple of ``vae_scale_factor``, a Lanczos
    resize, grayscale, values of 0.5 and above 1, the rest 0), reshaped for one adapter. Float or bool arrays and torch
    tensors (``[h, w]``, ``[h, w, 1]`` or ``[1, h, w]``) are values in [0, 1], resized as diffusers resizes them
    (torch's nearest), then the same 0.5 threshold. A uint8 array is read as an image here (values / 255, as PIL):
    diffusers' preprocess takes a NumPy array's values as they are, so there any nonzero uint8 value is 1 (and a
    ``[h, w, 3]`` array gives 3 masks per image); give it PIL images."""
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    height, width = (x - x % vae_scale_factor for x in (height, width))
    out = []
    for image in images:
        if hasattr(image, "detach") or (isinstance(image, np.ndarray) and image.dtype != np.uint8):
            out.append(_values(image, height, width))
            continue
        if not isinstance(image, Image.Image):
            image = Image.fromarray(image) if isinstance(image, np.ndarray) else Image.open(image)
        image = image.resize((width, height), resample=Image.Resampling.LANCZOS).convert("L")
        out.append(np.asarray(image, np.float32) / 255.0)
    return np.where(np.stack(out)[None] >= 0.5, 1.0, 0.0).astype(np.float32)
