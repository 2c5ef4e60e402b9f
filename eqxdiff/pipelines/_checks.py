"""The call arguments every family shares, checked before anything loads or compiles.

Pipelines take diffusers' argument names, so one table checks them for every family: :func:`check_arguments`
(run by :class:`~eqxdiff.pipelines.DiffusionPipeline` on every call, and by ``eqxdiff-generate`` before it loads
the model) raises :class:`InputError` naming the argument, its value and what to pass instead, and warns
(:class:`InputWarning`) where diffusers would go on but the result is not what was asked (a prompt cut to the text
encoder's length, a size far above the model's). What the models allow (the VAE's factor, the text encoder's
layers) comes in a :class:`CallLimits`, read from the loaded models or, before loading, from their configs.
"""

import dataclasses
import math
import numbers
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from PIL import Image

# What a call returns: uint8 pixels (the default), float32 pixels in [0, 1] ("np", diffusers' values before
# quantisation), PIL images ("pil", as diffusers': a list, or for videos a list per video of its frames), or the final
# latents (channels-last).
OUTPUT_TYPES = ("uint8", "np", "pil", "latent")
# A requested output above this many times the model's native pixel count, and this many latent tokens, gets an
# InputWarning (the attention's cost grows with the square of the tokens).
LARGE_OUTPUT_RATIO, LARGE_OUTPUT_TOKENS = 4, 4096
# The hand-off fractions' ranges. denoising_end=1 runs the whole schedule (diffusers ignores the value there: the same
# run); denoising_start=1 would leave no step (diffusers ignores it too, then noises the image to strength: another
# run than the one asked for); 0 is refused for either (no step to run; diffusers' strength run).
FRACTION_TOP = {"denoising_start": float(np.nextafter(1.0, 0.0)), "denoising_end": 1.0}
FRACTION_RANGE = {"denoising_start": "(0, 1)", "denoising_end": "(0, 1]"}


class InputError(ValueError):
    """A call argument a pipeline cannot use; the message names it and says what to pass instead."""


class InputTypeError(InputError, TypeError):
    """A call argument of the wrong type (also a ``TypeError``)."""


class NonFiniteError(ValueError):
    """A model produced NaN or infinite values (float16 overflow, an extreme guidance scale ...)."""


class InputWarning(UserWarning):
    """A call argument the pipeline accepts but that changes what it does: a prompt cut to the text encoder's
    length, words the tokenizer does not know, an output far larger than the model's native size."""


@dataclasses.dataclass(frozen=True)
class CallLimits:
    """What a pipeline's models allow its call arguments. ``size_factor``: heights, widths and input images are
    multiples of it (the VAE's downsampling; ``size_why`` says why when more than the VAE's factor makes it, e.g.
    ``"the VAE downsamples by 8 and the transformer takes 2x2 patches"``); ``native_size``: the ``(height, width)``
    the model was trained at; ``max_clip_skip``: the largest ``clip_skip`` its text encoders have layers for;
    ``frame_factor``: videos have ``1 + k * frame_factor`` frames (``num_frames``: the VAE keeps the first frame and
    compresses each ``frame_factor`` after it into one latent frame; 4 for Wan, 8 for LTX-Video), and their latent
    frames a multiple of ``frame_patch`` (the transformer's temporal patch: LTX's ``patch_size_t``). ``None``: not
    known (not checked)."""

    size_factor: int | None = None
    native_size: tuple[int, int] | None = None
    max_clip_skip: int | None = None
    frame_factor: int | None = None
    size_why: str | None = None
    frame_patch: int = 1

    def why_size(self) -> str:
        """Why sizes are multiples of :attr:`size_factor`."""
        return self.size_why or f"the VAE downsamples by {self.size_factor}"

    @classmethod
    def of_patches(cls, vae, patch: tuple[int, int], *, native_size: tuple[int, int],
                   frame_patch: int = 1) -> "CallLimits":
        """The limits of a video transformer taking ``patch`` (height, width) patches of ``vae``'s latents (its
        config; ``None``: nothing known) and ``frame_patch`` latent frames a patch: sizes in multiples of the VAE's
        factor times the larger side, frames of the VAE's temporal factor making whole temporal patches."""
        if vae is None:
            return cls()
        f, (ph, pw) = vae.downsample_factor, patch
        return cls(size_factor=f * max(ph, pw), native_size=native_size, frame_factor=vae.temporal_factor,
                   size_why=f"the VAE downsamples by {f} and the transformer takes {ph}x{pw} patches",
                   frame_patch=frame_patch)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _int(name: str, value, minimum: int, why: str = "") -> None:
    if not _is_int(value):
        raise InputTypeError(f"{name}={value!r} must be an int")
    if value < minimum:
        raise InputError(f"{name}={value} must be >= {minimum}{why}")


