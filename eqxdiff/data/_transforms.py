"""Image and caption transforms, as diffusers' training scripts apply them: resize the shorter side to the
resolution, center (or random) crop, random horizontal flip, scale to [-1, 1]; then tokenize the caption (with one
tokenizer, or each of a model's tokenizers). Facts of what was done to each image come along on request, by the
names of :data:`IMAGE_FACTS` (a model that conditions on them asks for the ones it reads: ``original_size``,
``crop_top_left``, recorded as diffusers' ``train_text_to_image_sdxl.py`` records them).

All are NumPy/PIL functions of one example; randomness comes from the ``np.random.Generator`` grain hands to
``random_map`` (seeded from the pipeline seed and the element's index), so results are reproducible and do
not depend on threads, workers or where the iterator was restored.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

from ..loading import token_ids
from ._common import DataError, decode_image

_INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "lanczos")


class ImageFacts(NamedTuple):
    """What a transform records of each image beside its pixels (int32 pairs), by the names a model asks for them
    with (``image_keys``; ``eqxdiff.train.TrainModel.IMAGE_KEYS``)."""

    original_size: tuple[int, int]  # (height, width) of the decoded image, before resizing
    crop_top_left: tuple[int, int]  # (top, left) of the crop in the resized image; for a flipped image, in the
    # flipped image (diffusers' SDXL script flips before it crops)


IMAGE_FACTS = ImageFacts._fields


def _size(resolution) -> tuple[int, int]:
    height, width = (resolution, resolution) if isinstance(resolution, int) else tuple(resolution)
    if height < 1 or width < 1:
        raise ValueError(f"resolution={resolution!r} must be positive")
    return height, width


def resize_to_cover(image: np.ndarray, height: int, width: int, interpolation: str = "bilinear") -> np.ndarray:
    """Scale ``uint8 [h, w, 3]`` so it covers ``height x width`` keeping its aspect ratio (for a square
    target: the shorter side becomes the resolution, as ``torchvision.transforms.Resize(int)``)."""
    from PIL import Image

    h, w = image.shape[:2]
    if (h, w) == (height, width):
        return image
    scale = max(height / h, width / w)
    new_h, new_w = max(height, int(h * scale)), max(width, int(w * scale))
    if (new_h, new_w) == (h, w):
        return image
    resample = getattr(Image.Resampling, interpolation.upper())
    return np.asarray(Image.fromarray(image).resize((new_w, new_h), resample=resample))


def crop_corner(image: np.ndarray, height: int, width: int, rng: np.random.Generator | None) -> tuple[int, int]:
    """``(top, left)`` of a center crop (``rng=None``, torchvision's rounding) or of a uniformly random crop."""
    h, w = image.shape[:2]
    if rng is None:
        return int(round((h - height) / 2.0)), int(round((w - width) / 2.0))
    return int(rng.integers(0, h - height + 1)), int(rng.integers(0, w - width + 1))


def crop(image: np.ndarray, height: int, width: int, rng: np.random.Generator | None) -> np.ndarray:
    """Center crop (``rng=None``, torchvision's rounding) or a uniformly random crop."""
    top, left = crop_corner(image, height, width, rng)
    return image[top : top + height, left : left + width]


def to_unit_range(image: np.ndarray) -> np.ndarray:
    """``uint8`` [0, 255] to ``float32`` [-1, 1] (``ToTensor`` then ``Normalize([0.5], [0.5])``)."""
    return (image.astype(np.float32) / np.float32(255) - np.float32(0.5)) / np.float32(0.5)


@dataclasses.dataclass(frozen=True)
class ImageCaptionTransform:
    """One raw record (see ``eqxdiff.data._common``) to ``{"pixel_values", "input_ids"}``.

    Args:
        tokenizer: a ``transformers`` tokenizer; captions are padded/truncated to its ``model_max_length``. Or a
            mapping ``{batch key: tokenizer}`` for a model with several text encoders (SDXL, Flux:
            ``{"input_ids": clip, "input_ids_2": second}``): the caption is tokenized by each, under its key.
        resolution: output size, an int (square) or ``(height, width)``.
        center_crop: center crop if True, else a random crop.
        random_flip: flip left-right with probability 0.5.
        interpolation: ``nearest``, ``bilinear`` (diffusers' default), ``bicubic`` or ``lanczos``.
        image_keys: also return these facts of each image (int32 pairs), names of :data:`IMAGE_FACTS`:
            ``original_size`` (the decoded image's ``(height, width)``), ``crop_top_left`` (the crop's corner).
        max_length: token ids per caption, one number or ``{batch key: number}`` (Flux's T5 takes 512 whatever
            its tokenizer says); default: each tokenizer's ``model_max_length``.
        clean_caption: applied to each caption before it is tokenized (a picklable function: data workers run it),
            e.g. the prompt cleaning a family's pipeline applies (Wan's ``clean_prompt``); default: none.
    """

    tokenizer: object
    resolution: int | tuple[int, int] = 512
    center_crop: bool = True
    random_flip: bool = True
    interpolation: str = "bilinear"
    image_keys: tuple[str, ...] = ()
    max_length: int | Mapping[str, int] | None = None
    clean_caption: Callable[[str], str] | None = None

    def __post_init__(self):
        _size(self.resolution)
        if self.interpolation not in _INTERPOLATIONS:
            raise ValueError(f"interpolation={self.interpolation!r} is not one of {_INTERPOLATIONS}")
        object.__setattr__(self, "image_keys", tuple(self.image_keys))
        unknown = [k for k in self.image_keys if k not in IMAGE_FACTS]
        if unknown:
            raise ValueError(f"image_keys {unknown} are not facts the transform records; ask for some of "
                             f"{list(IMAGE_FACTS)}")
        if not self.tokenizers:
            raise ValueError("tokenizer: give a tokenizer, or a mapping {batch key: tokenizer} with at least one")
        unknown = sorted(set(self.max_length) - set(self.tokenizers)) if isinstance(self.max_length, Mapping) else []
        if unknown:
            raise ValueError(f"max_length has keys {unknown} that no tokenizer fills (keys: {list(self.tokenizers)})")
        for key in self.tokenizers:
            length = self.length(key)
            if not isinstance(length, int) or not 0 < length < 1_000_000:
                raise ValueError(f"the tokenizer's model_max_length={length!r} ({key}) is not a usable sequence "
                                 "length; set tokenizer.model_max_length or pass max_length")

    @property
    def tokenizers(self) -> dict:
        """``{batch key: tokenizer}`` (``{"input_ids": tokenizer}`` for a single one)."""
        if isinstance(self.tokenizer, Mapping):
            return dict(self.tokenizer)
        return {"input_ids": self.tokenizer}

    def length(self, key: str) -> int:
        """The token ids' length for batch ``key``: ``max_length``'s, else the tokenizer's ``model_max_length``."""
        if isinstance(self.max_length, Mapping) and key in self.max_length:
            return self.max_length[key]
        if isinstance(self.max_length, int):
            return self.max_length
        return getattr(self.tokenizers[key], "model_max_length", None)

    def caption_ids(self, caption, rng: np.random.Generator) -> dict:
        """``{batch key: token ids}`` of a record's caption: one drawn where it has several (as diffusers' scripts
        do), cleaned by :attr:`clean_caption`, tokenized by each tokenizer at its length."""
        if not isinstance(caption, str):
            caption = caption[int(rng.integers(len(caption)))]
        if self.clean_caption is not None:
            caption = self.clean_caption(caption)
        return {key: self.tokenize(caption, tokenizer, self.length(key)) for key, tokenizer in self.tokenizers.items()}

    def tokenize(self, caption: str, tokenizer=None, max_length: int | None = None) -> np.ndarray:
        tokenizer = self.tokenizer if tokenizer is None else tokenizer
        return token_ids(tokenizer, [caption], max_length)[0]

    def __call__(self, record: dict, rng: np.random.Generator) -> dict:
        height, width = _size(self.resolution)
        image = decode_image(record["image"], record["name"])
        if image.shape[0] == 0 or image.shape[1] == 0:
            raise DataError(f"unreadable image {record['name']}: it is empty ({image.shape})")
        original_size = image.shape[:2]
        image = resize_to_cover(image, height, width, self.interpolation)
        top, left = crop_corner(image, height, width, None if self.center_crop else rng)
        resized_width = image.shape[1]
        image = image[top : top + height, left : left + width]
        if self.random_flip and rng.random() < 0.5:
            image = image[:, ::-1]
            left = resized_width - left - width  # the same pixels, cropped from the flipped image
        out = {"pixel_values": to_unit_range(image), **self.caption_ids(record["caption"], rng)}
        facts = ImageFacts(original_size=original_size, crop_top_left=(top, left))
        out.update({k: np.asarray(getattr(facts, k), np.int32) for k in self.image_keys})
        return out
