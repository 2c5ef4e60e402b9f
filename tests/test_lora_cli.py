"""The pipelines' LoRA follow-ups, on the shipped digits model (a tiny Stable Diffusion folder; its LoRA files
are built here, every tensor random and non-zero).

- ``from_pipe`` / ``with_scheduler`` carry the adapters' bookkeeping (a copy) for the models they share.
- ``save_pipeline`` / ``save_pretrained`` of a model holding unfused adapters write the weights only, with one
  warning that says to fuse first; fused adapters are saved in the weights.
"""

import re
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

import eqxdiff
from eqxdiff import nn
from eqxdiff.loading import AdaptersNotSavedWarning, SafetensorsFile
from eqxdiff.pipelines import StableDiffusionPipeline

ATTENTION = r"attn[12]\.to_(q|k|v|out\.0)$"


def digits_lora(path, pipe, *, seed: int = 0, rank: int = 2, pattern: str = ATTENTION, extra: dict | None = None):
    """A PEFT file (``unet.<name>.lora_A.weight`` / ``lora_B.weight``) for the digits UNet's layers matching
    ``pattern``: every tensor random, the change large enough to move a 16-pixel digit."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for site in nn.adapter_sites(pipe.unet):
        if site.layers is None and re.search(pattern, site.name):
            out, fan_in, kernel = site.shape[0], int(np.prod(site.shape[1:])), (1,) * (len(site.shape) - 2)
            tensors[f"unet.{site.name}.lora_A.weight"] = (rng.standard_normal((rank, *site.shape[1:]))
                                                          / np.sqrt(fan_in)).astype(np.float32)
            tensors[f"unet.{site.name}.lora_B.weight"] = (rng.standard_normal((out, rank, *kernel))
                                                          * 0.5).astype(np.float32)
    tensors.update(extra or {})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return Path(path)


def flux_lora(path):
    """kohya's Black Forest Labs names (Flux.1's fused ``qkv``): a file for another family."""
    t = {f"lora_unet_double_blocks_{i}_img_attn_qkv.lora_down.weight": np.ones((2, 8), np.float32) for i in range(3)}
    t.update({k.replace("down", "up"): np.ones((24, 2), np.float32) for k in list(t)})
    save_file(t, str(path))
    return Path(path)


@pytest.fixture(scope="module")
def pipe():
    return eqxdiff.load_pipeline("digits")


@pytest.fixture(scope="module")
def files(pipe, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return {"style": digits_lora(root / "style.safetensors", pipe, seed=1),
            "style_2": digits_lora(root / "other" / "style.safetensors", pipe, seed=2, pattern=r"attn2\.to_(k|v)$"),
            "partly": digits_lora(root / "partly.safetensors", pipe, seed=3,
                                  extra={"unet.no.such.layer.lora_A.weight": np.ones((2, 4), np.float32),
                                         "unet.no.such.layer.lora_B.weight": np.ones((4, 2), np.float32)}),
            "root": root}


# -- from_pipe / with_scheduler carry the adapters -------------------------------------------------------------------

def _scales(model) -> list[np.ndarray]:
    return [np.asarray(a.scales) for a in nn.adapters_at(model).values()]


def test_from_pipe_and_with_scheduler_carry_the_adapters(pipe, files):
    pipe.load_lora_weights(files["style"], adapter_name="style")
    try:
        pipe.set_adapters("style", 0.5)
        swapped = pipe.with_scheduler("ddim")
        assert swapped.get_list_adapters() == {"unet": ["style"]} and swapped.get_active_adapters() == ["style"]
        swapped.set_adapters("style", 0.8)  # refused before: "no adapter named ['style']"
        assert all(np.allclose(s, 0.8) for s in _scales(swapped.unet))
        assert all(np.allclose(s, 0.5) for s in _scales(pipe.unet)), "the source pipeline's models changed"
        assert pipe.lora_adapters()[0]["weight"] == 0.5
        swapped.disable_lora()
        assert pipe.lora_adapters()[0]["active"] and not swapped.lora_adapters()[0]["active"]
        swapped.enable_lora()
        swapped.fuse_lora()
        assert not nn.adapters_at(swapped.unet) and nn.adapters_at(pipe.unet)
        swapped.unfuse_lora()
        assert swapped.get_list_adapters() == {"unet": ["style"]}
        swapped.unload_lora_weights()  # the very models loaded, the source's untouched
        assert swapped.unet is pipe._lora().original["unet"] and nn.adapters_at(pipe.unet)
        # A component given anew holds none of the adapters: not carried.
        fresh = StableDiffusionPipeline.from_pipe(pipe, unet=pipe._lora().original["unet"])
        assert fresh.get_list_adapters() == {}
        with pytest.raises(ValueError, match="no adapter named"):
            fresh.set_adapters("style")
        assert StableDiffusionPipeline.from_pipe(pipe, unet=pipe.unet).get_list_adapters() == {"unet": ["style"]}
    finally:
        pipe.unload_lora_weights()


# -- saving: the weights only, unless fused --------------------------------------------------------------------------

def _saved_names(folder) -> list[str]:
    return list(SafetensorsFile(Path(folder) / "diffusion_pytorch_model.safetensors").names())


def test_saving_leaves_unfused_adapters_out_with_one_warning(pipe, files, tmp_path):
    plain = jax.tree.leaves(pipe.unet)
    pipe.load_lora_weights(files["style"], adapter_name="style")
    try:
        with pytest.warns(AdaptersNotSavedWarning) as caught:
            eqxdiff.save_pipeline(pipe, tmp_path / "pipe")
        assert len(caught) == 1, [str(w.message) for w in caught]
        assert "the adapters ['style'] are not fused into the weights of unet" in str(caught[0].message)
        assert "pipe.fuse_lora() before saving" in str(caught[0].message)
        with pytest.warns(AdaptersNotSavedWarning, match=r"UNet2DConditionModel holds unfused LoRA/LyCORIS adapters "
                          r"in \d+ layers: .*fuse them first"):
            eqxdiff.save_pretrained(pipe.unet, tmp_path / "unet")
        for folder in (tmp_path / "pipe" / "unet", tmp_path / "unet"):
            assert not [n for n in _saved_names(folder) if "adapters" in n]
            saved = jax.tree.leaves(eqxdiff.load(folder))
            assert all(np.array_equal(a, b) for a, b in zip(saved, plain, strict=True))
        pipe.fuse_lora()  # fused: in the weights, no warning
        fused = jax.tree.leaves(pipe.unet)
        with warnings.catch_warnings():
            warnings.simplefilter("error", AdaptersNotSavedWarning)
            eqxdiff.save_pipeline(pipe, tmp_path / "fused")
        saved = jax.tree.leaves(eqxdiff.load(tmp_path / "fused" / "unet"))
        assert all(np.array_equal(a, b) for a, b in zip(saved, fused, strict=True))
        assert not all(np.array_equal(a, b) for a, b in zip(saved, plain, strict=True))
    finally:
        pipe.unload_lora_weights()
