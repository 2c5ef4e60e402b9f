"""LoRA (and LyCORIS) files: where one is, its tensors and metadata, and its keys grouped into one record per
adapted module, whatever trainer wrote it.

A key is a module key and a *role*: ``<module>.lora_A.weight`` (PEFT/diffusers), ``<module>.lora_down.weight`` /
``.lora_up.weight`` / ``.lora_mid.weight`` / ``.alpha`` / ``.dora_scale`` (kohya, LyCORIS' LoCon),
``.hada_w1_a`` ... (LoHa), ``.lokr_w1`` ... (LoKr), ``.diff`` / ``.diff_b`` (full differences; lightx2v's
``<block>.diff_m``: the block's modulation table, whose name a family's layout aliases),
``.lora.down.weight`` / ``.lora_linear_layer.down.weight`` / ``_lora.down.weight`` (older diffusers processors),
``.down.weight`` (XLabs), and a module's bare ``.weight`` / ``.scale``: a whole new value replacing the parameter
(``"replace"``: BFL's control LoRAs carry their q/k norms' scales so). :func:`parse` groups them into :class:`Record` s; which model and layer a module key names
is the families' business (their prefixes and name tables), not this module's.
"""

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ._checkpoint import is_hub_id
from ._errors import PICKLE_SUFFIXES, CheckpointError, pickle_error
from ._safetensors import SafetensorsFile

DEFAULT_WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' name for a saved LoRA
METADATA_KEY = "lora_adapter_metadata"  # diffusers/PEFT: the LoraConfig (rank, alpha, patterns) as JSON

# role suffix -> (adapter kind or None for a shared role, role). Longest first when matched.
ROLES: Mapping[str, tuple[str | None, str]] = {
    ".lora_A.weight": ("lora", "down"), ".lora_B.weight": ("lora", "up"), ".lora_B.bias": ("lora", "bias"),
    ".lora_magnitude_vector.weight": (None, "magnitude"), ".lora_magnitude_vector": (None, "magnitude"),
    ".lora_down.weight": ("lora", "down"), ".lora_up.weight": ("lora", "up"), ".lora_mid.weight": ("lora", "mid"),
    ".lora.down.weight": ("lora", "down"), ".lora.up.weight": ("lora", "up"), ".lora.up.bias": ("lora", "bias"),
    ".lora_linear_layer.down.weight": ("lora", "down"), ".lora_linear_layer.up.weight": ("lora", "up"),
    ".lora_linear_layer.up.bias": ("lora", "bias"),  # PEFT's lora_B.bias in diffusers' older names
    "_lora.down.weight": ("lora", "down"), "_lora.up.weight": ("lora", "up"),
    ".down.weight": ("lora", "down"), ".up.weight": ("lora", "up"),
    ".alpha": (None, "alpha"), ".dora_scale": (None, "dora_scale"),
    ".hada_w1_a": ("loha", "w1a"), ".hada_w1_b": ("loha", "w1b"), ".hada_w2_a": ("loha", "w2a"),
    ".hada_w2_b": ("loha", "w2b"), ".hada_t1": ("loha", "t1"), ".hada_t2": ("loha", "t2"),
    ".lokr_w1": ("lokr", "w1"), ".lokr_w1_a": ("lokr", "w1a"), ".lokr_w1_b": ("lokr", "w1b"),
    ".lokr_w2": ("lokr", "w2"), ".lokr_w2_a": ("lokr", "w2a"), ".lokr_w2_b": ("lokr", "w2b"),
    ".lokr_t2": ("lokr", "t2"),
    ".diff": ("diff", "diff"), ".diff_b": ("diff", "diff_b"),
    ".diff_m": ("diff", "diff"),  # lightx2v: a block's modulation table (its module: the block; families alias it)
    # a whole new value of a parameter, replacing it (BFL's control LoRAs: the q/k RMSNorms' scales, ``.scale`` in
    # BFL's names, ``.weight`` in diffusers'); loaders take it as the difference from the model's value
    ".scale": ("replace", "weight"), ".weight": ("replace", "weight"),
}
_BY_LENGTH = sorted(ROLES, key=len, reverse=True)
REQUIRED = {"lora": (("down",), ("up",)), "loha": (("w1a",), ("w1b",), ("w2a",), ("w2b",)),
            "lokr": (("w1", "w1a"), ("w2", "w2a")), "diff": (("diff", "diff_b"),), "replace": (("weight",),)}
STYLES = {".lora_A.weight": "PEFT", ".lora_down.weight": "kohya", ".lora.down.weight": "lora.down",
          ".lora_linear_layer.down.weight": "diffusers (legacy)", "_lora.down.weight": "diffusers (legacy)",
          ".down.weight": "XLabs", ".hada_w1_a": "LyCORIS LoHa", ".lokr_w1": "LyCORIS LoKr",
          ".lokr_w1_a": "LyCORIS LoKr", ".lokr_w2_a": "LyCORIS LoKr", ".lokr_w2": "LyCORIS LoKr",
          ".diff": "full diff", ".diff_b": "full diff", ".diff_m": "full diff", ".scale": "replaced parameter",
          ".weight": "replaced parameter"}


