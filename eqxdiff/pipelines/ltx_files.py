"""Lightricks' LTX-Video single files as a layout (listed in :data:`eqxdiff.core.SINGLE_FILE_LAYOUTS`):
``ltx-video-2b-v0.9.x.safetensors`` and ``ltxv-13b-0.9.x-*.safetensors`` hold the transformer below
``model.diffusion_model.`` and the VAE below ``vae.`` in the original names
(:func:`eqxdiff.loading.formats.ltx_transformer`, :func:`~eqxdiff.loading.formats.ltx_vae`); a transformer file in
those names without the prefix, and a VAE file alone, are layouts too. Their configs, the T5 encoder, the tokenizer
and the scheduler come from ``config=``, the matching diffusers folder (the files carry no config a loader could trust):

>>> pipe = eqxdiff.load_pipeline("ltx-video-2b-v0.9.5.safetensors", config="Lightricks/LTX-Video-0.9.5")
>>> pipe = eqxdiff.load_pipeline("ltxv-13b-0.9.7-dev.safetensors", config="Lightricks/LTX-Video-0.9.7-dev",
...                              pipeline_class=LTXConditionPipeline)
"""

import dataclasses

from ..loading import formats
from ..loading.single_file import Layout, Part, Sized

__all__ = ["SINGLE_FILE_LAYOUTS", "LightricksTransformer", "LightricksVae"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LightricksTransformer(Part):
    """The transformer of a Lightricks file (:func:`~eqxdiff.loading.formats.ltx_transformer`), its config from
    ``config=``."""

    name: str = "transformer"
    model_class: str = "LTXVideoTransformer3DModel"
    prefix: str = formats.LTX_DIFFUSION_MODEL

    def rules(self, config, view=None):
        return formats.ltx_transformer(prefix=self.prefix)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LightricksVae(Part):
    """The VAE of a Lightricks file (:func:`~eqxdiff.loading.formats.ltx_vae`: its blocks numbered from the config's
    layout), its config from ``config=``; written with the statistics entries no loader reads."""

    name: str = "vae"
    model_class: str = "AutoencoderKLLTXVideo"
    prefix: str = formats.LTX_VAE

    def rules(self, config, view=None):
        return formats.ltx_vae(config, prefix=self.prefix)

    def extra_tensors(self, config, written=None):
        """The statistics entries Lightricks' files carry and no loader reads
        (:func:`~eqxdiff.loading.formats.ltx_unused_statistics`), so that a written file has every key of theirs."""
        std = written[self.prefix + formats.LTX_STATISTICS + "std-of-means"]
        return {self.prefix + n: v for n, v in formats.ltx_unused_statistics(std).items()}


_SINGLE_FILE = dict(family="LTX-Video", pipelines=("LTXPipeline", "LTXImageToVideoPipeline", "LTXConditionPipeline"),
                    tokenizers={"tokenizer": "text_encoder"}, hub_id="Lightricks/LTX-Video")
_LIGHTRICKS = (formats.LTX_DIFFUSION_MODEL + "patchify_proj.weight", formats.LTX_DIFFUSION_MODEL + "adaln_single.")


def _lightricks(name: str, signature: tuple, hub_id: str) -> Layout:
    """Lightricks' file of one release, told as diffusers' ``infer_diffusers_model_type`` tells it, so that the
    ``config=`` a message suggests is the one diffusers' ``from_single_file`` fetches for it."""
    return Layout(name=name, signature=(*_LIGHTRICKS, *signature), parts=(LightricksTransformer(),
                  LightricksVae(optional=True)), **{**_SINGLE_FILE, "hub_id": hub_id})


# Lightricks' files (the transformer below model.diffusion_model., the VAE below vae.): first the releases diffusers
# tells apart by their tensors (the 13B's 48 blocks: 0.9.7; an encoder 2048 wide: the 0.9.5 VAE; a timestep-conditioned
# decoder: 0.9.1), which differ only in the config= their messages suggest, then any other; then a transformer file in
# the same names without the prefix and a VAE file alone (below vae.), as diffusers' from_single_file reads them too
# (its LTX keys include the bare patchify_proj.weight and vae.decoder.*). Written files take the first that fits.
SINGLE_FILE_LAYOUTS = (
    _lightricks("ltx_lightricks_0.9.7", (formats.LTX_DIFFUSION_MODEL + "transformer_blocks.47.",),
                "Lightricks/LTX-Video-0.9.7-dev"),
    _lightricks("ltx_lightricks_0.9.5", (Sized(formats.LTX_VAE + "encoder.conv_out.conv.weight", 1, 2048),),
                "Lightricks/LTX-Video-0.9.5"),
    _lightricks("ltx_lightricks_0.9.1", (formats.LTX_VAE + "decoder.last_time_embedder.",),
                "diffusers/LTX-Video-0.9.1"),
    _lightricks("ltx_lightricks", (), "diffusers/LTX-Video-0.9.0"),
    Layout(name="ltx_transformer", signature=("patchify_proj.weight", "adaln_single."),
           parts=(LightricksTransformer(prefix=""),), **_SINGLE_FILE),
    Layout(name="ltx_vae", signature=(formats.LTX_VAE + formats.LTX_STATISTICS, formats.LTX_VAE + "decoder."),
           parts=(LightricksVae(),), **_SINGLE_FILE),
)
