"""scikit-learn's bundled handwritten digits (1,797 8x8 images), upscaled and captioned, for the embedded model.

>>> source = DigitsSource(image_size=16)
>>> batch = next(source.batches(64, seed=0))
>>> batch["pixel_values"].shape, batch["input_ids"].shape       # (64, 16, 16, 3), (64, 32)

Captions read ``"a handwritten digit seven"``; batches are ``{"pixel_values": float32 [b, h, w, 3] in [-1, 1]
(channels-last), "input_ids": int32 [b, seq]}``, the format every eqxdiff data source yields.
"""

import dataclasses

import numpy as np

from ..loading import token_ids
from ._arrays import ArrayBatches
from ._tokenizer import character_tokenizer

DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def caption(label: int) -> str:
    """The caption of digit ``label``: ``"a handwritten digit seven"``."""
    return f"a handwritten digit {DIGIT_NAMES[int(label)]}"


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The raw dataset: images ``float32 [1797, 8, 8]`` in ``[0, 1]`` (ink = 1) and labels ``int64 [1797]``."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - scikit-learn is a declared dependency
        raise ImportError("the digits dataset ships with scikit-learn: pip install scikit-learn") from e
    data = load_digits()
    return (data.images / 16.0).astype(np.float32), data.target.astype(np.int64)


def upscale(images: np.ndarray, size: int) -> np.ndarray:
    """``[n, 8, 8]`` images in ``[0, 1]`` -> ``[n, size, size, 3]`` in ``[-1, 1]``: bilinear, white ink on black."""
    if size < 8 or size % 8:
        raise ValueError(f"image_size={size} must be a positive multiple of 8 (the digits are 8x8)")
    import jax
    import jax.numpy as jnp

    up = jax.image.resize(jnp.asarray(images), (images.shape[0], size, size), "linear", antialias=False)
    up = np.clip(np.asarray(up), 0.0, 1.0) * 2.0 - 1.0
    return np.repeat(up[..., None], 3, axis=-1).astype(np.float32)


def downscale(images: np.ndarray) -> np.ndarray:
    """``[n, h, w, 3]`` images (uint8 or ``[-1, 1]`` floats) -> ``[n, 64]`` features in the dataset's 0..16 range,
    averaged over 8x8 blocks of the grey level: what a classifier trained on the raw dataset reads."""
    x = np.asarray(images)
    x = x.astype(np.float32) / 255.0 if x.dtype == np.uint8 else (x.astype(np.float32) + 1.0) / 2.0
    n, h, w, _ = x.shape
    if h % 8 or w % 8:
        raise ValueError(f"images must have a height and width that are multiples of 8, got {x.shape}")
    grey = x.mean(-1).reshape(n, 8, h // 8, 8, w // 8).mean((2, 4))
    return (np.clip(grey, 0, 1) * 16.0).reshape(n, 64)


@dataclasses.dataclass
class DigitsSource:
    """The digits as model-ready arrays: ``pixel_values`` ``[1797, s, s, 3]``, ``labels`` and ``input_ids``.

    ``tokenizer`` defaults to :func:`eqxdiff.data.character_tokenizer` (``max_length=32``: the longest caption
    takes 24 tokens).
    """

    image_size: int = 16
    tokenizer: object = None

    def __post_init__(self):
        if self.tokenizer is None:
            self.tokenizer = character_tokenizer(max_length=32)
        raw, self.labels = load_digits_arrays()
        self.pixel_values = upscale(raw, self.image_size)
        self.captions = [caption(y) for y in self.labels]
        self.prompt_ids = self.tokenize([caption(d) for d in range(10)])  # one row per digit
        self.input_ids = self.prompt_ids[self.labels]

    def tokenize(self, prompts) -> np.ndarray:
        return token_ids(self.tokenizer, prompts)

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        """The whole dataset as one batch: ``{"pixel_values": [n, s, s, 3], "input_ids": [n, seq]}``."""
        return {"pixel_values": self.pixel_values, "input_ids": self.input_ids}

    def batches(self, batch_size: int, *, seed: int = 0, position: int = 0):
        """Endless shuffled batches (a new permutation each epoch, drawn from ``seed``) that can be checkpointed
        and resumed: see :class:`eqxdiff.data.ArrayBatches`."""
        return ArrayBatches(self.arrays, batch_size, seed=seed, position=position)


def digit_classifier(image_size: int = 16):
    """An SVC trained on the whole real dataset, as seen through :func:`upscale` then :func:`downscale` (so it
    reads generated images at ``image_size`` the same way). ``clf.predict(downscale(images))`` -> digits."""
    from sklearn.svm import SVC

    raw, labels = load_digits_arrays()
    return SVC(gamma=0.001, C=10.0).fit(downscale(upscale(raw, image_size)), labels)


def score_pipeline(pipe, *, per_digit: int = 20, num_inference_steps: int = 20, guidance_scale: float = 4.0,
                   seed: int = 0, classifier=None) -> dict:
    """Generate ``per_digit`` images for each prompt ``"a handwritten digit {name}"`` and report how many a
    classifier trained on the real dataset labels as the prompted digit: ``{"accuracy", "per_digit", "images",
    "predicted"}`` (images uint8 ``[10 * per_digit, h, w, 3]``, digit-major)."""
    images = pipe([caption(d) for d in range(10)], num_inference_steps=num_inference_steps,
                  guidance_scale=guidance_scale, num_images_per_prompt=per_digit, seed=seed, progress=False)
    clf = classifier or digit_classifier(images.shape[1])
    predicted = clf.predict(downscale(images))
    wanted = np.repeat(np.arange(10), per_digit)
    hits = predicted == wanted
    return {"accuracy": float(hits.mean()), "per_digit": hits.reshape(10, per_digit).mean(1).tolist(),
            "images": images, "predicted": predicted}


__all__ = ["DIGIT_NAMES", "DigitsSource", "caption", "digit_classifier", "downscale", "load_digits_arrays",
           "score_pipeline", "upscale"]