@dataclasses.dataclass(frozen=True)
class LoraFile:
    """A LoRA file's tensors (read-only NumPy views of its memory map), its safetensors metadata and where it is."""

    path: str
    tensors: Mapping[str, np.ndarray]
    metadata: Mapping[str, str]

    def sha256(self) -> str:
        h = hashlib.sha256()
        with open(self.path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()

    def peft_config(self) -> dict:
        """diffusers/PEFT's ``LoraConfig`` saved in the metadata (``{}`` if none), its keys as written
        (``unet.lora_alpha`` per component, or ``lora_alpha`` for one model)."""
        raw = self.metadata.get(METADATA_KEY)
        if not raw:
            return {}
        try:
            config = json.loads(raw)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{self.path!r}: its {METADATA_KEY} metadata is not JSON ({e})") from None
        return config if isinstance(config, dict) else {}


def lora_path(path_or_hub_id, *, weight_name: str | None = None, revision: str | None = None) -> Path:
    """The ``.safetensors`` LoRA file ``path_or_hub_id`` names (:func:`safetensors_path`; diffusers' name
    ``pytorch_lora_weights.safetensors`` by default)."""
    return safetensors_path(path_or_hub_id, weight_name=weight_name, revision=revision)


def safetensors_path(path_or_hub_id, *, weight_name: str | None = None, revision: str | None = None,
                     default_name: str = DEFAULT_WEIGHT_NAME, what: str = "LoRA") -> Path:
    """The ``.safetensors`` file (of a ``what``: messages) ``path_or_hub_id`` names: a file; a folder holding
    ``weight_name`` (default: its only ``.safetensors`` file, or ``default_name``); or a Hub repository's
    ``weight_name`` (default ``default_name``; fetched with ``huggingface_hub``)."""
    p = os.fspath(path_or_hub_id)
    local = Path(p).expanduser()
    if local.is_dir():
        if weight_name is None:
            found = sorted(local.glob("*.safetensors"))
            if len(found) == 1:
                return found[0]
            weight_name = default_name
            if not (local / weight_name).is_file():
                names = [f.name for f in found]
                raise CheckpointError(f"{p!r} holds {len(found)} .safetensors files {names}; say which with "
                                      "weight_name=")
        local = local / weight_name
    elif not local.exists() and is_hub_id(p):
        from huggingface_hub import hf_hub_download

        try:
            local = Path(hf_hub_download(p, weight_name or default_name, revision=revision))
        except Exception as e:  # network, auth, offline, missing file
            raise CheckpointError(f"could not fetch {weight_name or default_name!r} of {p!r} from the Hugging "
                                  f"Face Hub ({type(e).__name__}: {e}); download it and pass the file instead, or "
                                  "give weight_name=") from e
    if local.suffix.lower() in PICKLE_SUFFIXES:
        raise pickle_error(local)
    if not local.is_file():
        raise CheckpointError(f"{what} file {os.fspath(local)!r} not found; pass a .safetensors file, a folder "
                              "holding one, or a Hugging Face Hub id (with weight_name=)")
    if local.suffix.lower() != ".safetensors":
        raise CheckpointError(f"{os.fspath(local)!r} is not a .safetensors file; eqxdiff reads "
                              f"{'LoRAs' if what == 'LoRA' else what + ' files'} in safetensors")
    return local


def read_safetensors_file(path_or_hub_id, **kwargs) -> dict[str, np.ndarray]:
    """The tensors of the ``.safetensors`` file :func:`safetensors_path` finds (``kwargs``: its keywords)."""
    f = SafetensorsFile(safetensors_path(path_or_hub_id, **kwargs))
    return {n: f.get(n) for n in f.names()}


def read_lora(path_or_hub_id, *, weight_name: str | None = None, revision: str | None = None) -> LoraFile:
    """The tensors and metadata of a LoRA file (see :func:`lora_path` for what names one)."""
    path = lora_path(path_or_hub_id, weight_name=weight_name, revision=revision)
    f = SafetensorsFile(path)
    tensors = {n: f.get(n) for n in f.names()}
    if not tensors:
        raise CheckpointError(f"{os.fspath(path)!r} holds no tensors: not a LoRA file")
    return LoraFile(os.fspath(path), tensors, dict(f.metadata))


@dataclasses.dataclass
class Record:
    """The tensors a file holds for one module. ``key``: the module key as written (prefix included; diffusers'
    legacy processor names normalised, ``...attn1.processor.to_out_lora`` -> ``...attn1.to_out.0``); ``kind``:
    ``"lora"``, ``"loha"``, ``"lokr"``, ``"diff"`` or ``"replace"`` (a parameter's new value, role ``weight``); ``tensors``: role -> array (an adapter's ``diff`` / ``diff_b``
    roles beside its own: whole differences that add to its change, lightx2v's LoRA pairs with ``diff_b``);
    ``alpha``: the file's ``.alpha``;
    ``magnitude`` / ``dora``: a DoRA magnitude and its convention (``"peft"``: ``lora_magnitude_vector``,
    ``"lycoris"``: ``dora_scale``); ``style``: the key style (``"PEFT"``, ``"kohya"`` ...); ``keys``: the file's keys
    it was read from."""

    key: str
    kind: str | None = None
    tensors: dict = dataclasses.field(default_factory=dict)
    alpha: float | None = None
    magnitude: np.ndarray | None = None
    dora: str | None = None
    style: str | None = None
    keys: list = dataclasses.field(default_factory=list)

    @property
    def rank(self) -> int:
        t = self.tensors
        for role in ("down", "w1b", "w2b", "w1a"):
            if role in t:
                return int(t[role].shape[0]) if role != "w1a" or self.kind != "lokr" else int(t[role].shape[1])
        return 0


def _split(key: str) -> tuple[str, str] | None:
    for suffix in _BY_LENGTH:
        if key.endswith(suffix) and len(key) > len(suffix):
            return key[:-len(suffix)], suffix
    return None


def _legacy_name(module: str, suffix: str) -> str:
    """diffusers' attention-processor LoRA names (``attn1.processor.to_q_lora``) as module names
    (``attn1.to_q``); ``to_out`` is diffusers' ``to_out.0``."""
    if suffix.startswith("_lora."):
        module = re.sub(r"\.processor\.", ".", module)
        if module.endswith(".to_out"):
            module += ".0"
    return module


def parse(tensors: Mapping[str, np.ndarray]) -> tuple[list[Record], list[str]]:
    """The file's keys grouped into one :class:`Record` per module, and the keys of no known role."""
    records: dict[str, Record] = {}
    unknown = []
    for key in tensors:
        split = _split(key)
        if split is None:
            unknown.append(key)
            continue
        module, suffix = split
        kind, role = ROLES[suffix]
        module = _legacy_name(module, suffix)
        rec = records.setdefault(module, Record(module))
        rec.keys.append(key)
        if role == "alpha":
            rec.alpha = float(np.asarray(tensors[key], dtype=np.float64).reshape(-1)[0])
        elif role in ("magnitude", "dora_scale"):
            rec.magnitude, rec.dora = tensors[key], "peft" if role == "magnitude" else "lycoris"
        else:
            if rec.kind is not None and rec.kind != kind:
                if "diff" not in (rec.kind, kind) or "replace" in (rec.kind, kind):
                    raise CheckpointError(f"module {module!r} holds tensors of two adapter kinds ({rec.kind} and "
                                          f"{kind}, e.g. {key!r}); one module takes one adapter per file")
                kind = rec.kind if kind == "diff" else kind  # a whole difference beside an adapter adds to it
            rec.kind = kind
            rec.tensors[role] = tensors[key]
            rec.style = rec.style or STYLES.get(suffix)
    out = []
    for rec in records.values():
        if rec.kind is None:
            unknown.extend(rec.keys)  # an alpha or magnitude without an adapter
            continue
        missing = [" or ".join(choice) for choice in REQUIRED[rec.kind] if not any(c in rec.tensors for c in choice)]
        if missing:
            raise CheckpointError(f"module {rec.key!r} has {sorted(rec.tensors)} but no {', '.join(missing)}: an "
                                  f"incomplete {rec.kind} adapter (the file is cut short or mixes formats)")
        out.append(rec)
    return out, unknown


def peft_alpha(config: Mapping, prefix: str, module: str) -> tuple[float | None, bool]:
    """``(lora_alpha, use_rslora)`` PEFT's ``LoraConfig`` (``config``: the metadata's, keys prefixed with ``prefix.``
    per component, or not prefixed) gives ``module`` (its name within the component): ``alpha_pattern`` first (a
    pattern matching the name's end at a dot, as PEFT matches), then ``lora_alpha``; ``None`` without a config."""
    scoped = {k[len(prefix) + 1:]: v for k, v in config.items() if prefix and k.startswith(prefix + ".")}
    if not scoped:
        scoped = {k: v for k, v in config.items() if "." not in k}
    if "lora_alpha" not in scoped and "alpha_pattern" not in scoped:
        return None, False
    for pattern, alpha in (scoped.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return float(alpha), bool(scoped.get("use_rslora"))
    alpha = scoped.get("lora_alpha")
    return (None if alpha is None else float(alpha)), bool(scoped.get("use_rslora"))


__all__ = ["DEFAULT_WEIGHT_NAME", "LoraFile", "METADATA_KEY", "ROLES", "Record", "lora_path", "parse", "peft_alpha",
           "read_lora"]
