"""What eqxdiff-generate puts on the --model pipeline besides LoRAs: textual-inversion embeddings
(``--textual-inversion``), FreeU (``--freeu``) and IP-Adapters (``--ip-adapter``, repeated for several, and
``--ip-adapter-scale``, one for all or one per adapter; the image prompt is the call's ``--ip-adapter-image``: one
adapter's images, or one per adapter with several): each checked against the pipeline class before anything loads,
put on the loaded pipeline, and recorded in the outputs' parameters."""

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..loading import is_hub_id
from ..pipelines import InputError, embedding_path

_IP_ADAPTER_FORM = ("a .safetensors file beside its image_encoder folder, or OWNER/NAME/[SUBFOLDER/]FILE.safetensors "
                    "on the Hub (h94/IP-Adapter/models/ip-adapter_sd15.safetensors)")


def textual_inversions(given: Sequence[str]) -> list[tuple[str, str | None]]:
    """``--textual-inversion`` values as ``(source, token or None)``: ``SOURCE[=TOKEN]``."""
    out = []
    for item in given:
        source, sep, token = item.partition("=")
        if not source or (sep and not token):
            raise InputError(f"--textual-inversion {item!r}: give SOURCE or SOURCE=TOKEN (a .safetensors file, a "
                             "folder or Hub id; TOKEN the word prompts use for it)")
        out.append((source, token or None))
    return out


def ip_adapter_source(value: str) -> tuple[str, str | None, str]:
    """``--ip-adapter``'s value as ``load_ip_adapter``'s ``(folder or Hub id, subfolder, weight_name)``: a local
    file's folder and name, or a Hub file's repository, the folders between and its name."""
    path = Path(value).expanduser()
    if path.exists() or not is_hub_id("/".join(value.split("/")[:2])) or len(value.split("/")) < 3:
        if not path.is_file() or path.suffix != ".safetensors":
            raise InputError(f"--ip-adapter {value!r}: give {_IP_ADAPTER_FORM}")
        return str(path.parent), None, path.name
    parts = value.split("/")
    if not parts[-1].endswith(".safetensors"):
        raise InputError(f"--ip-adapter {value!r}: give {_IP_ADAPTER_FORM}")
    return "/".join(parts[:2]), "/".join(parts[2:-1]) or None, parts[-1]


def check_extras(cls: type, run, kwargs: Mapping[str, Any]) -> None:
    """--freeu, --textual-inversion and --ip-adapter fit the pipeline class, and their local files are there
    (safetensors); --ip-adapter-image comes with --ip-adapter."""
    if run.freeu is not None:
        if not hasattr(cls, "enable_freeu"):
            raise InputError(f"--freeu: {cls.__name__} has no FreeU (a UNet pipeline's: SD, SDXL); leave it out")
        if not all(math.isfinite(v) for v in run.freeu):
            raise InputError(f"--freeu {' '.join(map(str, run.freeu))}: give four finite numbers, s1 s2 b1 b2")
    if run.textual_inversion and not hasattr(cls, "load_textual_inversion"):
        raise InputError(f"--textual-inversion: {cls.__name__} takes no textual inversion (SD, SDXL and Flux "
                         "pipelines do); leave it out")
    for source, _ in textual_inversions(run.textual_inversion):
        if Path(source).expanduser().exists() or not is_hub_id(source):
            embedding_path(source)
    if not run.ip_adapter:
        for name in ("ip_adapter_image", "ip_adapter_masks"):
            if kwargs.get(name) is not None:
                raise InputError(f"--{name.replace('_', '-')} needs --ip-adapter ({_IP_ADAPTER_FORM})")
        if run.ip_adapter_scale:
            raise InputError("--ip-adapter-scale needs --ip-adapter")
        return
    if not hasattr(cls, "load_ip_adapter"):
        raise InputError(f"--ip-adapter: {cls.__name__} takes no IP-Adapter (SD and SDXL pipelines do); leave it out")
    for value in run.ip_adapter:
        ip_adapter_source(value)
    if kwargs.get("ip_adapter_image") is None:
        raise InputError("--ip-adapter needs --ip-adapter-image (the image prompt)")
    ip_adapter_scales(run)
    n = len(run.ip_adapter)
    for name in ("ip_adapter_image", "ip_adapter_masks"):
        given = kwargs.get(name)
        count = len(given) if isinstance(given, list) else 1
        if n > 1 and given is not None and count != n:
            raise InputError(f"--{name.replace('_', '-').removesuffix('s')} given {count} time(s) for {n} "
                             "--ip-adapter: give one per adapter, in their order (one adapter takes several images)")


