"""Random LoRA / LyCORIS files in each trainer's layout, for the modules of a PyTorch (diffusers / transformers)
model: every tensor random and non-zero, so a wrong mapping, a dropped scale or a silent no-op cannot hide."""

import contextlib
import json
import re

import numpy as np
import torch
from safetensors.torch import save_file


def modules(model: torch.nn.Module, pattern: str, kinds=(torch.nn.Linear, torch.nn.Conv2d)) -> dict:
    """``{name: module}`` of the layers of ``kinds`` whose name matches ``pattern`` (``re.search``)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, kinds) and re.search(pattern, n)}


def checkpoint_named(text_encoder: torch.nn.Module) -> torch.nn.Module:
    """A transformers text encoder whose module names are its checkpoint names, the ones LoRA files use:
    transformers 5's ``CLIPTextModel`` drops ``text_model.`` from its module names (not from its files)."""
    if any(n.startswith("text_model.") for n, _ in text_encoder.named_modules()):
        return text_encoder
    return torch.nn.ModuleDict({"text_model": text_encoder})


class Rand:
    """Seeded random tensors: ``down`` rows of norm ~1 per input, ``up`` small, so the adapted output moves but
    stays in range."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, *shape, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen) * scale

    def down(self, rank: int, module) -> torch.Tensor:
        w = module.weight
        fan_in = int(np.prod(w.shape[1:]))
        return self(rank, *w.shape[1:], scale=1.0 / np.sqrt(fan_in))

    def up(self, rank: int, module, conv: bool | None = None) -> torch.Tensor:
        conv = module.weight.ndim == 4 if conv is None else conv
        return self(module.weight.shape[0], rank, *((1, 1) if conv else ()), scale=0.5 / np.sqrt(rank))

    def vector(self, n: int, scale: float = 0.05) -> torch.Tensor:
        return self(n, scale=scale)


def underscored(prefix: str, name: str) -> str:
    return prefix + name.replace(".", "_")


def peft(mods: dict, prefix: str, rand: Rand, rank=4, *, bias: bool = False, dora: bool = False,
         ranks: dict | None = None) -> dict:
    """diffusers/PEFT ``<prefix><name>.lora_A.weight`` / ``lora_B.weight`` (``lora_B.bias``, ``lora_magnitude_vector``);
    ``ranks``: a rank per name suffix (a rank pattern)."""
    out = {}
    for name, m in mods.items():
        r = next((v for k, v in (ranks or {}).items() if name.endswith(k)), rank)
        out[f"{prefix}{name}.lora_A.weight"] = rand.down(r, m)
        out[f"{prefix}{name}.lora_B.weight"] = rand.up(r, m)
        if bias:
            out[f"{prefix}{name}.lora_B.bias"] = rand.vector(m.weight.shape[0])
        if dora:
            norms = m.weight.detach().reshape(m.weight.shape[0], -1).norm(dim=1)
            out[f"{prefix}{name}.lora_magnitude_vector"] = norms * (1 + rand.vector(m.weight.shape[0], 0.2))
    return out


def kohya(mods: dict, prefix: str, rand: Rand, rank=4, *, alpha: float | None = 2.0, mid: bool = False,
          dora: bool = False) -> dict:
    """kohya ``<prefix>_<name_with_underscores>.lora_down.weight`` / ``lora_up.weight`` / ``alpha``; a convolution
    gets LoCon tensors (with ``lora_mid`` if ``mid``); ``dora``: LyCORIS' ``dora_scale`` (per output row)."""
    out = {}
    for name, m in mods.items():
        key = underscored(prefix, name)
        w = m.weight
        if w.ndim == 4 and mid and w.shape[2] > 1:
            out[f"{key}.lora_down.weight"] = rand(rank, w.shape[1], 1, 1, scale=1 / np.sqrt(w.shape[1]))
            out[f"{key}.lora_mid.weight"] = rand(rank, rank, *w.shape[2:], scale=1 / np.sqrt(rank * 9))
        else:
            out[f"{key}.lora_down.weight"] = rand.down(rank, m)
        out[f"{key}.lora_up.weight"] = rand.up(rank, m)
        if alpha is not None:
            out[f"{key}.alpha"] = torch.tensor(float(alpha))
        if dora:
            norms = w.detach().reshape(w.shape[0], -1).norm(dim=1)
            out[f"{key}.dora_scale"] = (norms * (1 + rand.vector(w.shape[0], 0.2))).reshape(-1, *(1,) * (w.ndim - 1))
    return out


