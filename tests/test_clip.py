"""CLIP text encoders: the parity base (:mod:`tests._parity`: every hidden state, pooled output and projection, with
and without a padding mask) for CLIPTextModel and CLIPTextModelWithProjection at SD1-, SD2- and SDXL-like configs,
each against a full-size layout; then what the base does not check: transformers 4 names, config and input errors."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import eqxdiff
from eqxdiff.core import ConfigError
from eqxdiff.models.clip import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from ._parity import ModelParity
from ._util import assert_close, randomize_torch

# SD1-like (quick_gelu, legacy eos_token_id=2), SD2-like (gelu, a real eos_token_id), SDXL-like (gelu, legacy).
CONFIGS = {
    "sd1": dict(vocab_size=99, hidden_size=32, intermediate_size=37, projection_dim=16, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=12, hidden_act="quick_gelu", bos_token_id=0,
                eos_token_id=2, pad_token_id=1),
    "sd2": dict(vocab_size=101, hidden_size=48, intermediate_size=64, projection_dim=24, num_hidden_layers=3,
                num_attention_heads=3, max_position_embeddings=10, hidden_act="gelu", layer_norm_eps=1e-6,
                bos_token_id=97, eos_token_id=98, pad_token_id=0),
    "sdxl": dict(vocab_size=97, hidden_size=24, intermediate_size=96, projection_dim=40, num_hidden_layers=1,
                 num_attention_heads=2, max_position_embeddings=9, hidden_act="gelu", bos_token_id=0,
                 eos_token_id=2, pad_token_id=0),
}

# -- full-size configs of real checkpoints (config.json values) -------------------------------------------------
_REAL = dict(vocab_size=49408, max_position_embeddings=77, bos_token_id=0, eos_token_id=2, pad_token_id=1)
VIT_L = dict(_REAL, hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
             projection_dim=768, hidden_act="quick_gelu")  # SD 1.5 / SDXL text_encoder, SD3 text_encoder
VIT_H = dict(_REAL, hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_hidden_layers=23,
             projection_dim=512, hidden_act="gelu")  # SD 2.x text_encoder
BIG_G = dict(_REAL, hidden_size=1280, intermediate_size=5120, num_attention_heads=20, num_hidden_layers=32,
             projection_dim=1280, hidden_act="gelu", pad_token_id=0)  # SDXL / SD3 text_encoder_2


def _inputs(cfg, lengths, seq, seed=0):
    """Token ids as a tokenizer makes them: bos, text, eos, then padding; and the matching attention mask."""
    rng = np.random.default_rng(seed)
    vocab = cfg["vocab_size"]
    if cfg["eos_token_id"] == 2:  # legacy pooling takes the largest id, as CLIP's eos is
        eos, pad = vocab - 1, cfg["pad_token_id"]
        ids = rng.integers(3, vocab - 1, (len(lengths), seq))
    else:  # the eos is not the largest id here, and padding repeats it: pooling must take the first eos
        eos = pad = cfg["eos_token_id"]
        ids = rng.integers(3, vocab, (len(lengths), seq))
        ids[ids == eos] = 3
        ids[:, 1] = vocab - 1
    ids[:, 0] = cfg["bos_token_id"]
    for i, n in enumerate(lengths):
        ids[i, n - 1] = eos
        ids[i, n:] = pad
    mask = (np.arange(seq)[None] < np.asarray(lengths)[:, None]).astype(np.int64)
    return ids.astype(np.int32), mask


def _named(out, prefix: str) -> dict:
    """A CLIPTextOutput (or transformers' output plus the pooled states) as ``{name: array}``."""
    named = {f"{prefix}last_hidden_state": out["last_hidden_state"], f"{prefix}pooler_output": out["pooler_output"]}
    named.update({f"{prefix}hidden_states.{i}": h for i, h in enumerate(out["hidden_states"])})
    if out.get("text_embeds") is not None:
        named[f"{prefix}text_embeds"] = out["text_embeds"]
    return named


class CLIPParity(ModelParity):
    """Every output, once without and once with the padding mask (``masked.``), for ids as a tokenizer makes them."""

    mask_dtype = np.int32

    def inputs(self, reference):
        cfg = self.config
        seq = cfg["max_position_embeddings"] - (self.config is CONFIGS["sd1"])  # sd1: shorter than the table
        ids, mask = _inputs(cfg, [seq, 4, 2], seq)
        return dict(input_ids=ids, attention_mask=mask.astype(self.mask_dtype))

    def reference_outputs(self, reference, inputs):
        out = {}
        for prefix, mask in (("", None), ("masked.", torch.from_numpy(inputs["attention_mask"]))):
            kw = dict(input_ids=torch.from_numpy(inputs["input_ids"]).long(), attention_mask=mask,
                      output_hidden_states=True)
            got = reference(**kw)
            pooled = reference.text_model(**kw).pooler_output if hasattr(got, "text_embeds") else got.pooler_output
            out.update(_named({**got, "pooler_output": pooled}, prefix))
        return {k: v.numpy() for k, v in out.items()}

    @staticmethod
    def outputs(model, inputs):
        ids = jnp.asarray(inputs["input_ids"])
        plain = model(ids, output_hidden_states=True)
        masked = model(ids, attention_mask=jnp.asarray(inputs["attention_mask"]), output_hidden_states=True)
        return {**_named(vars(plain), ""), **_named(vars(masked), "masked.")}


class TextModelParity(CLIPParity):
    model_class = CLIPTextModel
    reference_class = transformers.CLIPTextModel
    mask_dtype = np.bool_


class ProjectionParity(CLIPParity):
    model_class = CLIPTextModelWithProjection
    reference_class = transformers.CLIPTextModelWithProjection


class TestCLIPTextSD1(TextModelParity):
    config = CONFIGS["sd1"]
    full_size = {"vit-l": VIT_L}


class TestCLIPTextSD2(TextModelParity):
    config = CONFIGS["sd2"]
    full_size = {"vit-h": VIT_H}


class TestCLIPTextSDXL(TextModelParity):
    config = CONFIGS["sdxl"]
    full_size = {"vit-l": VIT_L}


class TestCLIPProjectionSD1(ProjectionParity):
    config = CONFIGS["sd1"]
    full_size = {"vit-l": VIT_L}


class TestCLIPProjectionSD2(ProjectionParity):
    config = CONFIGS["sd2"]
    full_size = {"big-g": BIG_G}


class TestCLIPProjectionSDXL(ProjectionParity):
    config = CONFIGS["sdxl"]
    full_size = {"big-g": BIG_G}


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    return TestCLIPTextSD1.build(tmp_path_factory)


def test_text_model_has_no_projection(sd1):
    out = eqx.filter_eval_shape(lambda m, x: m(x), sd1.model, sd1.inputs["input_ids"])
    assert out.text_embeds is None and out.hidden_states is None


def test_reads_transformers4_names_with_position_ids_buffer(sd1, tmp_path):
    """transformers 5 writes CLIPTextModel without the ``text_model.`` prefix; SD checkpoints (transformers 4) have
    it, and older ones also carry the ``position_ids`` buffer. Both read into the same model."""
    tensors = load_file(sd1.folder / "model.safetensors")
    assert "encoder.layers.1.self_attn.q_proj.weight" in tensors
    (tmp_path / "config.json").write_text((sd1.folder / "config.json").read_text())
    old = {f"text_model.{k}": v for k, v in tensors.items()}
    old["text_model.embeddings.position_ids"] = torch.arange(CONFIGS["sd1"]["max_position_embeddings"])[None]
    save_file(old, tmp_path / "model.safetensors", metadata={"format": "pt"})
    v4 = eqxdiff.load(tmp_path)
    assert set(eqxdiff.loading.state_dict(v4)) == set(old) - {"text_model.embeddings.position_ids"}
    for a, b in zip(jax.tree_util.tree_leaves(sd1.model), jax.tree_util.tree_leaves(v4), strict=True):
        np.testing.assert_array_equal(a, b)


def test_config_round_trip_and_unsupported_values(sd1):
    config = CLIPTextConfig.from_dict({**CONFIGS["sd1"], "dropout": 0.0, "transformers_version": "4.22.0"})
    assert CLIPTextConfig.from_dict(config.to_dict()) == config
    assert config.to_dict()["model_type"] == "clip_text_model" and config.legacy_pooling and config.head_dim == 8
    # diffusers' SD reads use_attention_mask from the text encoder's config: kept, and written back only if set
    assert "use_attention_mask" not in config.to_dict() and not config.use_attention_mask
    masked = CLIPTextConfig.from_dict({**CONFIGS["sd1"], "use_attention_mask": True})
    assert masked.use_attention_mask and CLIPTextConfig.from_dict(masked.to_dict()) == masked
    with pytest.raises(ConfigError, match=r"hidden_act='tanh'"):  # an ACT2FN name eqxdiff does not compute
        CLIPTextConfig.from_dict({**CONFIGS["sd1"], "hidden_act": "tanh"})
    with pytest.raises(ConfigError, match=r"hidden_act='gelu_10'"):
        CLIPTextConfig(hidden_act="gelu_10")
    with pytest.raises(ConfigError, match=r"hidden_size=30 must be divisible by num_attention_heads=4"):
        CLIPTextConfig.from_dict({**CONFIGS["sd1"], "hidden_size": 30})
    with pytest.raises(ConfigError, match=r"eos_token_id=\(2, 3\)"):
        CLIPTextConfig.from_dict({**CONFIGS["sd1"], "eos_token_id": [2, 3]})
    with pytest.raises(ConfigError, match=r"model_type='clip'"):
        CLIPTextConfig.from_dict({**CONFIGS["sd1"], "model_type": "clip"})
    with pytest.raises(ConfigError, match=r"projection_dim=None must be set"):
        CLIPTextModelWithProjection(CLIPTextConfig(projection_dim=None, num_hidden_layers=1), key=jax.random.key(0))
    with pytest.raises(ConfigError, match=r"hidden_act='sigmoid'"):
        eqxdiff.load(sd1.folder, config_overrides={"hidden_act": "sigmoid"})


@pytest.mark.parametrize("act", ["gelu_new", "silu"])
def test_other_hidden_activations_match_transformers(act, tmp_path):
    """CLIPMLP is ``ACT2FN[hidden_act]``: transformers builds CLIP with any of its activations (not only quick_gelu
    and gelu, which eqxdiff once refused). One layer, every weight random, pooled at a real eos id, at 1e-4."""
    config = dict(CONFIGS["sd2"], num_hidden_layers=1, hidden_act=act)
    ref = transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(**config)).eval()
    randomize_torch(ref, seed=5)
    ref.save_pretrained(tmp_path)
    ours = eqxdiff.load(tmp_path)
    ids, mask = _inputs(config, [10, 4], 10)
    with torch.no_grad():
        theirs = ref(input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask))
    got = ours(jnp.asarray(ids), attention_mask=jnp.asarray(mask, jnp.int32))
    assert_close(got.last_hidden_state, theirs.last_hidden_state.numpy(), 1e-4)
    assert_close(got.text_embeds, theirs.text_embeds.numpy(), 1e-4)


def test_wrong_input_shapes_are_named():
    config = CLIPTextConfig.from_dict(CONFIGS["sdxl"])
    model = eqx.filter_eval_shape(CLIPTextModelWithProjection, config, key=jax.random.key(0))
    run = lambda ids, **kw: eqx.filter_eval_shape(lambda m, x: m(x, **kw), model, ids)  # noqa: E731
    out = run(jnp.zeros((2, 9), jnp.int32))
    assert out.text_embeds.shape == (2, config.projection_dim) and out.hidden_states is None
    with pytest.raises(ValueError, match=r"input_ids has 10 tokens but max_position_embeddings=9; truncate"):
        run(jnp.zeros((2, 10), jnp.int32))
    with pytest.raises(TypeError, match="input_ids"):
        run(jnp.zeros((9,), jnp.int32))
    with pytest.raises(TypeError, match="input_ids"):
        run(jnp.zeros((2, 9), jnp.float32))
    with pytest.raises(TypeError, match="attention_mask"):
        run(jnp.zeros((2, 9), jnp.int32), attention_mask=jnp.ones((2, 8), jnp.int32))
