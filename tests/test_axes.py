"""Every model eqxdiff serves declares the logical axes of every parameter, and has a parity test.

``test_every_parameter_declares_logical_axes`` builds each model class of the family table
(:data:`eqxdiff.core.FAMILY_TABLE`) abstractly (``eqx.filter_eval_shape``, nothing allocated) at a tiny config from
:data:`TINY_CONFIGS`, plain and with ``scan_layers``, and fails for a parameter without declared axes (the sharding
rules could not place it), with axes of the wrong rank, or with an axis name the rules do not know (a typo would
silently replicate it). ``test_every_model_has_a_parity_test`` fails for a family-table model that no
:class:`tests._parity.ModelParity` subclass covers.

**A new model class in the family table adds one entry here**: ``TINY_CONFIGS["<checkpoint class name>"]`` = the
``config.json`` of a tiny model as a dict (read with ``config_class.from_dict``), or a function returning the eqxdiff
config, or a list of them. Choose values that build every optional part (the axes of a part that is not built are
not checked); where options exclude each other (T5's relu / gated feed-forward), list a config for each.
"""

import importlib
from collections.abc import Callable
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from eqxdiff import nn
from eqxdiff.core import (
    DEFAULT_RULES,
    FAMILY_TABLE,
    ModelConfig,
    activation_sharding,
    family_names,
    leaf_specs,
    logical_to_spec,
    resolve_class,
)

from ._parity import ModelParity

_T5 = dict(vocab_size=11, d_model=8, d_kv=4, d_ff=12, num_layers=2, num_heads=2, relative_attention_num_buckets=4)
_FLUX = dict(in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=4, num_attention_heads=2,
             joint_attention_dim=6, pooled_projection_dim=5, axes_dims_rope=(2, 2), guidance_embeds=True)
_WAN = dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, text_dim=6,
            freq_dim=4, ffn_dim=12, num_layers=2)
# LTX-Video: 3 heads of 4 (12: rotary padding), two layers to stack; a VAE of each generation (0.9.0's width-changing
# ResNet blocks, 0.9.1's timestep conditioning, noise and residual upsampling, 0.9.5's space-to-depth encoder)
_LTX = dict(in_channels=4, out_channels=4, num_attention_heads=3, attention_head_dim=4, cross_attention_dim=12,
            num_layers=2, caption_channels=6, norm_elementwise_affine=True)
_LTX_VAE = dict(latent_channels=4, block_out_channels=(4, 8), layers_per_block=(1, 1, 1),
                spatio_temporal_scaling=(True, False), decoder_block_out_channels=(4, 8, 8),
                decoder_layers_per_block=(1, 1, 1, 1), decoder_spatio_temporal_scaling=(True, True, False),
                patch_size=2)
_LTX_VAE_091 = dict(_LTX_VAE, decoder_block_out_channels=(8, 16), decoder_layers_per_block=(1, 1, 1),
                    decoder_spatio_temporal_scaling=(True, True), decoder_inject_noise=(True, True, True),
                    upsample_residual=(True, True), upsample_factor=(2, 2), timestep_conditioning=True)
_LTX_VAE_095 = dict(_LTX_VAE_091, block_out_channels=(4, 8, 8), down_block_types=("LTXVideo095DownBlock3D",) * 2,
                    spatio_temporal_scaling=(True, True), downsample_type=("spatial", "spatiotemporal"))

