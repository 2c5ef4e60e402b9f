"""CLIP image encoders: the parity base (:mod:`tests._parity`: every hidden state, the pooled output and the
projection) for CLIPVisionModelWithProjection at the Wan tiny config (hidden 4, patch 1) and a patch-4 GELU one whose
image size is no multiple of the patch, and for CLIPVisionModel (Wan 2.1 I2V's image encoder), against full-size
layouts (ViT-H/14, ViT-L/14); then what the base does not check: scan_layers, transformers 4 names, errors."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import eqxdiff
from eqxdiff import nn
from eqxdiff.core import ConfigError
from eqxdiff.loading import state_dict
from eqxdiff.models.clip_vision import CLIPVisionConfig, CLIPVisionModel, CLIPVisionModelWithProjection

from ._parity import ModelParity
from ._util import assert_close_to_float64, run_float64

CONFIGS = {
    "wan-tiny": dict(hidden_size=4, projection_dim=4, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                     intermediate_size=16, patch_size=1),  # diffusers' Wan I2V tests: 1025 tokens
    "patch4-gelu": dict(hidden_size=32, projection_dim=12, num_hidden_layers=2, num_attention_heads=2, image_size=30,
                        intermediate_size=16, patch_size=4, hidden_act="gelu", layer_norm_eps=1e-6),
    "no-projection": dict(hidden_size=24, projection_dim=8, num_hidden_layers=3, num_attention_heads=3, image_size=16,
                          intermediate_size=40, patch_size=4),
}
VIT_H_14 = dict(hidden_size=1280, intermediate_size=5120, projection_dim=1024, num_hidden_layers=32,
                num_attention_heads=16, image_size=224, patch_size=14, hidden_act="gelu")  # Wan 2.1 I2V image_encoder
VIT_L_14 = dict(hidden_size=1024, intermediate_size=4096, projection_dim=768, num_hidden_layers=24,
                num_attention_heads=16, image_size=224, patch_size=14, hidden_act="quick_gelu")  # openai ViT-L/14


def _named(out) -> dict:
    named = {"last_hidden_state": out["last_hidden_state"], "pooler_output": out["pooler_output"]}
    named.update({f"hidden_states.{i}": h for i, h in enumerate(out["hidden_states"])})
    if out.get("image_embeds") is not None:
        named["image_embeds"] = out["image_embeds"]
    return named


class CLIPVisionParity(ModelParity):
    """Two normalised-looking images, channels-last for eqxdiff, NCHW for transformers."""

    def inputs(self, reference):
        size = self.config["image_size"]
        return dict(pixel_values=np.random.default_rng(0).standard_normal((2, size, size, 3)).astype(np.float32))

    def reference_outputs(self, reference, inputs):
        pixels = torch.from_numpy(np.ascontiguousarray(inputs["pixel_values"].transpose(0, 3, 1, 2)))
        out = reference(pixel_values=pixels, output_hidden_states=True)
        if "pooler_output" not in out:  # WithProjection: the pooled output is the vision model's
            out = {**out, "pooler_output": reference.vision_model(pixel_values=pixels).pooler_output}
        return {k: v.numpy() for k, v in _named(out).items()}

    @staticmethod
    def outputs(model, inputs):
        return _named(vars(model(jnp.asarray(inputs["pixel_values"]), output_hidden_states=True)))


class TestCLIPVisionWanTiny(CLIPVisionParity):
    model_class = CLIPVisionModelWithProjection
    reference_class = transformers.CLIPVisionModelWithProjection
    config = CONFIGS["wan-tiny"]
    full_size = {"vit-h-14": VIT_H_14}


class TestCLIPVisionPatch4(CLIPVisionParity):
    model_class = CLIPVisionModelWithProjection
    reference_class = transformers.CLIPVisionModelWithProjection
    config = CONFIGS["patch4-gelu"]
    full_size = {"vit-l-14": VIT_L_14}


class TestCLIPVisionModel(CLIPVisionParity):
    model_class = CLIPVisionModel
    reference_class = transformers.CLIPVisionModel
    config = CONFIGS["no-projection"]
    full_size = {"vit-h-14": VIT_H_14}


def test_outputs_wan_reads(tmp_path_factory):
    """Wan's image embedding is ``hidden_states[-2]``: the penultimate layer's output, no post norm; the last hidden
    state has no norm either, and the pooled output is the class token after ``post_layernorm``."""
    case = TestCLIPVisionWanTiny.build(tmp_path_factory)
    layers = TestCLIPVisionWanTiny.config["num_hidden_layers"]
    assert len([k for k in case.actual if k.startswith("hidden_states.")]) == layers + 1
    np.testing.assert_array_equal(case.actual[f"hidden_states.{layers}"], case.actual["last_hidden_state"])
    assert case.actual[f"hidden_states.{layers - 1}"].shape == (2, 32 * 32 + 1, 4)
    post = case.model.vision_model.post_layernorm
    cls_token = case.actual["last_hidden_state"][:, 0]
    assert_close_to_float64(case.actual["pooler_output"], post(cls_token), run_float64(post, cls_token),
                            what="pooler_output")


@pytest.mark.parametrize("parity", [TestCLIPVisionPatch4, TestCLIPVisionModel])
def test_scan_layers_gives_the_same_numbers_and_names(parity, tmp_path_factory):
    case = parity.build(tmp_path_factory)
    scanned = eqxdiff.load(case.folder, scan_layers=True)
    assert isinstance(scanned.vision_model.layers, nn.Stacked)
    ours, theirs = state_dict(case.model), state_dict(scanned)
    assert set(ours) == set(theirs)
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    got = parity.run(scanned, case.inputs)  # as accurate as the unrolled run, against its float64 run
    actual64 = parity.actual64(case)
    for name, value in case.actual.items():
        assert_close_to_float64(got[name], value, actual64[name], what=f"scanned {name}")


def test_reads_transformers4_names_with_position_ids_buffer(tmp_path_factory, tmp_path):
    """transformers 5 writes CLIPVisionModel without the ``vision_model.`` prefix; transformers 4 files (Wan's
    image_encoder) have it, older ones also the ``position_ids`` buffer. Both read into the same model, which
    writes the prefixed names."""
    case = TestCLIPVisionModel.build(tmp_path_factory)
    tensors = load_file(case.folder / "model.safetensors")
    assert "encoder.layers.0.self_attn.q_proj.weight" in tensors
    old = {f"vision_model.{k}": v for k, v in tensors.items()}
    old["vision_model.embeddings.position_ids"] = torch.arange(17)[None]
    (tmp_path / "config.json").write_text((case.folder / "config.json").read_text())
    save_file(old, tmp_path / "model.safetensors", metadata={"format": "pt"})
    v4 = eqxdiff.load(tmp_path)
    for a, b in zip(jax.tree.leaves(v4), jax.tree.leaves(case.model), strict=True):
        np.testing.assert_array_equal(a, b)
    assert set(state_dict(v4)) == set(old) - {"vision_model.embeddings.position_ids"}


def test_config_and_input_errors():
    config = CLIPVisionConfig.from_dict({**CONFIGS["patch4-gelu"], "model_type": "clip_vision_model",
                                         "transformers_version": "5.23.0"})
    assert CLIPVisionConfig.from_dict(config.to_dict()) == config
    assert (config.num_patches, config.head_dim) == (49, 16)
    with pytest.raises(ConfigError, match=r"hidden_size=30 must be divisible by num_attention_heads=4"):
        CLIPVisionConfig(hidden_size=30, num_attention_heads=4)
    assert CLIPVisionConfig(hidden_act="gelu_new").hidden_act == "gelu_new"  # any activation eqxdiff computes
    with pytest.raises(ConfigError, match=r"hidden_act='tanh'"):
        CLIPVisionConfig(hidden_act="tanh")
    with pytest.raises(ConfigError, match=r"model_type='clip_text_model'"):
        CLIPVisionConfig.from_dict({"model_type": "clip_text_model"})
    with pytest.raises(ConfigError, match=r"image_size=\(224, 224\) has the wrong type"):
        CLIPVisionConfig.from_dict({"image_size": [224, 224]})
    with pytest.raises(ConfigError, match=r"patch_size=40 must be at most image_size=32"):
        CLIPVisionConfig(image_size=32, patch_size=40)

    model = eqx.filter_eval_shape(CLIPVisionModelWithProjection, CLIPVisionConfig.from_dict(CONFIGS["wan-tiny"]),
                                  key=jax.random.key(0))
    run = lambda x, **kw: eqx.filter_eval_shape(lambda m, x: m(x, **kw), model, x)  # noqa: E731
    out = run(jnp.zeros((3, 32, 32, 3)))
    assert out.image_embeds.shape == (3, 4) and out.last_hidden_state.shape == (3, 1025, 4)
    with pytest.raises(ValueError, match=r"pixel_values must be \[batch, 32, 32, 3\] \(channels-last, image_size=32\), "
                                         r"got shape \(3, 3, 32, 32\)"):
        run(jnp.zeros((3, 3, 32, 32)))  # channels-first
    with pytest.raises(ValueError, match=r"got shape \(1, 64, 64, 3\); resize and crop the images to 32x32 first"):
        run(jnp.zeros((1, 64, 64, 3)))
    with pytest.raises(TypeError, match="pixel_values"):
        run(jnp.zeros((1, 32, 32, 3), jnp.int32))
