"""A family's command-line options, read from its pipeline's ``__call__``: the signature is the one source of truth.

Every argument of ``__call__`` whose annotation a command line can carry (``str``, ``int``, ``float``, ``bool``,
``Path``, ``Literal``, enums, tuples of those, optional or not) becomes a flag of the same name (diffusers' names:
``--num-inference-steps``, ``--guidance-scale``), with the signature's default. Its help is the ``__call__``
docstring's entry for it (an argument section in Google, NumPy or reST style, or eqxdiff's inline
"``name``: what it does." sentences) or, for the arguments diffusers' pipelines share, :data:`COMMON_HELP`.
Media inputs under diffusers' names (:data:`MEDIA_INPUTS`: ``image``, ``mask_image``, ``video`` ...) take a file path
that is read before the call (a mask in grayscale). Arrays (``latents``, ``prompt_embeds``), PRNG keys, callbacks and
``output_type`` are not flags. An argument that takes one value or a list of them (``int | Sequence[int]``, ``Picture |
Sequence[Picture] | None``: :func:`one_or_several`) is a repeatable flag: given once it passes the one value, repeated
the list (``--image a.png --frame-index 0 --image b.png --frame-index 160``). A ``__call__`` that takes ``**kwargs``
passes them on to its base class's (a ControlNet pipeline's to Stable Diffusion's), so the flags of the ``__call__`` s
further up the class's MRO join its own; an argument without annotation takes the annotation the same name has further
up, else its default's type (``control_guidance_start=0.0``: a float). A new family therefore needs nothing here:
annotate ``__call__`` and name its arguments as diffusers does.

:func:`given_options` says which of them a command line gives (the command passes only those on, so that a folder's
recommended call applies to the rest), and :func:`check_short_forms` refuses a short form (:data:`ALIASES`) and its
long form given with different values.
"""

import dataclasses
import enum
import inspect
import os
import re
import types
import typing
from collections import abc
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import docstring_parser
import numpy as np
import tyro
from PIL import Image

from ..pipelines import InputError, read_image, read_video
from ._command import FlagError, python_flag
from ._numbers import is_flag

# Short flags kept from eqxdiff's first generate script, so its commands still work.
ALIASES: Mapping[str, tuple[str, ...]] = {
    "num_inference_steps": ("--steps",),
    "num_images_per_prompt": ("--num-images",),
    "mask_image": ("--mask",),
    "ip_adapter_masks": ("--ip-adapter-mask",),
}

# Arguments that take a file: what to read it as.
MEDIA_INPUTS: Mapping[str, str] = {
    "image": "image", "mask_image": "mask", "control_image": "image", "last_image": "image",
    "ip_adapter_image": "image", "ip_adapter_masks": "image", "video": "video",
}

# Media inputs whose flag repeats though the signature does not say so: the command's one IP-Adapter reads the
# images of a repeated --ip-adapter-image together, each masked by the --ip-adapter-mask of its place; several
# adapters take one each (eqxdiff.cli._extras.adapter_images).
SEVERAL_MEDIA = ("ip_adapter_image", "ip_adapter_masks")

# Arguments the command decides itself: it saves uint8 images or frames.
NOT_FLAGS = ("output_type", "return_dict")

# Help for the arguments diffusers' pipelines share (a family's own docstring entry wins).
COMMON_HELP: Mapping[str, str] = {
    "prompt": "What to generate.",
    "negative_prompt": "What to steer away from (classifier-free guidance's unconditional prompt).",
    "num_inference_steps": "Number of denoising steps.",
    "guidance_scale": "Classifier-free guidance scale; 1.0 (or less) turns guidance off.",
    "guidance_rescale": "Rescale guided noise toward the text noise's std (0 = off; 0.7 suggested for zero-SNR "
                        "models).",
    "height": "Height in pixels; default: the model's native size.",
    "width": "Width in pixels; default: the model's native size.",
    "num_images_per_prompt": "Images (or videos) per prompt.",
    "num_frames": "Frames per video.",
    "frame_rate": "Frames per second the model is conditioned on (also the saved video's, unless --fps is given).",
    "seed": "Random seed (the same seed gives the same output).",
    "clip_skip": "Use the text encoder's hidden state this many layers before the last.",
    "strength": "Image-to-image: how much of the schedule to run (1.0 ignores the input image).",
    "max_sequence_length": "Longest prompt, in tokens, the text encoder reads.",
    "progress": "Show a progress bar.",
    "image": "An input image file (image-to-image, image-to-video, ...).",
    "mask_image": "A mask image file (white = repaint).",
    "control_image": "A control image file (edges, depth, pose ...).",
    "last_image": "The last frame, as an image file (first-last-frame-to-video).",
    "ip_adapter_image": "An image file for the IP-Adapter (repeated: several images, read together; with several "
                        "--ip-adapter: one per adapter).",
    "ip_adapter_masks": "A mask image file (white: where the image acts) for the --ip-adapter-image of its place "
                        "(repeated: one per image), as diffusers' IPAdapterMaskProcessor reads it at the output size.",
    "video": "An input video file.",
    "control_guidance_start": "ControlNet: the fraction of the steps before which the nets are off.",
    "control_guidance_end": "ControlNet: the fraction of the steps after which the nets are off.",
    "guess_mode": "ControlNet guess mode: the nets see only the prompted half of the guided batch and try to "
                  "recognise the control image's content without a prompt (guidance 3 to 5 suggested).",
}