def _real_in(name: str, value, low: float, high: float, *, open_low: bool = False, why: str = "") -> None:
    if not _is_real(value):
        raise InputTypeError(f"{name}={value!r} must be a number")
    if not ((low < value) if open_low else (low <= value)) or not value <= high:
        raise InputError(f"{name} must be in {'(' if open_low else '['}{low:g}, {high:g}], got {value}{why}")


def _prompt(name: str, value, limits) -> None:
    if isinstance(value, str):
        return
    if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) for p in value):
        raise InputTypeError(f"{name} must be a string or a list of strings, got {type(value).__name__} "
                             f"{value!r:.60}")
    if not value:
        raise InputError(f"{name} is an empty list; pass at least one string (or leave {name} out)")


def _size(name: str, value, limits: CallLimits) -> None:
    f = limits.size_factor or 1
    native = "" if limits.native_size is None else f" ({limits.native_size[name == 'width']} px)"
    if not _is_int(value):
        raise InputTypeError(f"{name}={value!r} must be an int number of pixels")
    if value <= 0:
        raise InputError(f"{name}={value} must be a positive multiple of {f}; leave {name} unset for the model's "
                         f"native size{native}")
    if value % f:
        raise InputError(f"{name}={value} must be a multiple of {f} ({limits.why_size()}); try "
                         f"{name}={max(f, value // f * f)}")


def _frames(name: str, value, limits: CallLimits) -> None:
    """``1 + f k`` frames (``f``: the VAE's temporal factor), whose ``k + 1`` latent frames make whole temporal
    patches of ``p`` (the transformer's): ``first + f p j`` with ``first = 1 + f (p - 1)``, the nearest named."""
    _int(name, value, 1, " (frames per video)")
    f, p = limits.frame_factor, limits.frame_patch
    if not f:
        return
    step, first = f * p, 1 + f * (p - 1)
    if value >= first and (value - first) % step == 0:
        return
    low = first + (value - first) // step * step if value >= first else None
    fits = f"try {low} or {low + step}" if low is not None else f"try {first}"
    if p == 1:
        raise InputError(f"{name}={value} must be {f}k+1 (the VAE keeps the first frame and compresses time by {f} "
                         f"after it); {fits}")
    raise InputError(f"{name}={value} must be {step}k+{first} (the VAE keeps the first frame and compresses time by "
                     f"{f} after it, and the transformer takes patches of {p} latent frames); {fits}")


def _clip_skip(name: str, value, limits: CallLimits) -> None:
    top = limits.max_clip_skip
    if not _is_int(value):
        raise InputTypeError(f"{name}={value!r} must be an int (layers to skip from the end)")
    if value < 0 or (top is not None and value > top):
        allowed = "0 or more" if top is None else f"0 to {top}"
        raise InputError(f"{name}={value}: the text encoder has layers for clip_skip {allowed}; pass one of those "
                         "(or leave it unset)")


def _seed(name: str, value, limits) -> None:
    if not _is_int(value):
        raise InputTypeError(f"{name}={value!r} must be an int (any size)")