Tiny = dict | Callable[[], ModelConfig]
TINY_CONFIGS: dict[str, Tiny | list[Tiny]] = {
    # SDXL-like with every optional UNet part: text_time and time_cond embeddings, cross-attention in down, mid and
    # up blocks, transformers two deep (stacked by scan_layers), 1x1-conv and linear projections.
    "UNet2DConditionModel": dict(
        block_out_channels=(8, 16), norm_num_groups=4, layers_per_block=1, cross_attention_dim=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=2, transformer_layers_per_block=2, addition_embed_type="text_time",
        addition_time_embed_dim=4, projection_class_embeddings_input_dim=6 * 4 + 8, time_cond_proj_dim=4),
    "ControlNetModel": dict(
        block_out_channels=(8, 16), norm_num_groups=4, layers_per_block=1, cross_attention_dim=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), attention_head_dim=2, transformer_layers_per_block=2,
        addition_embed_type="text_time", addition_time_embed_dim=4, projection_class_embeddings_input_dim=6 * 4 + 8,
        conditioning_embedding_out_channels=(4, 8)),
    "ControlNetUnionModel": dict(
        block_out_channels=(8, 16), norm_num_groups=4, layers_per_block=1, cross_attention_dim=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), attention_head_dim=2, addition_embed_type="text_time",
        addition_time_embed_dim=4, projection_class_embeddings_input_dim=6 * 4 + 8,
        conditioning_embedding_out_channels=(4, 8), num_control_type=3, num_trans_channel=8, num_trans_head=2,
        num_trans_layer=2, num_proj_channel=8),
    "AutoencoderKL": dict(block_out_channels=(8, 16), norm_num_groups=4, latent_channels=4,
                          down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2),
    "CLIPTextModel": dict(vocab_size=11, hidden_size=8, intermediate_size=12, num_attention_heads=2,
                          num_hidden_layers=2, max_position_embeddings=5, projection_dim=4),
    "CLIPTextModelWithProjection": dict(vocab_size=11, hidden_size=8, intermediate_size=12, num_attention_heads=2,
                                        num_hidden_layers=2, max_position_embeddings=5, projection_dim=4),
    "CLIPVisionModel": dict(hidden_size=8, intermediate_size=12, projection_dim=4, num_hidden_layers=2,
                            num_attention_heads=2, image_size=8, patch_size=4),
    "CLIPVisionModelWithProjection": dict(hidden_size=8, intermediate_size=12, projection_dim=4, num_hidden_layers=2,
                                          num_attention_heads=2, image_size=8, patch_size=4),
    # relu and gated feed-forwards have different parameters: both
    "T5EncoderModel": [dict(_T5, feed_forward_proj="relu"), dict(_T5, feed_forward_proj="gated-gelu")],
    "UMT5EncoderModel": dict(_T5, feed_forward_proj="gated-gelu"),
    # separate and fused projections hold different parameters: both; guidance embedder on
    "FluxTransformer2DModel": [dict(_FLUX), dict(_FLUX, fused_projections=True)],
    # text-to-video; first-last-frame image-to-video (image embedder with positions, added k/v)
    "WanTransformer3DModel": [dict(_WAN), dict(_WAN, image_dim=4, added_kv_proj_dim=16, pos_embed_seq_len=6)],
    # Wan 2.1 (resamples, encoder attention at attn_scales) and Wan 2.2 (residual levels, patchified pixels)
    "AutoencoderKLWan": [dict(base_dim=2, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, attn_scales=[0.5],
                              temperal_downsample=[True, False], latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
                              scale_factor_spatial=4, scale_factor_temporal=2),
                         dict(base_dim=2, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, is_residual=True,
                              patch_size=2, in_channels=12, out_channels=12, temperal_downsample=[True, False],
                              latents_mean=[0.0] * 4, latents_std=[1.0] * 4, scale_factor_spatial=8,
                              scale_factor_temporal=2)],
    "LTXVideoTransformer3DModel": [dict(_LTX), dict(_LTX, patch_size=2, patch_size_t=2, in_channels=8, out_channels=8)],
    "AutoencoderKLLTXVideo": [_LTX_VAE, _LTX_VAE_091, _LTX_VAE_095],
    # 3-D with temporal and spatial upsampling; 2-D
    "LTXLatentUpsamplerModel": [dict(in_channels=4, mid_channels=32, num_blocks_per_stage=2, temporal_upsample=True),
                                dict(in_channels=4, mid_channels=32, num_blocks_per_stage=2, dims=2)],
}

MODELS = family_names("model")
KNOWN_AXES = {name for name, _ in DEFAULT_RULES.params}


def _tiny_configs(name: str, cls: type) -> list[ModelConfig]:
    entry = TINY_CONFIGS.get(name)
    if entry is None:
        pytest.fail(f"{name!r} is in eqxdiff.core.FAMILY_TABLE ({FAMILY_TABLE[name]}) but has no tiny config for the "
                    f"axes walk: add TINY_CONFIGS[{name!r}] = {{...config.json of a tiny {name}...}} (or a function "
                    f"returning a {cls.config_class.__name__}, or a list of them) in tests/test_axes.py")
    entries = entry if isinstance(entry, list) else [entry]
    return [e() if callable(e) else cls.config_class.from_dict(e) for e in entries]


def _problems(module) -> list[str]:
    leaves, specs, _ = leaf_specs(module)
    out = []
    for x, s in zip(leaves, specs):
        if s.axes is None:
            out.append(f"{s.name} {tuple(x.shape)}: no declared logical axes (PARAM_AXES or param_axes() on its "
                       "module, or axes= on its nn.Linear)")
        elif len(s.axes) != x.ndim:
            out.append(f"{s.name} {tuple(x.shape)}: axes {s.axes} of the wrong rank")
        elif unknown := [a for a in s.axes if a is not None and a not in KNOWN_AXES]:
            out.append(f"{s.name}: axis name(s) {unknown} not in eqxdiff.core.DEFAULT_RULES.params")
    return out