def loha(name_key: str, m, rand: Rand, rank=3, *, tucker: bool = False, alpha: float = 2.0) -> dict:
    w = m.weight
    out, cin = w.shape[0], w.shape[1]
    k = tuple(w.shape[2:])
    t = {}
    for i in ("1", "2"):
        if tucker:
            t[f"{name_key}.hada_w{i}_a"] = rand(rank, out, scale=0.5)
            t[f"{name_key}.hada_w{i}_b"] = rand(rank, cin, scale=0.5 / np.sqrt(cin))
            t[f"{name_key}.hada_t{i}"] = rand(rank, rank, *k, scale=0.5)
        else:
            t[f"{name_key}.hada_w{i}_a"] = rand(out, rank, scale=0.5)
            t[f"{name_key}.hada_w{i}_b"] = rand(rank, cin * int(np.prod(k)), scale=0.5 / np.sqrt(cin))
    t[f"{name_key}.alpha"] = torch.tensor(float(alpha))
    return t


def lokr(name_key: str, m, rand: Rand, rank=2, *, factor: int = 2, tucker: bool = False, alpha: float = 3.0) -> dict:
    """LoKr with a whole ``w1`` ``[factor, factor]`` and a low-rank ``w2`` (Tucker ``t2`` on a convolution if
    ``tucker``)."""
    w = m.weight
    out, cin = w.shape[0] // factor, w.shape[1] // factor
    k = tuple(w.shape[2:])
    t = {f"{name_key}.lokr_w1": rand(factor, factor, scale=0.5)}
    if tucker:
        t[f"{name_key}.lokr_w2_a"] = rand(rank, out, scale=0.5)
        t[f"{name_key}.lokr_w2_b"] = rand(rank, cin, scale=0.5 / np.sqrt(cin))
        t[f"{name_key}.lokr_t2"] = rand(rank, rank, *k, scale=0.5)
    else:
        t[f"{name_key}.lokr_w2_a"] = rand(out, rank, scale=0.5)
        t[f"{name_key}.lokr_w2_b"] = rand(rank, cin * int(np.prod(k)), scale=0.5 / np.sqrt(cin))
    t[f"{name_key}.alpha"] = torch.tensor(float(alpha))
    return t


def full(name_key: str, m, rand: Rand) -> dict:
    w = m.weight
    t = {f"{name_key}.diff": rand(*w.shape, scale=0.2 / np.sqrt(np.prod(w.shape[1:])))}
    if m.bias is not None:
        t[f"{name_key}.diff_b"] = rand.vector(w.shape[0])
    return t


def save(tensors: dict, path, metadata: dict | None = None):
    meta = {"format": "pt"}
    if metadata:
        meta["lora_adapter_metadata"] = json.dumps(metadata)
    save_file({k: v.detach().contiguous().float() for k, v in tensors.items()}, str(path), metadata=meta)
    return path


@contextlib.contextmanager
def lycoris_applied(path, models: dict):
    """The torch ``models`` (kohya prefix -> module; text encoders through :func:`checkpoint_named`) running
    LyCORIS' own reading of the file at ``path`` in their forward (``apply_to``), removed on exit."""
    from lycoris import LycorisNetwork, create_lycoris_from_weights
    from safetensors.torch import load_file

    weights = load_file(str(path))
    prefix, networks = LycorisNetwork.LORA_PREFIX, []
    try:
        for lycoris_prefix, model in models.items():
            LycorisNetwork.LORA_PREFIX = lycoris_prefix
            part = {k: v for k, v in weights.items() if k.startswith(lycoris_prefix + "_")}
            network, _ = create_lycoris_from_weights(1.0, None, model, part)
            assert len(network.loras) == len({k.split(".")[0] for k in part}), "LyCORIS did not read every module"
            for module in network.loras:
                module.apply_to()
            networks.append(network)
        yield
    finally:
        LycorisNetwork.LORA_PREFIX = prefix
        for network in networks:
            network.restore()
