"""CLIP text encoders against transformers at small random configs (1e-4 in float32), checkpoints both ways, errors."""

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

from ._util import assert_close

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
CLASSES = {"CLIPTextModel": CLIPTextModel, "CLIPTextModelWithProjection": CLIPTextModelWithProjection}


def _torch_model(cls_name, cfg, seed=0):
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(transformers.CLIPTextConfig(**cfg)).eval()
    with torch.no_grad():  # move layer norms and biases off their 1/0 init so every parameter matters
        for name, p in model.named_parameters():
            if "layer_norm" in name and name.endswith("weight"):
                p.add_(0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
    return model


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
    return ids, mask


def _torch_outputs(ref, ids, mask):
    with torch.no_grad():
        kwargs = dict(input_ids=torch.from_numpy(ids),
                      attention_mask=None if mask is None else torch.from_numpy(mask), output_hidden_states=True)
        out = ref(**kwargs)
        pooled = ref.text_model(**kwargs).pooler_output if hasattr(out, "text_embeds") else out.pooler_output
    return out, pooled


def _assert_matches(ours, ref, ids, mask):
    out, pooled = _torch_outputs(ref, ids, mask)
    got = eqx.filter_jit(ours)(jnp.asarray(ids, jnp.int32), output_hidden_states=True,
                               attention_mask=None if mask is None else jnp.asarray(mask))
    assert_close(got.last_hidden_state, out.last_hidden_state, what="last_hidden_state")
    assert_close(got.pooler_output, pooled, what="pooler_output")
    assert len(got.hidden_states) == len(out.hidden_states) == ours.config.num_hidden_layers + 1
    for i, (a, b) in enumerate(zip(got.hidden_states, out.hidden_states)):
        assert_close(a, b, what=f"hidden_states[{i}]")
    if hasattr(out, "text_embeds"):
        assert_close(got.text_embeds, out.text_embeds, what="text_embeds")
    else:
        assert got.text_embeds is None


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
@pytest.mark.parametrize("cls_name", sorted(CLASSES))
def test_matches_transformers(cls_name, config_name, tmp_path):
    cfg = CONFIGS[config_name]
    ref = _torch_model(cls_name, cfg)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    ours = eqxdiff.load(tmp_path)
    assert type(ours) is CLASSES[cls_name]
    seq = cfg["max_position_embeddings"] - (config_name == "sd1")
    ids, mask = _inputs(cfg, [seq, 4, 2], seq)
    _assert_matches(ours, ref, ids, None)
    _assert_matches(ours, ref, ids, mask.astype(bool) if cls_name == "CLIPTextModel" else mask.astype(np.int32))


@pytest.mark.parametrize("cls_name,config_name", [("CLIPTextModel", "sd2"), ("CLIPTextModelWithProjection", "sd1")])
def test_save_pretrained_round_trips_into_transformers(cls_name, config_name, tmp_path):
    cfg = CONFIGS[config_name]
    _torch_model(cls_name, cfg, seed=1).save_pretrained(tmp_path / "theirs", safe_serialization=True)
    ours = eqxdiff.load(tmp_path / "theirs")
    eqxdiff.save_pretrained(ours, tmp_path / "ours")
    ref, info = getattr(transformers, cls_name).from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert ref.config.model_type == "clip_text_model" and ref.config.hidden_act == cfg["hidden_act"]
    ids, mask = _inputs(cfg, [5, 3], 7, seed=1)
    _assert_matches(ours, ref.eval(), ids, mask)
    again = eqxdiff.load(tmp_path / "ours")
    assert again.config == ours.config
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(again)):
        np.testing.assert_array_equal(a, b)


