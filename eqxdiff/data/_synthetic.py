"""A synthetic source for benchmarks and tests: random images and captions, the same for the same seed."""

import numpy as np

_WORDS = ("a", "photo", "painting", "of", "red", "blue", "green", "small", "large", "cat", "dog", "house",
          "tree", "river", "mountain", "city", "at", "night", "in", "the", "snow", "sun")


class SyntheticSource:
    """``num_examples`` records of random ``uint8`` images and random captions; record ``i`` depends only on
    ``(seed, i)``, so it is reproducible and needs no disk.

    Args:
        num_examples: dataset length.
        height, width: image size (give the pipeline's resolution to skip resizing entirely).
        seed: the dataset's seed (not the pipeline's shuffle seed).
        caption_words: how many words per caption (drawn from a small vocabulary of lowercase words).
    """

    def __init__(self, num_examples: int = 1024, *, height: int = 64, width: int = 64, seed: int = 0,
                 caption_words: int = 6):
        for name, value in (("num_examples", num_examples), ("height", height), ("width", width),
                            ("caption_words", caption_words)):
            if value < 1:
                raise ValueError(f"{name}={value} must be at least 1")
        self.num_examples, self.height, self.width = num_examples, height, width
        self.seed, self.caption_words = seed, caption_words

    def __len__(self) -> int:
        return self.num_examples

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.num_examples:
            raise IndexError(f"index {index} out of range for {self.num_examples} examples")
        rng = np.random.default_rng((self.seed, index))
        image = rng.integers(0, 256, (self.height, self.width, 3), dtype=np.uint8)
        caption = " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), self.caption_words))
        return {"image": image, "caption": caption, "name": f"synthetic example {index}"}

    def __repr__(self) -> str:
        return f"SyntheticSource({self.num_examples}, {self.height}x{self.width}, seed={self.seed})"
