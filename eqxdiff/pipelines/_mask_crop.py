"""Inpainting around the mask only (diffusers' ``padding_mask_crop``, A1111's "only masked"): the box around the
mask's white pixels, padded by ``padding_mask_crop`` pixels and widened to the output's aspect ratio, is cut out of the
image and the mask, resized to the output size (``height`` x ``width``, the model's native size by default) and
inpainted; each result is resized back into the box and pasted over the original picture, whose pixels under the
mask's black are kept exactly (an alpha composite, as diffusers' ``apply_overlay``). Small masks on large pictures get
the model's whole resolution.

:func:`mask_cropped` gives an inpainting ``__call__`` the argument; the steps are diffusers' image processor's
(``get_crop_region``, the ``"fill"`` and ``"crop"`` resizes with Lanczos), done with PIL as it does them, so the
pictures the model sees are diffusers'."""

import functools

import numpy as np
from PIL import Image, ImageOps

from ._checks import InputError

__all__ = ["crop_region", "mask_cropped", "overlay", "resize_and_crop", "resize_and_fill"]


def _widen(lo: int, hi: int, desired: float, limit: int) -> tuple[int, int]:
    """``[lo, hi)`` grown about its centre to ``desired`` (truncated), kept within ``[0, limit]``."""
    diff = int(desired - (hi - lo))
    lo, hi = lo - diff // 2, hi + diff - diff // 2
    if hi >= limit:
        lo, hi = lo - (hi - limit), limit
    if lo < 0:
        lo, hi = 0, hi - lo
    return lo, min(hi, limit)


def crop_region(mask: Image.Image, width: int, height: int, pad: int) -> tuple[int, int, int, int]:
    """``(x1, y1, x2, y2)``: the box holding every non-zero pixel of ``mask``, padded by ``pad`` (within the
    picture) and widened about its centre to ``width / height``'s aspect ratio (diffusers' ``get_crop_region``)."""
    m = np.asarray(mask.convert("L")) != 0
    h, w = m.shape
    cols, rows = np.flatnonzero(m.any(axis=0)), np.flatnonzero(m.any(axis=1))
    left, right = (cols[0], cols[-1] + 1) if cols.size else (w, 0)  # an empty mask: diffusers' counts meet
    top, bottom = (rows[0], rows[-1] + 1) if rows.size else (h, 0)
    x1, y1 = int(max(left - pad, 0)), int(max(top - pad, 0))
    x2, y2 = int(min(right + pad, w)), int(min(bottom + pad, h))
    if (x2 - x1) / (y2 - y1) > width / height:
        y1, y2 = _widen(y1, y2, (x2 - x1) / (width / height), h)
    else:
        x1, x2 = _widen(x1, x2, (y2 - y1) * (width / height), w)
    return x1, y1, x2, y2