def ip_adapter_scales(run) -> float | list[float]:
    """--ip-adapter-scale as ``set_ip_adapter_scale`` takes it: one number (1 by default) or one per adapter."""
    scales, n = list(run.ip_adapter_scale), len(run.ip_adapter)
    if len(scales) not in (0, 1, n):
        raise InputError(f"--ip-adapter-scale given {len(scales)} times for {n} --ip-adapter: give one for all, or "
                         "one per adapter in their order")
    for scale in scales:
        if not math.isfinite(scale):
            raise InputError(f"--ip-adapter-scale {scale}: give a finite number")
    return scales if len(scales) > 1 else (scales or [1.0])[0]


def adapter_images(run, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The call's arguments with the --ip-adapter-image files in diffusers' list per adapter: with one adapter a
    repeated --ip-adapter-image gives it several images (``[[a, b]]``: their tokens read together; a plain list
    would give one image to each of several adapters) and the --ip-adapter-mask files are its masks
    (``[[mask_a, mask_b]]``); with several adapters each takes one image (``[a, b]``) and its mask (``[[m_a],
    [m_b]]``)."""
    out = dict(kwargs)
    images, masks = kwargs.get("ip_adapter_image"), kwargs.get("ip_adapter_masks")
    if len(run.ip_adapter) > 1:
        if masks is not None:
            out["ip_adapter_masks"] = [[m] for m in masks]
        return out
    if isinstance(images, list):
        out["ip_adapter_image"] = [images]
    if masks is not None:  # the one adapter's mask images, made into masks at the output size by the call
        out["ip_adapter_masks"] = [masks if isinstance(masks, list) else [masks]]
    return out


def before_loading(run, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The call's arguments as the class's checks see them before loading: with --ip-adapter, without the image
    prompt and masks (the adapter's checks need it loaded; they run at the call)."""
    if not run.ip_adapter:
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k not in ("ip_adapter_image", "ip_adapter_masks")}


def load_extras(pipe, run) -> None:
    """Put --textual-inversion, --ip-adapter and --freeu on the loaded pipeline."""
    for source, token in textual_inversions(run.textual_inversion):
        pipe.load_textual_inversion(source, token=token)
    if run.ip_adapter:
        sources, subfolders, weight_names = zip(*map(ip_adapter_source, run.ip_adapter))
        pipe.load_ip_adapter(list(sources), subfolder=list(subfolders), weight_name=list(weight_names))
        pipe.set_ip_adapter_scale(ip_adapter_scales(run))
    if run.freeu is not None:
        pipe.enable_freeu(*run.freeu)


def extras_metadata(run) -> dict[str, Any]:
    """What the outputs' parameters record of them."""
    out: dict[str, Any] = {}
    if run.textual_inversion:
        out["textual_inversion"] = list(run.textual_inversion)
    if run.ip_adapter:  # one adapter: its file and scale as before; several: lists
        out.update(ip_adapter=run.ip_adapter[0] if len(run.ip_adapter) == 1 else list(run.ip_adapter),
                   ip_adapter_scale=ip_adapter_scales(run))
    if run.freeu is not None:
        out["freeu"] = list(run.freeu)
    return out


__all__ = ["adapter_images", "before_loading", "check_extras", "extras_metadata", "ip_adapter_scales",
           "ip_adapter_source", "load_extras", "textual_inversions"]
