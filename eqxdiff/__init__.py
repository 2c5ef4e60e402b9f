"""eqxdiff: latent diffusion in pure JAX + Equinox.

>>> import eqxdiff
>>> unet = eqxdiff.load("path/to/sd15", subfolder="unet")
>>> pipe = eqxdiff.load_pipeline("path/to/sd15")
"""

from .loading import CheckpointError as CheckpointError
from .loading import load as load
from .loading import save_pretrained as save_pretrained


def load_pipeline(path_or_hub_id, **kwargs):
    """Load a diffusers pipeline folder (``model_index.json``); see :func:`eqxdiff.pipelines.load_pipeline`."""
    from .pipelines import load_pipeline as _load_pipeline

    return _load_pipeline(path_or_hub_id, **kwargs)


__version__ = "0.1.0"