def resize_and_fill(image: Image.Image, width: int, height: int) -> Image.Image:
    """``image`` fitted inside ``width`` x ``height`` (aspect kept, Lanczos, centred) and the bands left over filled
    by stretching its edge rows or columns (diffusers' ``"fill"`` resize); RGB."""
    wide = width / height < image.width / image.height
    src_w = width if wide else image.width * height // image.height
    src_h = height if width / height >= image.width / image.height else image.height * width // image.width
    resized = image.resize((src_w, src_h), resample=Image.LANCZOS)
    out = Image.new("RGB", (width, height))
    out.paste(resized, box=(width // 2 - src_w // 2, height // 2 - src_h // 2))
    if wide and height // 2 - src_h // 2 > 0:
        band = height // 2 - src_h // 2
        out.paste(resized.resize((width, band), box=(0, 0, width, 0)), box=(0, 0))
        out.paste(resized.resize((width, band), box=(0, src_h, width, src_h)), box=(0, band + src_h))
    elif width / height > image.width / image.height and width // 2 - src_w // 2 > 0:
        band = width // 2 - src_w // 2
        out.paste(resized.resize((band, height), box=(0, 0, 0, height)), box=(0, 0))
        out.paste(resized.resize((band, height), box=(src_w, 0, src_w, height)), box=(band + src_w, 0))
    return out


def resize_and_crop(image: Image.Image, width: int, height: int) -> Image.Image:
    """``image`` covering ``width`` x ``height`` (aspect kept, Lanczos, centred), the excess cut off (diffusers'
    ``"crop"`` resize); RGB."""
    src_w = width if width / height > image.width / image.height else image.width * height // image.height
    src_h = height if width / height <= image.width / image.height else image.height * width // image.width
    out = Image.new("RGB", (width, height))
    out.paste(image.resize((src_w, src_h), resample=Image.LANCZOS),
              box=(width // 2 - src_w // 2, height // 2 - src_h // 2))
    return out


def overlay(mask: Image.Image, original: Image.Image, result: Image.Image,
            box: tuple[int, int, int, int]) -> Image.Image:
    """``result`` resized into ``box`` of a picture of ``original``'s size, with ``original`` composited over it
    where ``mask`` is black (diffusers' ``apply_overlay``); RGB."""
    kept = Image.new("RGBa", original.size)
    kept.paste(original.convert("RGBA").convert("RGBa"), mask=ImageOps.invert(mask.convert("L")))
    x1, y1, x2, y2 = box
    canvas = Image.new("RGBA", original.size)
    canvas.paste(resize_and_crop(result, x2 - x1, y2 - y1), (x1, y1))
    out = canvas.convert("RGB").convert("RGBA")
    out.alpha_composite(kept.convert("RGBA"))
    return out.convert("RGB")


def mask_cropped(call):
    """Give an inpainting ``__call__`` diffusers' ``padding_mask_crop`` (its signature must list it, ``None`` by
    default; the wrapped call never sees another value): with it, ``image`` and ``mask_image`` (PIL images, as
    diffusers asks) are cut to :func:`crop_region` and resized to the output size (:func:`resize_and_fill`), the call
    runs on them, and each image it returns is pasted back into the original picture (:func:`overlay`): uint8
    ``[n, H, W, 3]`` at the picture's size, or PIL images with ``output_type="pil"``."""

    @functools.wraps(call)
    def wrapper(self, *args, padding_mask_crop: int | None = None, **kwargs):
        if padding_mask_crop is None:
            return call(self, *args, **kwargs)
        image, mask, output_type = kwargs.get("image"), kwargs.get("mask_image"), kwargs.get("output_type", "uint8")
        if mask is None:
            raise InputError("padding_mask_crop is for inpainting: pass mask_image= (white = repaint) and image=")
        if isinstance(padding_mask_crop, bool) or not isinstance(padding_mask_crop, int) or padding_mask_crop < 0:
            raise InputError(f"padding_mask_crop={padding_mask_crop!r} must be a number of pixels (an int >= 0)")
        if not isinstance(image, Image.Image) or not isinstance(mask, Image.Image):
            raise InputError(f"padding_mask_crop needs image= and mask_image= as PIL images (as diffusers), got "
                             f"{type(image).__name__} and {type(mask).__name__}: Image.fromarray(array) makes one")
        if output_type not in ("uint8", "pil"):
            raise InputError(f"padding_mask_crop pastes the results into the picture: output_type must be 'uint8' or "
                             f"'pil', not {output_type!r}")
        if image.size != mask.size:
            raise InputError(f"mask_image is {mask.width}x{mask.height} pixels but image is {image.width}x"
                             f"{image.height}; give the mask the picture's size")
        if not np.asarray(mask.convert("L")).any():
            raise InputError("mask_image is black everywhere: padding_mask_crop has no region to repaint")
        native = self.default_size()
        height, width = kwargs.get("height") or native[0], kwargs.get("width") or native[1]
        box = crop_region(mask, width, height, padding_mask_crop)
        kwargs.update(image=resize_and_fill(image.crop(box), width, height),
                      mask_image=resize_and_fill(mask.crop(box), width, height), height=height, width=width,
                      output_type="uint8")
        pasted = [overlay(mask, image, Image.fromarray(np.asarray(out)), box) for out in call(self, *args, **kwargs)]
        return pasted if output_type == "pil" else np.stack([np.asarray(p) for p in pasted])

    return wrapper