def _fraction(name: str, value, limits) -> None:
    if not _is_real(value) or not 0.0 < value <= FRACTION_TOP[name]:
        raise InputError(f"{name}={value!r} must be a float in {FRACTION_RANGE[name]}: the fraction of the schedule "
                         f"{'before the hand-off' if name == 'denoising_start' else 'to run'}")


def _schedule(name: str, value, limits) -> None:
    values = np.asarray(value, dtype=object).ravel()
    if np.ndim(value) != 1 or values.size == 0 or not all(_is_real(v) and math.isfinite(v) for v in values):
        raise InputError(f"{name} must be a non-empty list of finite numbers (a custom schedule), got {value!r:.80}")


def _pair(name: str, value, limits, minimum: int) -> None:
    if not isinstance(value, (tuple, list)) or len(value) != 2 or not all(_is_int(v) for v in value):
        raise InputTypeError(f"{name}={value!r} must be two ints (height, width)")
    if min(value) < minimum:
        raise InputError(f"{name}={tuple(value)}: both must be >= {minimum}")


def _numbers(name: str, value, limits) -> None:
    """An array argument (latents, embeddings, their masks, per-video numbers) holds numbers: text or objects would
    reach ``jnp.asarray`` ('could not convert string to float') or a model."""
    if hasattr(value, "detach"):  # a torch tensor
        return
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        try:
            dtype = np.asarray(value).dtype
        except (ValueError, TypeError):  # ragged nesting
            dtype = np.dtype(object)
    if not (jax.dtypes.issubdtype(dtype, np.number) or jax.dtypes.issubdtype(dtype, np.bool_)):
        shown = " ".join(repr(value)[:40].split())  # one line, whatever the value prints
        raise InputTypeError(f"{name} must be numbers (an array: NumPy, JAX or torch), got {type(value).__name__} "
                             f"{shown}")


def _decode_fraction(name: str, value, limits) -> None:
    """LTX-Video's ``decode_timestep`` / ``decode_noise_scale`` (one number, or one per prompt or video): numbers in
    [0, 1], the decoder's timestep as a fraction of the schedule and the share of fresh noise mixed into the latents,
    ``(1 - s) z + s noise``. diffusers takes any float (no check); outside [0, 1] the latents are extrapolated past
    pure noise or past themselves, which no model card or training uses (0.03-0.05 are the recommended values)."""
    _numbers(name, value, limits)
    if hasattr(value, "detach"):  # a torch tensor: as NumPy
        value = value.detach().cpu().numpy()
    values = np.asarray(value, np.float64).reshape(-1)
    bad = values[~((values >= 0.0) & (values <= 1.0))]
    if bad.size:
        raise InputError(f"{name}={value!r:.60} must be in [0, 1] (got {bad[0]:g}): the decoder's timestep and the "
                         "noise mixed in as fractions (0 decodes the latents as they are, 0.03-0.05 is recommended)")


def _bool(name: str, value, limits) -> None:
    """A switch is True or False: a string such as 'no' would be truthy."""
    if not isinstance(value, (bool, np.bool_)):
        raise InputTypeError(f"{name}={value!r:.40} must be True or False")


def _output_type(name: str, value, limits) -> None:
    check_output_type(value)


# Guidance scales are bounded where they stay meaningful: at most 100 (1-20 is the useful range). Beyond it the
# guided output is the scale times a small difference, the latents leave the range the VAE decodes and the images
# saturate to flat colours (a scale of 1e30 drew a grey image) while every number stays finite, so no NaN check
# catches it. Below 0 nothing changes: guidance is off at or below 1, as in diffusers.
MAX_GUIDANCE = 100.0
GUIDANCE_WHY = " (1-20 is the useful range, 1 or less turns guidance off; far above it images saturate to flat colours)"

