"""eqxdiff: latent diffusion in pure JAX + Equinox.

>>> import eqxdiff
>>> unet = eqxdiff.load("path/to/sd15", subfolder="unet")
>>> pipe = eqxdiff.load_pipeline("path/to/sd15")
>>> eqxdiff.enable_compilation_cache()  # compiled programs kept in ~/.cache/eqxdiff/jax: a warm start next time

The names below are imported on first use, so ``import eqxdiff.kernels`` (or any lower layer) stays light.
"""

import importlib

__version__ = "0.1.0"

_LAZY = {
    "load": "eqxdiff.loading",
    "save_pretrained": "eqxdiff.loading",
    "CheckpointError": "eqxdiff.loading",
    "ConfigError": "eqxdiff.core",
    "enable_compilation_cache": "eqxdiff.core",
    "load_pipeline": "eqxdiff.pipelines",
    "lora": "eqxdiff.pipelines",
    "save_pipeline": "eqxdiff.pipelines",
}

_SUBPACKAGES = ("core", "data", "kernels", "loading", "models", "nn", "parallel", "pipelines", "schedulers", "train")

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"eqxdiff.{name}")
    else:
        raise AttributeError(f"module 'eqxdiff' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBPACKAGES))
