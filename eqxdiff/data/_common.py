"""What every data source shares: the record format, the error type, image opening and the validation pass.

A source is a grain ``RandomAccessDataSource``: ``len(source)`` and ``source[i]``, where ``source[i]`` is a
raw record ``{"image": ..., "caption": ..., "name": str}``. ``image`` is still encoded (a path, bytes, or an
already decoded ``uint8 [height, width, 3]`` array); it is decoded by the pipeline's transform, in grain's
reader threads. ``caption`` is a string or a list of strings (one is drawn per use, as diffusers' scripts
do). ``name`` says where the record came from (a file, or a dataset row) and is in every error about it.
"""

import io
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import numpy as np

Check = Literal["index", "headers", "full"]
CHECKS = ("index", "headers", "full")
MAX_LISTED = 10

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


class DataError(ValueError):
    """Bad training data: an unreadable image, a missing caption, a missing column, an empty dataset.

    Raised when a source is built (before training starts) and, for an image that only fails when fully
    decoded, by the pipeline with the file or row named."""


def check_level(check: str) -> str:
    if check not in CHECKS:
        raise ValueError(f"check={check!r} is not one of {CHECKS}: 'index' checks the index and captions only, "
                         "'headers' also opens every image header, 'full' also decodes every image")
    return check


def raise_problems(problems: Sequence[str], where: str) -> None:
    """One ``DataError`` listing the first problems found in ``where`` (and how many there are in all)."""
    if not problems:
        return
    listed = "\n  ".join(problems[:MAX_LISTED])
    more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
    raise DataError(f"{len(problems)} problem(s) in {where}:\n  {listed}{more}")


def require_nonempty(n: int, where: str, how: str) -> None:
    if n == 0:
        raise DataError(f"empty dataset: {where} has no examples ({how})")


def files_below(root: Path, extensions: tuple[str, ...], how: str) -> list[Path]:
    """Every file in ``root``'s tree with one of ``extensions`` (any case; hidden files left out), sorted; an empty
    dataset is a ``DataError`` that says ``how`` it was looked for."""
    files = sorted(Path(d) / n for d, _, names in os.walk(root) for n in names
                   if n.lower().endswith(extensions) and not n.startswith("."))
    require_nonempty(len(files), str(root), how)
    return files


def with_txt_captions(files: Sequence[Path], root: Path) -> list[tuple[Path, str]]:
    """``(file, caption)`` for each of ``files`` (of the folder ``root``), the caption read from the ``.txt`` file
    beside it that shares its stem; one ``DataError`` names every file without one."""
    rows, problems = [], []
    for file in files:
        txt = file.with_suffix(".txt")
        if not txt.is_file():
            problems.append(f"{file}: missing caption (no {txt.name} beside it and no metadata.jsonl)")
            continue
        rows.append((file, txt.read_text(encoding="utf-8").strip()))
    raise_problems(problems, str(root))
    return rows


def check_no_columns(root, columns: dict[str, str], defaults: dict[str, str], captions: str) -> None:
    """``DataError`` for metadata ``columns`` set away from their ``defaults`` on a folder ``root`` that reads no
    metadata (``captions``: where its captions come from instead), where they would be dropped without a word."""
    given = [f"{k}={v!r}" for k, v in columns.items() if v != defaults[k]]
    if given:
        them = "it" if len(given) == 1 else "them"
        raise DataError(f"{', '.join(given)} name{'s' * (len(given) == 1)} a field of a metadata.jsonl / "
                        f"metadata.csv, but {root} reads none ({captions}): add such a file, or leave {them} out")


def caption_problem(caption: Any) -> str | None:
    """Why ``caption`` cannot be used, or None. An empty string is allowed (unconditional training)."""
    if caption is None:
        return "missing caption"
    if isinstance(caption, str):
        return None
    if isinstance(caption, (list, tuple)) and caption and all(isinstance(c, str) for c in caption):
        return None
    return f"caption must be a string or a non-empty list of strings, got {type(caption).__name__}: {caption!r:.60}"


def open_image(image: Any, name: str):
    """A ``PIL.Image`` from a path, encoded bytes, a ``{"bytes", "path"}`` dict (Hugging Face ``datasets``), a
    PIL image, or an ``uint8`` array; any failure is a ``DataError`` naming ``name``."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image
    if isinstance(image, np.ndarray):
        return Image.fromarray(image)
    if isinstance(image, dict):
        image = image.get("bytes") or image.get("path")
    try:
        if isinstance(image, (bytes, bytearray, memoryview)):
            return Image.open(io.BytesIO(bytes(image)))
        if isinstance(image, (str, os.PathLike)):
            return Image.open(image)
    except Exception as e:  # PIL raises several types (UnidentifiedImageError, OSError, SyntaxError, ...)
        raise DataError(f"unreadable image {name}: {type(e).__name__}: {e}") from e
    raise DataError(f"unreadable image {name}: expected a path, bytes or an image, got {type(image).__name__}")


def decode_image(image: Any, name: str) -> np.ndarray:
    """Fully decoded ``uint8 [height, width, 3]`` RGB array (alpha and palette images are converted)."""
    if isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3 and image.shape[-1] == 3:
        return image
    pil = open_image(image, name)
    try:
        return np.asarray(pil.convert("RGB"))
    except Exception as e:
        raise DataError(f"unreadable image {name}: {type(e).__name__}: {e}") from e


def image_problem(image: Any, name: str, check: str) -> str | None:
    """Open (``headers``) or decode (``full``) one image; the error message, or None if it reads."""
    if check == "index":
        return None
    try:
        pil = open_image(image, name)
        try:
            if check == "full":
                pil.convert("RGB")
        except Exception as e:
            return f"unreadable image {name}: {type(e).__name__}: {e}"
        finally:
            pil.close()
    except DataError as e:
        return str(e)
    return None


def image_problems(images: Sequence, names: Sequence[str], check: str) -> list[str]:
    """``image_problem`` over many images, in threads (PIL decodes without the GIL)."""
    if check == "index":
        return []
    with ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
        return [p for p in pool.map(lambda i: image_problem(images[i], names[i], check), range(len(images))) if p]