_SCALARS = (str, int, float, bool, Path)


def _is_scalar(tp) -> bool:
    return (tp in _SCALARS or typing.get_origin(tp) is Literal
            or (isinstance(tp, type) and issubclass(tp, enum.Enum)))


def _is_union(tp) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _cli_type(annotation) -> Any | None:
    """The flag type the command line parses for ``annotation``, or ``None`` if it cannot carry it."""
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if _is_scalar(annotation):
        return annotation
    if _is_union(annotation):
        members = typing.get_args(annotation)
        optional = type(None) in members
        members = [m for m in members if m is not type(None)]
        scalars = [m for m in members if _is_scalar(m)]
        # `str | Sequence[str]` (one prompt or several) takes one on the command line.
        kept = scalars or [t for t in (_cli_type(m) for m in members) if t is not None]
        if not kept:
            return None
        return Union[tuple(kept) + ((type(None),) if optional else ())]  # noqa: UP007 - built at run time
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is tuple and args and all(_is_scalar(a) for a in args if a is not Ellipsis):
        return annotation
    if origin in (list, tuple, Sequence) and len(args) == 1 and _is_scalar(args[0]):
        return tuple[args[0], ...]
    return None


def one_or_several(annotation) -> Any | None:
    """The item type of an annotation that takes one value or a list of them (a union holding ``X`` and
    ``Sequence[X]``, ``list[X]`` or ``tuple[X, ...]``: ``int | Sequence[int]``, ``str | Sequence[str] | None``, a
    picture or a list of pictures), else ``None``."""
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if not _is_union(annotation):
        return None
    members = set(typing.get_args(annotation))
    for member in typing.get_args(annotation):
        args = typing.get_args(member)
        if typing.get_origin(member) not in (list, tuple, abc.Sequence) or not args or len(args) > 2 or (
                len(args) == 2 and args[1] is not Ellipsis):
            continue
        item = args[0]
        if set(typing.get_args(item) if _is_union(item) else (item,)) <= members:
            return item
    return None


# eqxdiff's own docstring style: "``eta``: DDIM's noise. ``timesteps`` / ``sigmas``: a custom schedule ..."
_INLINE = re.compile(r"((?:``\w+``(?:\s*(?:/|\+|,|or|and)\s*)?)+)\s*(\([^()]*\))?:\s")


def _documented(function) -> dict[str, str]:
    """Argument descriptions from ``function``'s docstring: an argument section (Google, NumPy or reST style),
    else eqxdiff's inline style, where a sentence starts with the argument names and a colon."""
    doc = inspect.getdoc(function) or ""
    try:
        parsed = {p.arg_name: " ".join(p.description.split())
                  for p in docstring_parser.parse(doc).params if p.description}
    except docstring_parser.ParseError:
        parsed = {}
    if parsed:
        return parsed
    found: dict[str, str] = {}
    for paragraph in doc.split("\n\n"):
        text = " ".join(paragraph.split())
        starts = list(_INLINE.finditer(text))
        for m, after in zip(starts, [*starts[1:], None]):
            sentence = text[m.start():after.start() if after else len(text)]
            sentence = re.split(r"(?<=\.)\s", sentence, maxsplit=1)[0].replace("``", "")  # to the first full stop
            for name in re.findall(r"``(\w+)``", m.group(1)):
                found.setdefault(name, sentence)
    return found


def _hints(function) -> dict[str, Any]:
    try:
        return typing.get_type_hints(function, include_extras=True)
    except (NameError, TypeError):  # an annotation that does not resolve (a forward reference): use the raw ones
        return {}