# name -> check(name, value, limits); a family's own arguments are checked by its own code.
CHECKS = {
    "prompt": _prompt, "prompt_2": _prompt, "negative_prompt": _prompt, "negative_prompt_2": _prompt,
    "height": _size, "width": _size,
    "num_inference_steps": lambda n, v, _: _int(n, v, 1, " (the number of denoising steps)"),
    "num_images_per_prompt": lambda n, v, _: _int(n, v, 1),
    "num_videos_per_prompt": lambda n, v, _: _int(n, v, 1),
    "num_frames": _frames,
    "max_sequence_length": lambda n, v, _: _int(n, v, 1),
    "guidance_scale": lambda n, v, _: _real_in(n, v, 0.0, MAX_GUIDANCE, why=GUIDANCE_WHY),
    "guidance_scale_2": lambda n, v, _: _real_in(n, v, 0.0, MAX_GUIDANCE, why=GUIDANCE_WHY),
    "true_cfg_scale": lambda n, v, _: _real_in(n, v, 0.0, MAX_GUIDANCE, why=GUIDANCE_WHY),
    "guidance_rescale": lambda n, v, _: _real_in(n, v, 0.0, 1.0, why=" (0 turns the rescale off, 0.7 is usual)"),
    "strength": lambda n, v, _: _real_in(n, v, 0.0, 1.0, open_low=True,
                                         why=" (the fraction of the schedule an image-to-image run takes)"),
    "eta": lambda n, v, _: _real_in(n, v, 0.0, 1.0, why=" (DDIM's noise: 0 is deterministic)"),
    "denoising_start": _fraction, "denoising_end": _fraction,
    "boundary_ratio": lambda n, v, _: _real_in(n, v, 0.0, 1.0, why=" (the fraction of the training timesteps above "
                                               "which the high-noise expert runs: 0.875 for Wan 2.2 text-to-video, "
                                               "0.9 for image-to-video)"),
    "timesteps": _schedule, "sigmas": _schedule,
    "seed": _seed, "clip_skip": _clip_skip,
    "original_size": lambda n, v, lim: _pair(n, v, lim, 1), "target_size": lambda n, v, lim: _pair(n, v, lim, 1),
    "negative_original_size": lambda n, v, lim: _pair(n, v, lim, 1),
    "negative_target_size": lambda n, v, lim: _pair(n, v, lim, 1),
    "crops_coords_top_left": lambda n, v, lim: _pair(n, v, lim, 0),
    "negative_crops_coords_top_left": lambda n, v, lim: _pair(n, v, lim, 0),
    "output_type": _output_type,
    "guess_mode": _bool, "_auto_resize": _bool, "progress": _bool,
    **dict.fromkeys(("latents", "prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds",
                     "negative_pooled_prompt_embeds", "prompt_attention_mask", "negative_prompt_attention_mask",
                     "image_embeds"), _numbers),
    **dict.fromkeys(("decode_timestep", "decode_noise_scale"), _decode_fraction),
}


# What to pass instead of NaN or infinity, for the arguments where that is not obvious.
FINITE_HINTS = {
    "guidance_scale": "pass a finite scale (7.5 is usual; 1 or less turns guidance off)",
    "latents": "the initial noise must be finite; draw it again, or leave latents unset",
    "prompt_embeds": "the text embeddings must be finite; encode the prompt again",
    "negative_prompt_embeds": "the text embeddings must be finite; encode the prompt again",
}


def check_output_type(output_type: str) -> None:
    if output_type not in OUTPUT_TYPES:
        raise InputError(f"output_type={output_type!r}; choose one of {OUTPUT_TYPES} (uint8 images, float32 images in "
                         "[0, 1], PIL images, or the final latents channels-last, e.g. for a refiner; 'pt' tensors "
                         "are not offered: convert the 'np' arrays)")


