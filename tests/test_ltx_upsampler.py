"""LTX-Video's latent upsampler (0.9.7+): LTXLatentUpsamplerModel against diffusers (the parity base,
:mod:`tests._parity`: the released spatial upsampler's layout, a spatial + temporal one, a 2-D one), the stacked
ResNet stages, and the config errors."""

import jax.numpy as jnp
import numpy as np
import pytest

import eqxdiff
from eqxdiff.core import ConfigError
from eqxdiff.models.ltx_upsampler import LTXLatentUpsamplerConfig, LTXLatentUpsamplerModel

from . import _tiny_ltx as tiny
from ._parity import ModelParity
from ._util import assert_close_to_float64, nchw_to_nhwc, nhwc_to_nchw


class UpsamplerParity(ModelParity):
    model_class = LTXLatentUpsamplerModel
    reference_class = tiny.LTXLatentUpsamplerModel
    full_size = {"ltxv-spatial-upscaler-0.9.7": tiny.REAL_UPSAMPLER}

    def inputs(self, reference):
        rng = np.random.default_rng(self.seed())
        return dict(latents=rng.standard_normal((2, 3, 4, 5, reference.config.in_channels), np.float32))

    def reference_outputs(self, reference, inputs):
        return dict(sample=nchw_to_nhwc(reference(nhwc_to_nchw(inputs["latents"]))))

    @staticmethod
    def outputs(model, inputs):
        return dict(sample=model(inputs["latents"]))


class TestLTXUpsamplerSpatial(UpsamplerParity):
    """The released layout (3-D convolutions, a spatial upsampler run frame by frame), 2 blocks per stage."""

    config = tiny.UPSAMPLER


class TestLTXUpsamplerSpatioTemporal(UpsamplerParity):
    """Spatial and temporal upsampling in one 3-D pixel shuffle (``F -> 2F - 1``), one block per stage."""

    config = dict(tiny.UPSAMPLER, temporal_upsample=True, num_blocks_per_stage=1)


class TestLTXUpsampler2D(UpsamplerParity):
    """``dims=2``: every convolution and norm frame by frame."""

    config = dict(tiny.UPSAMPLER, dims=2)


@pytest.fixture(scope="module")
def spatial(tmp_path_factory):
    return TestLTXUpsamplerSpatial.build(tmp_path_factory)


def test_scanned_equals_unrolled(spatial):
    scanned = eqxdiff.nn.scan_layers(spatial.model)
    assert isinstance(scanned.res_blocks, eqxdiff.nn.Stacked) and scanned.res_blocks.layers.conv1.weight.shape[0] == 2
    out = TestLTXUpsamplerSpatial.run(scanned, spatial.inputs)["sample"]
    assert out.shape == (2, 3, 8, 10, 8)
    assert_close_to_float64(out, spatial.actual["sample"], TestLTXUpsamplerSpatial.actual64(spatial)["sample"],
                            what="scanned vs unrolled")


@pytest.mark.parametrize("change, match", [
    (dict(mid_channels=48), "mid_channels=48 must be a positive multiple of 32"),
    (dict(spatial_upsample=False), "spatial_upsample=False or temporal_upsample must be true"),
    (dict(dims=2, temporal_upsample=True), "temporal_upsample=True needs dims=3"),
    (dict(dims=1), "unsupported config value dims=1"),
])
def test_config_errors(change, match):
    with pytest.raises(ConfigError, match=match):
        LTXLatentUpsamplerConfig(**{**tiny.UPSAMPLER, **change})


def test_call_errors(spatial):
    with pytest.raises(ValueError, match=r"expects latents \[batch, frames, height, width, 8\] \(channels last\)"):
        spatial.model(jnp.zeros((1, 8, 2, 2, 3)))