@dataclasses.dataclass(frozen=True)
class FamilyOptions:
    """The flags of one pipeline class: :attr:`options` is the frozen dataclass tyro parses, :meth:`call_kwargs`
    turns a parsed instance into ``__call__``'s keyword arguments. :attr:`several`: the repeatable flags (an
    argument taking one value or a list, :func:`one_or_several`) with the default each stands for when not given."""

    pipeline_class: type
    options: type
    media: Mapping[str, str]
    several: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    python_only: tuple[str, ...] = ()  # the call's arguments that are no flags (arrays, keys): Python's alone

    def values(self, parsed) -> dict[str, Any]:
        """``{argument: value}`` of a parsed instance as the call takes them, files still paths: a repeatable flag
        given once is its one value, repeated the list of them, not given its default."""
        values = {f.name: getattr(parsed, f.name) for f in dataclasses.fields(parsed)}
        for name, default in self.several.items():
            given = values[name]
            values[name] = default if not given else given[0] if len(given) == 1 else list(given)
        return values

    def call_kwargs(self, values) -> dict[str, Any]:
        """Keyword arguments for the pipeline call (:meth:`values`): media files read (images uint8 ``[H, W, 3]``,
        videos uint8 ``[F, H, W, 3]``; a list of files as a list of them), every other value as parsed."""
        kwargs = self.values(values)
        for name, kind in self.media.items():
            path = kwargs.get(name)
            if isinstance(path, list):
                kwargs[name] = [_read_flag(name, p, kind) for p in path]
            elif path is not None:
                kwargs[name] = _read_flag(name, path, kind)
        return kwargs


def _read_flag(name: str, path, kind: str) -> np.ndarray:
    """File ``path`` given as the flag of argument ``name``, read as ``kind`` (:func:`read_media`); what cannot be
    read is refused naming the flag."""
    flag = f"--{name.replace('_', '-')}"
    if not Path(path).is_file():
        raise FileNotFoundError(f"{flag} {os.fspath(path)!r}: no such file")
    try:
        return read_media(path, kind)
    except InputError as e:
        raise InputError(f"{flag}: {e}") from None
    except (ValueError, OSError, RuntimeError, StopIteration) as e:  # ffmpeg's errors included
        what = "a video file ffmpeg" if kind == "video" else "an image file Pillow"
        raise InputError(f"{flag} {os.fspath(path)!r} is not {what} can read ({type(e).__name__}); pass another "
                         "file") from None


def read_media(path, kind: str) -> np.ndarray:
    """File ``path`` as a pipeline takes it: ``"image"`` uint8 RGB ``[H, W, 3]``, ``"mask"`` uint8 grayscale
    ``[H, W]`` (PIL's ``convert("L")``, as diffusers' mask processor), ``"video"`` uint8 ``[F, H, W, 3]``."""
    if kind == "video":
        return read_video(path)
    rgb = read_image(path)
    return np.asarray(Image.fromarray(rgb).convert("L")) if kind == "mask" else rgb


def _call_chain(pipeline_class: type) -> list:
    """The ``__call__`` s a call of ``pipeline_class`` reaches: its own, then, while the last one takes
    ``**kwargs``, the next one up the MRO (where a subclass passes its keyword arguments on)."""
    calls = [k.__dict__["__call__"] for k in pipeline_class.__mro__ if "__call__" in k.__dict__]
    chain = []
    for call in calls:
        chain.append(call)
        kinds = {p.kind for p in inspect.signature(call).parameters.values()}
        if inspect.Parameter.VAR_KEYWORD not in kinds:
            break
    return chain


def family_options(pipeline_class: type, defaults: Mapping[str, Any] | None = None, *,
                   exclude: Sequence[str] = ()) -> FamilyOptions:
    """The command-line options of ``pipeline_class`` (see the module docstring); ``defaults`` replaces the
    signature's defaults of some of them (the shipped digits model's prompt); ``exclude`` names arguments that are
    not flags (the command sets them itself)."""
    chain = _call_chain(pipeline_class)
    hints = [_hints(call) for call in chain]
    documented: dict[str, str] = {}
    for klass in reversed(pipeline_class.__mro__):  # a subclass documents what differs; its own description wins
        if "__call__" in klass.__dict__:
            documented.update(_documented(klass.__dict__["__call__"]))
    defaults = dict(defaults or {})
    params: dict[str, tuple[inspect.Parameter, int]] = {}  # name -> (parameter, its __call__'s place in the chain)
    for i, call in enumerate(chain):
        for name, param in list(inspect.signature(call).parameters.items())[1:]:  # [0] is self
            if param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                params.setdefault(name, (param, i))
    fields, media, several = [], {}, {}
    for name, (param, i) in params.items():
        if name in NOT_FLAGS or name in exclude:
            continue
        annotation = _annotation(name, param, hints[i:])
        item = one_or_several(annotation)
        if name in MEDIA_INPUTS:
            tp, default, media[name] = Path | None, None, MEDIA_INPUTS[name]
            item = Path if item is not None or name in SEVERAL_MEDIA else None
        else:
            tp = _cli_type(annotation)
            if tp is None:
                continue
            default = defaults.pop(name, param.default)
            item = item if item is not None and _is_scalar(item) else None
        help_text = documented.get(name) or COMMON_HELP.get(name)
        if name in media and name in documented:  # say that the flag takes a file
            help_text = f"{COMMON_HELP[name]} {documented[name]}"
        extra: tuple = ()
        if item is not None:  # one value, or the flag repeated for a list (see the module docstring)
            several[name] = None if default is inspect.Parameter.empty else default
            shown = "" if default in (None, inspect.Parameter.empty) else f"; default: {default}"
            hint = f"(repeatable: once for one value, repeated for a list{shown})"
            tp, default, extra = tuple[item, ...], (), (tyro.conf.UseAppendAction,)
        else:
            hint = None
        renamed = {"name": python_flag(name)[2:]} if name.startswith("_") else {}  # tyro would keep the underscore
        marker = tyro.conf.arg(help=help_text, aliases=ALIASES.get(name), help_behavior_hint=hint, **renamed)
        field = (dataclasses.field() if default is inspect.Parameter.empty
                 else dataclasses.field(default=default))
        fields.append((name, Annotated[(tp, marker, *extra)], field))
    if defaults:
        raise ValueError(f"{pipeline_class.__name__}.__call__ has no command-line option(s) {sorted(defaults)}")
    fields.sort(key=lambda f: f[2].default is dataclasses.MISSING, reverse=True)  # required flags first
    options = dataclasses.make_dataclass(f"{pipeline_class.__name__}Options", fields, frozen=True)
    options.__doc__ = (f"Options of {pipeline_class.__name__} (the --model folder's pipeline), read from its "
                       "__call__: diffusers' argument names.")
    flagged = {f[0] for f in fields}
    python_only = tuple(n for n in params if n not in flagged and n not in NOT_FLAGS and n not in exclude)
    return FamilyOptions(pipeline_class, options, media, several, python_only)