def _non_finite(name: str, value) -> str | None:
    """Why ``value`` (a number, numbers, or an array) is not finite, or ``None``."""
    if _is_real(value):
        return None if math.isfinite(value) else f"{name}={value}"
    if isinstance(value, (list, tuple)) and value and all(_is_real(v) for v in value):
        return None if all(math.isfinite(v) for v in value) else f"{name}={list(value)}"
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return None  # another host's rows: that host checks them
    if isinstance(value, (np.ndarray, jax.Array)) and jax.dtypes.issubdtype(value.dtype, np.floating):
        bad = int(np.size(value) - np.count_nonzero(np.isfinite(np.asarray(value, np.float32))))
        return None if bad == 0 else f"{name} holds {bad} NaN or infinite value(s) of {np.size(value)}"
    return None


def prompt_count(arguments: Mapping[str, Any]) -> int | None:
    """How many prompts a call's ``arguments`` hold: ``prompt``'s strings, else ``prompt_embeds``' rows; ``None``
    when neither says (checks of inputs given one per prompt run then before anything is encoded)."""
    prompt = arguments.get("prompt")
    if isinstance(prompt, str):
        return 1
    if isinstance(prompt, (list, tuple)) and prompt:
        return len(prompt)
    shape = getattr(arguments.get("prompt_embeds"), "shape", ())
    return int(shape[0]) if len(shape) >= 2 else None


def image_size(image) -> tuple[int, int] | None:
    """``(height, width)`` of pixel input(s): PIL images, or uint8 / float arrays ``[H, W, 3]`` or
    ``[n, H, W, 3]``; ``None`` for anything else (latents handed over, ...)."""
    if isinstance(image, Sequence) and image and isinstance(image[0], Image.Image):
        image = image[0]
    if isinstance(image, Image.Image):
        return image.height, image.width
    shape = np.shape(image) if isinstance(image, (np.ndarray, jax.Array)) else ()
    if len(shape) in (3, 4) and shape[-1] == 3:
        return int(shape[-3]), int(shape[-2])
    return None


def picture_size(image) -> tuple[int, int]:
    """:func:`image_size` of a call's ``image``, which must be pixels (:class:`InputError` naming the forms if not)."""
    size = image_size(image)
    if size is None:
        raise InputError("image must be a picture: uint8 [H, W, 3] or [1, H, W, 3], floats in [0, 1], or a PIL "
                         "image")
    return size


def pixel_size(height: int, width: int) -> str:
    """A size as errors and warnings print it, ``width 17, height 23``: ``23x17`` (height first, as arrays are) was
    read as 23 pixels wide."""
    return f"width {width}, height {height}"


