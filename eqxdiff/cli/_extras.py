"""What eqxdiff-generate puts on the --model pipeline besides LoRAs: textual-inversion embeddings
(``--textual-inversion``), FreeU (``--freeu``) and an IP-Adapter (``--ip-adapter``, ``--ip-adapter-scale``; the image
prompt is the call's ``--ip-adapter-image``): each checked against the pipeline class before anything loads, put on
the loaded pipeline, and recorded in the outputs' parameters."""

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
    if run.ip_adapter is None:
        for name in ("ip_adapter_image", "ip_adapter_masks"):
            if kwargs.get(name) is not None:
                raise InputError(f"--{name.replace('_', '-')} needs --ip-adapter ({_IP_ADAPTER_FORM})")
        return
    if not hasattr(cls, "load_ip_adapter"):
        raise InputError(f"--ip-adapter: {cls.__name__} takes no IP-Adapter (SD and SDXL pipelines do); leave it out")
    ip_adapter_source(run.ip_adapter)
    if kwargs.get("ip_adapter_image") is None:
        raise InputError("--ip-adapter needs --ip-adapter-image (the image prompt)")
    if not math.isfinite(run.ip_adapter_scale):
        raise InputError(f"--ip-adapter-scale {run.ip_adapter_scale}: give a finite number")


def one_adapter_images(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The call's arguments with a repeated --ip-adapter-image as the images of the command's one adapter (diffusers'
    ``[[a, b]]``: their tokens read together; a plain list would give one image to each of several adapters), and
    the --ip-adapter-mask files as that adapter's masks (``[[mask_a, mask_b]]``)."""
    out = dict(kwargs)
    images = kwargs.get("ip_adapter_image")
    if isinstance(images, list):
        out["ip_adapter_image"] = [images]
    masks = kwargs.get("ip_adapter_masks")
    if masks is not None:  # the one adapter's mask images, made into masks at the output size by the call
        out["ip_adapter_masks"] = [masks if isinstance(masks, list) else [masks]]
    return out


def before_loading(run, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The call's arguments as the class's checks see them before loading: with --ip-adapter, without the image
    prompt and masks (the adapter's checks need it loaded; they run at the call)."""
    if run.ip_adapter is None:
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k not in ("ip_adapter_image", "ip_adapter_masks")}


def load_extras(pipe, run) -> None:
    """Put --textual-inversion, --ip-adapter and --freeu on the loaded pipeline."""
    for source, token in textual_inversions(run.textual_inversion):
        pipe.load_textual_inversion(source, token=token)
    if run.ip_adapter is not None:
        source, subfolder, weight_name = ip_adapter_source(run.ip_adapter)
        pipe.load_ip_adapter(source, subfolder=subfolder, weight_name=weight_name)
        pipe.set_ip_adapter_scale(run.ip_adapter_scale)
    if run.freeu is not None:
        pipe.enable_freeu(*run.freeu)


def extras_metadata(run) -> dict[str, Any]:
    """What the outputs' parameters record of them."""
    out: dict[str, Any] = {}
    if run.textual_inversion:
        out["textual_inversion"] = list(run.textual_inversion)
    if run.ip_adapter is not None:
        out.update(ip_adapter=run.ip_adapter, ip_adapter_scale=run.ip_adapter_scale)
    if run.freeu is not None:
        out["freeu"] = list(run.freeu)
    return out


__all__ = ["before_loading", "check_extras", "extras_metadata", "ip_adapter_source", "load_extras",
           "one_adapter_images", "textual_inversions"]