@pytest.mark.parametrize("name", MODELS)
def test_every_parameter_declares_logical_axes(name):
    cls = resolve_class(name)
    problems = []
    for config in _tiny_configs(name, cls):
        abstract = eqx.filter_eval_shape(lambda: cls(config, key=jax.random.key(0)))  # noqa: B023 - called at once
        assert jax.tree.leaves(abstract), f"{name}: the tiny config built no parameters"
        problems += _problems(abstract)
        try:
            stacked = nn.scan_layers(abstract)
        except ValueError:  # no repeated layers to stack
            continue
        problems += [f"scan_layers: {p}" for p in _problems(stacked)]
    assert not problems, f"{name}:\n" + "\n".join(problems)


@pytest.mark.parametrize("name", MODELS)
def test_the_loaders_abstract_build_has_the_constructors_structure(name):
    """``nn.build_abstract`` (the initialisers draw nothing: what the loader fills) gives every model the structure,
    shapes, dtypes and static fields of tracing its real constructor."""
    cls = resolve_class(name)
    for config in _tiny_configs(name, cls):
        traced = eqx.filter_eval_shape(lambda: cls(config, key=jax.random.key(0)))  # noqa: B023 - called at once
        built = nn.build_abstract(cls, config, key=jax.random.key(0))
        assert jax.tree.structure(built) == jax.tree.structure(traced), name
        assert jax.tree.leaves(built) == jax.tree.leaves(traced), name


def _parity_classes() -> list[type]:
    """Every collected (``Test...``) ModelParity subclass in tests/, importing the test modules that define them."""
    here = Path(__file__).parent
    for path in sorted(here.glob("test_*.py")):
        if "ModelParity" in path.read_text():
            importlib.import_module(f"{__package__}.{path.stem}")
    found, todo = [], [ModelParity]
    while todo:
        subclasses = todo.pop().__subclasses__()
        todo.extend(subclasses)
        found.extend(c for c in subclasses if c.__name__.startswith("Test"))
    return found


def test_every_model_has_a_parity_test():
    covered = {c.reference_class.__name__ for c in _parity_classes()}
    missing = [name for name in MODELS if name not in covered]
    assert not missing, "\n".join(
        f"{name!r} is in eqxdiff.core.FAMILY_TABLE ({FAMILY_TABLE[name]}) but no parity test covers it: in "
        f"tests/test_<family>.py add `class Test...(ModelParity)` (from tests/_parity.py) with reference_class = "
        f"the diffusers/transformers class {name}, model_class = {FAMILY_TABLE[name].split(':')[1]}, a tiny config, "
        "full_size and the inputs/outputs methods; the docstring of tests/_parity.py shows how" for name in missing)


def test_an_unknown_logical_axis_name_is_an_error_that_names_it():
    """A logical axis name the rules do not list (a typo, or a new family's axis not yet in the rules) raises,
    naming it, the array, the known names and the fix; it is never silently replicated."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("fsdp",))
    with pytest.raises(ValueError, match=r"activation \('batch', 'sequence'\): logical axis 'sequence' is not in the "
                                         r"sharding rules' activations, which know \[.*'seq'.*\]: .*add it to the "
                                         r"rules, e.g. rules.replace\(activations=\{'sequence': None\}\)"):
        activation_sharding(mesh, ("batch", "sequence"), (2, 4))
    with pytest.raises(ValueError, match=r"to_q.weight: logical axis 'haeds' is not in the sharding rules' params, "
                                         r"which know \[.*'heads'.*\]"):
        logical_to_spec(("haeds", "embed"), (4, 4), mesh, DEFAULT_RULES, "params", what="to_q.weight")
    # a name known for parameters is not thereby known for activations (the columns are separate)
    with pytest.raises(ValueError, match="logical axis 'conv_out' is not in the sharding rules' activations"):
        DEFAULT_RULES.lookup("activations", "conv_out")
    with pytest.raises(ValueError, match=r"kind='param'; choose one of \('params', 'activations'\)"):
        DEFAULT_RULES.lookup("param", "embed")
    # the fix the message gives works; None (no name) and a name mapped to None both replicate
    fixed = DEFAULT_RULES.replace(activations={"sequence": None})
    assert activation_sharding(mesh, ("batch", "sequence"), (2, 4), fixed).spec == P("fsdp")
    assert fixed.lookup("activations", None) == fixed.lookup("activations", "sequence") == ()
    assert DEFAULT_RULES.lookup("params", "embed") == ("fsdp",)
