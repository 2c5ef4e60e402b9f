"""Image and caption transforms, as diffusers' training scripts apply them: resize the shorter side to the
resolution, center (or random) crop, random horizontal flip, scale to [-1, 1]; then tokenize the caption.

All are NumPy/PIL functions of one example; randomness comes from the ``np.random.Generator`` grain hands to
``random_map`` (seeded from the pipeline seed and the element's index), so results are reproducible and do
not depend on threads, workers or where the iterator was restored.
"""

import dataclasses

import numpy as np

from ._common import DataError, decode_image

_INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "lanczos")


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


def crop(image: np.ndarray, height: int, width: int, rng: np.random.Generator | None) -> np.ndarray:
    """Center crop (``rng=None``, torchvision's rounding) or a uniformly random crop."""
    h, w = image.shape[:2]
    if rng is None:
        top, left = int(round((h - height) / 2.0)), int(round((w - width) / 2.0))
    else:
        top, left = int(rng.integers(0, h - height + 1)), int(rng.integers(0, w - width + 1))
    return image[top : top + height, left : left + width]


def to_unit_range(image: np.ndarray) -> np.ndarray:
    """``uint8`` [0, 255] to ``float32`` [-1, 1] (``ToTensor`` then ``Normalize([0.5], [0.5])``)."""
    return (image.astype(np.float32) / np.float32(255) - np.float32(0.5)) / np.float32(0.5)


@dataclasses.dataclass(frozen=True)
class ImageCaptionTransform:
    """One raw record (see ``eqxdiff.data._common``) to ``{"pixel_values", "input_ids"}``.

    Args:
        tokenizer: a ``transformers`` tokenizer; captions are padded/truncated to its ``model_max_length``.
        resolution: output size, an int (square) or ``(height, width)``.
        center_crop: center crop if True, else a random crop.
        random_flip: flip left-right with probability 0.5.
        interpolation: ``nearest``, ``bilinear`` (diffusers' default), ``bicubic`` or ``lanczos``.
    """

    tokenizer: object
    resolution: int | tuple[int, int] = 512
    center_crop: bool = True
    random_flip: bool = True
    interpolation: str = "bilinear"

    def __post_init__(self):
        _size(self.resolution)
        if self.interpolation not in _INTERPOLATIONS:
            raise ValueError(f"interpolation={self.interpolation!r} is not one of {_INTERPOLATIONS}")
        max_length = getattr(self.tokenizer, "model_max_length", None)
        if not isinstance(max_length, int) or not 0 < max_length < 1_000_000:
            raise ValueError(f"the tokenizer's model_max_length={max_length!r} is not a usable sequence length; "
                             "set tokenizer.model_max_length")

    def tokenize(self, caption: str) -> np.ndarray:
        ids = self.tokenizer(caption, max_length=self.tokenizer.model_max_length, padding="max_length",
                             truncation=True, return_tensors="np")["input_ids"]
        return np.asarray(ids[0], dtype=np.int32)

    def __call__(self, record: dict, rng: np.random.Generator) -> dict:
        height, width = _size(self.resolution)
        image = decode_image(record["image"], record["name"])
        if image.shape[0] == 0 or image.shape[1] == 0:
            raise DataError(f"unreadable image {record['name']}: it is empty ({image.shape})")
        image = resize_to_cover(image, height, width, self.interpolation)
        image = crop(image, height, width, None if self.center_crop else rng)
        if self.random_flip and rng.random() < 0.5:
            image = image[:, ::-1]
        caption = record["caption"]
        if not isinstance(caption, str):  # several captions: draw one, as diffusers' scripts do
            caption = caption[int(rng.integers(len(caption)))]
        return {"pixel_values": to_unit_range(image), "input_ids": self.tokenize(caption)}