def test_reads_transformers4_names_with_position_ids_buffer(tmp_path):
    """transformers 5 writes CLIPTextModel without the ``text_model.`` prefix; SD checkpoints (transformers 4) have
    it, and older ones also carry the ``position_ids`` buffer. Both read into the same model."""
    cfg = CONFIGS["sd1"]
    _torch_model("CLIPTextModel", cfg).save_pretrained(tmp_path / "v5", safe_serialization=True)
    tensors = load_file(tmp_path / "v5" / "model.safetensors")
    assert "encoder.layers.1.self_attn.q_proj.weight" in tensors
    (tmp_path / "v4").mkdir()
    (tmp_path / "v4" / "config.json").write_text((tmp_path / "v5" / "config.json").read_text())
    old = {f"text_model.{k}": v for k, v in tensors.items()}
    old["text_model.embeddings.position_ids"] = torch.arange(cfg["max_position_embeddings"])[None]
    save_file(old, tmp_path / "v4" / "model.safetensors", metadata={"format": "pt"})
    v5, v4 = eqxdiff.load(tmp_path / "v5"), eqxdiff.load(tmp_path / "v4")
    assert set(eqxdiff.loading.state_dict(v4)) == set(old) - {"text_model.embeddings.position_ids"}
    for a, b in zip(jax.tree_util.tree_leaves(v5), jax.tree_util.tree_leaves(v4)):
        np.testing.assert_array_equal(a, b)


def test_bfloat16_load_runs(tmp_path):
    cfg = CONFIGS["sd2"]
    _torch_model("CLIPTextModelWithProjection", cfg).save_pretrained(tmp_path, safe_serialization=True)
    f32 = eqxdiff.load(tmp_path)
    bf16 = eqxdiff.load(tmp_path, dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree_util.tree_leaves(bf16)} == {jnp.dtype(jnp.bfloat16)}
    ids, mask = _inputs(cfg, [8, 3], 8)
    ids, mask = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)
    out = eqx.filter_jit(bf16)(ids, attention_mask=mask, output_hidden_states=True)
    assert out.last_hidden_state.dtype == out.text_embeds.dtype == jnp.bfloat16
    assert all(h.dtype == jnp.bfloat16 for h in out.hidden_states)
    # bfloat16 keeps 8 bits of mantissa: a sanity bound, not a parity tolerance.
    ref = eqx.filter_jit(f32)(ids, attention_mask=mask).text_embeds
    assert_close(out.text_embeds, ref, 5e-2, "bfloat16 text_embeds")


def test_config_round_trip_and_unsupported_values(tmp_path):
    config = CLIPTextConfig.from_dict({**CONFIGS["sd1"], "dropout": 0.0, "transformers_version": "4.22.0"})
    assert CLIPTextConfig.from_dict(config.to_dict()) == config
    assert config.to_dict()["model_type"] == "clip_text_model" and config.legacy_pooling and config.head_dim == 8
    with pytest.raises(ConfigError, match=r"hidden_act='relu'"):
        CLIPTextConfig.from_dict({**CONFIGS["sd1"], "hidden_act": "relu"})
    with pytest.raises(ConfigError, match=r"hidden_act='silu'"):
        CLIPTextConfig(hidden_act="silu")
    with pytest.raises(ConfigError, match=r"hidden_size=30 must be divisible by num_attention_heads=4"):
        CLIPTextConfig.from_dict({**CONFIGS["sd1"], "hidden_size": 30})
    with pytest.raises(ConfigError, match=r"eos_token_id=\(2, 3\)"):
        CLIPTextConfig.from_dict({**CONFIGS["sd1"], "eos_token_id": [2, 3]})
    with pytest.raises(ConfigError, match=r"model_type='clip'"):
        CLIPTextConfig.from_dict({**CONFIGS["sd1"], "model_type": "clip"})
    with pytest.raises(ConfigError, match=r"projection_dim=None must be set"):
        CLIPTextModelWithProjection(CLIPTextConfig(projection_dim=None, num_hidden_layers=1), key=jax.random.key(0))
    _torch_model("CLIPTextModel", CONFIGS["sd1"]).save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(ConfigError, match=r"hidden_act='gelu_fast'"):
        eqxdiff.load(tmp_path, config_overrides={"hidden_act": "gelu_fast"})


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