def _annotation(name: str, param: inspect.Parameter, hints: Sequence[Mapping[str, Any]]):
    """``param``'s annotation; without one, the same name's further up the ``__call__`` chain (``hints``, from
    ``param``'s own ``__call__`` on), else the type of a bool, int, float or str default."""
    if name in hints[0]:
        return hints[0][name]
    if param.annotation is not inspect.Parameter.empty:
        return param.annotation
    for found in hints[1:]:
        if name in found:
            return found[name]
    default = param.default
    return type(default) if type(default) in (bool, int, float, str) else None


# -- what a command line gives ------------------------------------------------------------------------------------

def _flag_of(token: str) -> str | None:
    """The flag a command-line token names (``--num_inference_steps=4``: ``--num-inference-steps``), else ``None``."""
    return token.partition("=")[0].replace("_", "-") if token.startswith("--") and token != "--" else None


def _same(a: str, b: str) -> bool:
    try:
        return a == b or float(a) == float(b)
    except ValueError:
        return False


def check_short_forms(argv: Sequence[str]) -> None:
    """A short form (:data:`ALIASES`: ``--steps``, ``--num-images``, ``--mask``) and its long form given with
    different values: :class:`~eqxdiff.cli._command.FlagError` naming both (the last one would win unsaid). The same
    value twice (``--steps 4 --num-inference-steps 4.0`` too) is fine."""
    names = {form: name for name, shorts in ALIASES.items() for form in (python_flag(name), *shorts)}
    seen: dict[str, list[tuple[str, str, str]]] = {}  # name -> (form, as typed, value)
    for i, token in enumerate(argv):
        if token == "--":
            break
        form = _flag_of(token)
        name = names.get(form) if form else None
        if name is None:
            continue
        _, eq, value = token.partition("=")
        if not eq:
            if i + 1 == len(argv) or is_flag(argv[i + 1]):
                continue  # no value: tyro says so
            value = argv[i + 1]
        typed = token.partition("=")[0]
        for other_form, other, before in seen.get(name, ()):
            if other_form != form and not _same(before, value):
                short = form if form != python_flag(name) else other_form
                raise FlagError(f"{other} {before} and {typed} {value} disagree ({short} is short for "
                                f"{python_flag(name)}); give one of them")
        seen.setdefault(name, []).append((form, typed, value))


def given_options(argv: Sequence[str], options: type) -> set[str]:
    """The fields of ``options`` (a family's :attr:`FamilyOptions.options`) that ``argv`` gives: by their flag
    (``--num-inference-steps``, ``--num_inference_steps``, with ``=value`` or not), a short form (:data:`ALIASES`)
    or a bool's ``--no-`` form. The command passes only these to the pipeline, so that the folder's recommended call
    (its ``call_defaults``) applies to every argument the user left out."""
    flags = {}
    for field in dataclasses.fields(options):
        for form in (python_flag(field.name), "--no-" + python_flag(field.name)[2:], *ALIASES.get(field.name, ())):
            flags[form] = field.name
    given = set()
    for token in argv:
        if token == "--":
            break
        if _flag_of(token) in flags:
            given.add(flags[_flag_of(token)])
    return given