def check_image_size(name: str, image, factor: int, why: str | None = None) -> None:
    """Pixel input ``image`` (argument ``name``) has a height and width that are multiples of ``factor`` (``why``:
    what makes it, default the VAE's downsampling)."""
    size = image_size(image)
    if size is not None and (size[0] % factor or size[1] % factor):
        h, w = (max(factor, s // factor * factor) for s in size)
        raise InputError(f"{name} has {pixel_size(*size)} pixels, not multiples of {factor} ("
                         f"{why or f'the VAE downsamples by {factor}'}); resize or crop it to {pixel_size(h, w)} "
                         "(eqxdiff does not resize input images)")


def check_arguments(arguments: Mapping[str, Any], limits: CallLimits = CallLimits(), *,
                    init_image: str | None = "image", required_image: str | None = None) -> None:
    """Check a call's arguments by their diffusers names (``None`` values are skipped): first, with
    ``required_image`` (what the picture is), that ``init_image`` is given; types and ranges of the shared ones
    (:data:`CHECKS`), finite numbers and arrays everywhere (NaN initial latents would give a black image),
    ``strength`` only with an input image, a hand-off's ``denoising_start < denoising_end``; sizes (and the pixel
    input named ``init_image``) against ``limits``. Warns when the output is far above the native size.
    """
    if required_image is not None and init_image in arguments and arguments[init_image] is None:
        raise InputError(f"pass {init_image}= ({required_image})")
    for name, value in arguments.items():
        if value is None:
            continue
        problem = _non_finite(name, value)
        if problem is not None:
            raise InputError(f"{problem}: {FINITE_HINTS.get(name, 'pass finite values')}")
        check = CHECKS.get(name)
        if check is not None:
            check(name, value, limits)
    if init_image is None:  # (a text-to-image call passing its keywords on to a family call that takes pictures)
        for name in ("strength", "mask_image", "denoising_start"):
            if arguments.get(name) is not None:
                raise InputError(f"{name}= needs a picture to start from, which this pipeline does not take; use its "
                                 f"family's image-to-image or inpainting pipeline, or leave {name} out")
    without_image = init_image in arguments and arguments[init_image] is None
    if arguments.get("strength") is not None and without_image:
        raise InputError(f"strength={arguments['strength']} applies to image-to-image only; pass {init_image}= (the "
                         "picture to start from) or leave strength unset")
    if arguments.get("denoising_start") is not None and without_image:
        raise InputError(f"denoising_start needs {init_image}= (the latents the first pipeline of the hand-off "
                         f"returned with output_type='latent'); got denoising_start={arguments['denoising_start']} "
                         "alone")
    if arguments.get("mask_image") is not None and without_image:
        raise InputError(f"mask_image needs {init_image}= (the picture to inpaint); pass both or neither")
    start, end = arguments.get("denoising_start"), arguments.get("denoising_end")
    if start is not None and end is not None and start >= end:
        raise InputError(f"denoising_start={start} must be smaller than denoising_end={end}")
    image = arguments.get(init_image) if init_image else None
    if limits.size_factor and image is not None:
        check_image_size(init_image, image, limits.size_factor, limits.why_size())
    _warn_if_large(arguments, limits, image_size(image) if image is not None else None)


def _warn_if_large(arguments: Mapping[str, Any], limits: CallLimits, from_image) -> None:
    if limits.native_size is None:
        return
    native_h, native_w = limits.native_size
    height = arguments.get("height") or (from_image or limits.native_size)[0]
    width = arguments.get("width") or (from_image or limits.native_size)[1]
    ratio = height * width / (native_h * native_w)
    f = limits.size_factor or 8
    tokens = (height // f) * (width // f)
    if ratio <= LARGE_OUTPUT_RATIO or tokens < LARGE_OUTPUT_TOKENS:
        return
    scores = tokens ** 2 * 4  # bytes of one float32 score matrix
    size = f"{scores / 2**30:.1f} GiB" if scores >= 2**30 else f"{scores / 2**20:.1f} MiB"
    warnings.warn(
        f"an output of {pixel_size(height, width)} pixels is {ratio:g}x the model's native size "
        f"({pixel_size(native_h, native_w)}): its attention runs over {tokens} latent tokens (a dense score matrix "
        f"alone takes {size} per head and image), so expect a slow run and a large memory footprint. Generate at the "
        "native size (or a small multiple), or resize the input image", InputWarning, stacklevel=4)


def check_finite_output(x, *, what: str, hint: str, finite=None) -> None:
    """Raise :class:`NonFiniteError` if any of the outputs ``x`` (batch-major) holds NaN or infinity; ``what``
    names them (``"images"``), ``hint`` says what to change. ``finite``: whether each output is finite, computed
    already (on the device: :func:`~eqxdiff.pipelines._images.uint8_on_device`), so ``x`` is not copied to the host."""
    if finite is not None:
        bad = int(np.sum(~np.asarray(finite)))
    else:
        x = np.asarray(jax.device_get(x), np.float32)
        bad = int(np.sum(~np.isfinite(x).reshape(len(x), -1).all(axis=1))) if x.ndim else 0
    if bad:
        raise NonFiniteError(f"the model produced NaN or infinite values in {bad} of {len(x)} {what}; {hint}")
