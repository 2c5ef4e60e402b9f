"""T5 and UMT5 encoders: the parity base (:mod:`tests._parity`: every hidden state, with and without a padding mask)
at ReLU and gated-GELU configs of each, against full-size layouts (t5-base, t5-v1_1-xxl, umt5-xxl); then
what the base does not check: scan_layers, gradients through the relative position bias (against PyTorch's), the
tied embedding under either name, the buckets at their log-scale boundaries, config and input errors."""

from types import SimpleNamespace

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
from eqxdiff.core import ConfigError, Plan, Remat, checkpoint_names, with_plan
from eqxdiff.loading import state_dict
from eqxdiff.models.t5 import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel, relative_position_buckets

from ._parity import ModelParity
from ._util import assert_close, assert_close_to_float64, randomize_torch

# The tiny T5 of the family notes (ReLU, 8 buckets up to 128), a gated-GELU one whose 12-token max distance the
# 23-token inputs exceed, and two UMT5s (a table per block): gated-GELU with 10 buckets up to 16 (exceeded), and ReLU
# with 16 buckets up to 40 (every distance log-spaced below the limit), heads narrower than the model
# (3 x 6 = 18 < 24) and another layer-norm epsilon.
CONFIGS = {
    "relu": dict(vocab_size=1103, d_model=32, d_kv=8, d_ff=37, num_layers=5, num_heads=4,
                 relative_attention_num_buckets=8, feed_forward_proj="relu"),
    "gated-gelu": dict(vocab_size=99, d_model=24, d_kv=6, d_ff=40, num_layers=3, num_heads=3,
                       relative_attention_num_buckets=6, relative_attention_max_distance=12, layer_norm_epsilon=1e-3,
                       feed_forward_proj="gated-gelu"),
    "umt5": dict(vocab_size=101, d_model=16, d_kv=4, d_ff=28, num_layers=3, num_heads=4,
                 relative_attention_num_buckets=10, relative_attention_max_distance=16, feed_forward_proj="gated-gelu"),
    "umt5-relu": dict(vocab_size=89, d_model=24, d_kv=6, d_ff=36, num_layers=2, num_heads=3,
                      relative_attention_num_buckets=16, relative_attention_max_distance=40, layer_norm_epsilon=1e-5,
                      feed_forward_proj="relu"),
}
SEQ = 23

# full-size layouts (config.json values)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              feed_forward_proj="gated-gelu")  # google/t5-v1_1-xxl: Flux's and LTX-Video's text encoder
T5_BASE = dict(vocab_size=32128, d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_heads=12, feed_forward_proj="relu")
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                feed_forward_proj="gated-gelu")  # google/umt5-xxl: Wan's text encoder


def _named(last, hidden, prefix: str) -> dict:
    return {f"{prefix}last_hidden_state": last, **{f"{prefix}hidden_states.{i}": h for i, h in enumerate(hidden)}}


class T5Parity(ModelParity):
    """Every output, once without and once with a padding mask (``masked.``: the second row keeps 9 tokens)."""

    # The unscaled attention logits of these randomised encoders make bfloat16 drift by layer: transformers' own
    # bfloat16 run (with wo kept in float32) is 4.6% (gated-gelu) and 5.9% (umt5) off its float32 output here,
    # eqxdiff's 6.1% and 5.3% (5.9% and 4.4% before its activations were rounded once from float32; the mean errors
    # over the outputs fell, 1.43% -> 1.41% and 1.63% -> 1.56%, transformers' 1.42% and 1.80%); the sanity bound is
    # set above both.
    bf16_tolerance = 8e-2

    def inputs(self, reference):
        ids = np.random.default_rng(0).integers(0, self.config["vocab_size"], (2, SEQ)).astype(np.int32)
        mask = (np.arange(SEQ)[None] < np.array([[SEQ], [9]])).astype(np.int32)
        return dict(input_ids=ids, attention_mask=mask)

    def reference_outputs(self, reference, inputs):
        out = {}
        for prefix, mask in (("", None), ("masked.", torch.from_numpy(inputs["attention_mask"]))):
            got = reference(input_ids=torch.from_numpy(inputs["input_ids"]).long(), attention_mask=mask,
                            output_hidden_states=True)
            out.update(_named(got.last_hidden_state, got.hidden_states, prefix))
        return {k: v.numpy() for k, v in out.items()}

    @staticmethod
    def outputs(model, inputs):
        ids = jnp.asarray(inputs["input_ids"])
        plain = model(ids, output_hidden_states=True)
        masked = model(ids, attention_mask=jnp.asarray(inputs["attention_mask"]), output_hidden_states=True)
        return {**_named(plain.last_hidden_state, plain.hidden_states, ""),
                **_named(masked.last_hidden_state, masked.hidden_states, "masked.")}


class T5EncoderParity(T5Parity):
    model_class = T5EncoderModel
    reference_class = transformers.T5EncoderModel


class UMT5EncoderParity(T5Parity):
    model_class = UMT5EncoderModel
    reference_class = transformers.UMT5EncoderModel
    full_size = {"umt5-xxl": UMT5_XXL}


class TestT5Relu(T5EncoderParity):
    config = CONFIGS["relu"]
    full_size = {"t5-base": T5_BASE}


class TestT5GatedGelu(T5EncoderParity):
    config = CONFIGS["gated-gelu"]
    full_size = {"t5-v1_1-xxl": T5_XXL}


class TestUMT5(UMT5EncoderParity):
    config = CONFIGS["umt5"]


class TestUMT5Relu(UMT5EncoderParity):
    config = CONFIGS["umt5-relu"]


@pytest.mark.parametrize("parity", [TestT5GatedGelu, TestUMT5])
def test_scan_layers_gives_the_same_numbers_and_names(parity, tmp_path_factory):
    case = parity.build(tmp_path_factory)
    scanned = eqxdiff.load(case.folder, scan_layers=True)
    assert isinstance(scanned.encoder.block, nn.Stacked) and len(scanned.encoder.block) == parity.config["num_layers"]
    assert (scanned.encoder.relative_attention_bias is None) == (parity is TestUMT5)
    ours, theirs = state_dict(case.model), state_dict(scanned)
    assert set(ours) == set(theirs)
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    got = parity.run(scanned, case.inputs)  # as accurate as the unrolled run, against its float64 run
    actual64 = parity.actual64(case)
    for name, value in case.actual.items():
        assert_close_to_float64(got[name], value, actual64[name], what=f"scanned {name}")


@pytest.mark.parametrize("parity", [TestT5Relu, TestUMT5])
def test_gradients_through_the_position_bias_match_pytorch(parity, tmp_path_factory):
    """Training the encoder: the loss's gradients w.r.t. the relative position bias table(s), the first block's
    query projection and the embedding match PyTorch's. T5 (one table feeding every block) through the chunked
    kernel's custom backward, blocks scanned and rematerialised; UMT5 (a table per block) through the dense
    reference's autodiff."""
    case = parity.build(tmp_path_factory)
    ids, mask = case.inputs["input_ids"], case.inputs["attention_mask"]
    weight = np.random.default_rng(3).standard_normal((*ids.shape, parity.config["d_model"])).astype(np.float32)

    reference = case.reference
    reference.zero_grad()
    out = reference(input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask))
    (out.last_hidden_state * torch.from_numpy(weight)).sum().backward()
    per_layer = parity is TestUMT5
    tables = [f"encoder.block.{i}.layer.0.SelfAttention.relative_attention_bias.weight"
              for i in range(parity.config["num_layers"] if per_layer else 1)]
    names = [*tables, "encoder.block.0.layer.0.SelfAttention.q.weight", "shared.weight"]
    params = dict(reference.named_parameters())
    expected = {n: params[n].grad.numpy() for n in names}

    @eqx.filter_jit
    @eqx.filter_grad
    def grads(model):
        hidden = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)).last_hidden_state
        return jnp.sum(hidden * weight)

    assert "t5_block" in checkpoint_names(case.model)
    model = case.model
    if parity is TestT5Relu:
        remat = Plan(remat=Remat.NAMED, remat_names=("t5_block",))
        model = with_plan(nn.with_attention_implementation(nn.scan_layers(model), "chunked"), remat)
    got = state_dict(grads(model))
    for name in names:
        assert_close(got[name], expected[name], 1e-4, f"d{name}")


def test_tied_embedding_is_read_under_either_name(tmp_path_factory, tmp_path):
    """Files written before transformers 5 (or by other tools) hold the tied table as ``encoder.embed_tokens.weight``
    too, or only; eqxdiff reads them all and writes ``shared.weight``, as transformers does."""
    case = TestT5Relu.build(tmp_path_factory)
    tensors = load_file(case.folder / "model.safetensors")
    assert "shared.weight" in tensors and "encoder.embed_tokens.weight" not in tensors
    alias = {("encoder.embed_tokens.weight" if k == "shared.weight" else k): v for k, v in tensors.items()}
    variants = {"both": {**tensors, "encoder.embed_tokens.weight": tensors["shared.weight"].clone()}, "alias": alias}
    for name, stored in variants.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text((case.folder / "config.json").read_text())
        save_file(stored, tmp_path / name / "model.safetensors", metadata={"format": "pt"})
        model = eqxdiff.load(tmp_path / name)
        for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(case.model), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=name)
    assert "encoder.embed_tokens.weight" not in state_dict(model) and "shared.weight" in state_dict(model)


@pytest.mark.parametrize("buckets,max_distance", [(32, 128), (8, 128), (6, 12), (10, 16), (64, 256), (7, 20)])
def test_buckets_match_transformers(buckets, max_distance):
    """Every relative distance up to 1500 either way lands in transformers' bucket (T5's and UMT5's functions),
    the log-scale boundaries included (float32 arithmetic, truncation)."""
    n = 1500
    ours = relative_position_buckets(n, n, buckets, max_distance)
    relative = torch.arange(n)[None, :] - torch.arange(n)[:, None]
    t5 = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket(
        relative, bidirectional=True, num_buckets=buckets, max_distance=max_distance)
    umt5 = transformers.models.umt5.modeling_umt5.UMT5Attention._relative_position_bucket(
        SimpleNamespace(relative_attention_num_buckets=buckets, relative_attention_max_distance=max_distance,
                        is_decoder=False), relative)  # a method reading the attention's settings
    # Integers from the same float32 operations: exactly equal. The CPU's float32 log could move a bucket only at a
    # boundary, and the logs there are of powers of two (distances 1, 2, 4, ..., 128 of these configs), which every
    # float32 log returns correctly rounded; every other distance sits at least 646 float32 ulps from a boundary.
    np.testing.assert_array_equal(ours, t5.numpy())
    np.testing.assert_array_equal(ours, umt5.numpy())
    assert ours.dtype == np.int32 and ours.min() == 0 and ours.max() == 2 * (buckets // 2) - 1  # 7: 6 used
    assert relative_position_buckets(3, 5, 8, 16).shape == (3, 5)  # cross shapes


def test_config_round_trip_and_errors(tmp_path):
    config = T5Config.from_dict({**CONFIGS["gated-gelu"], "dense_act_fn": "gelu_new", "is_gated_act": True,
                                 "transformers_version": "5.23.0", "model_type": "t5"})
    assert T5Config.from_dict(config.to_dict()) == config and config.to_dict()["model_type"] == "t5"
    assert config.is_gated_act and config.dense_act_fn == "gelu_new"
    umt5 = UMT5Config()
    assert (umt5.vocab_size, umt5.feed_forward_proj, umt5.to_dict()["model_type"]) == (250112, "gated-gelu", "umt5")
    with pytest.raises(ConfigError, match=r"unsupported config value feed_forward_proj='gated-tanh'; eqxdiff "
                                          r"supports feed_forward_proj in \['relu', 'gelu', .*'gated-silu'"):
        T5Config(feed_forward_proj="gated-tanh")
    with pytest.raises(ConfigError, match=r"model_type='umt5'"):
        T5Config.from_dict({**CONFIGS["relu"], "model_type": "umt5"})
    with pytest.raises(ConfigError, match=r"num_heads=0 must be a positive integer"):
        T5Config(num_heads=0)
    with pytest.raises(ConfigError, match=r"relative_attention_num_buckets=2 must be at least 4"):
        T5Config(relative_attention_num_buckets=2)
    with pytest.raises(ConfigError, match=r"relative_attention_max_distance=8 must exceed the exact distances "
                                          r"\(8 for relative_attention_num_buckets=32\): transformers builds .* "
                                          r"overflow \(equal to them\), so its outputs are garbage"):
        T5Config(relative_attention_max_distance=8)
    with pytest.raises(ConfigError, match=r"d_model='32' has the wrong type"):
        T5Config.from_dict({**CONFIGS["relu"], "d_model": "32"})


def test_wrong_inputs_are_named():
    model = eqx.filter_eval_shape(T5EncoderModel, T5Config.from_dict(CONFIGS["relu"]), key=jax.random.key(0))
    run = lambda ids, **kw: eqx.filter_eval_shape(lambda m, x: m(x, **kw), model, ids)  # noqa: E731
    out = run(jnp.zeros((2, 600), jnp.int32))  # any length: positions are relative
    assert out.last_hidden_state.shape == (2, 600, 32) and out.hidden_states is None
    with pytest.raises(TypeError, match="input_ids"):
        run(jnp.zeros((2, 7), jnp.float32))
    with pytest.raises(TypeError, match="input_ids"):
        run(jnp.zeros((7,), jnp.int32))
    with pytest.raises(TypeError, match="attention_mask"):
        run(jnp.zeros((2, 7), jnp.int32), attention_mask=jnp.ones((2, 6), jnp.int32))


@pytest.mark.parametrize("proj", ["gated-silu", "gelu", "gated-gelu_new", "gelu_fast"])
def test_other_feed_forward_activations_match_transformers(proj, tmp_path):
    """transformers reads ``feed_forward_proj`` as ``[gated-]ACT`` (ACT any of its activations; only "gated-gelu"
    alone means the tanh GELU): one block each, every weight random, last hidden state at 1e-4."""
    config = dict(vocab_size=37, d_model=12, d_kv=5, d_ff=20, num_layers=1, num_heads=3,
                  relative_attention_num_buckets=6, relative_attention_max_distance=9, feed_forward_proj=proj)
    ref = transformers.T5EncoderModel(transformers.T5Config(**config)).eval()
    randomize_torch(ref, seed=7)
    ref.save_pretrained(tmp_path)
    ours = eqxdiff.load(tmp_path)
    assert ours.config.dense_act_fn == ref.config.dense_act_fn
    assert ours.config.is_gated_act == ref.config.is_gated_act
    ids = np.random.default_rng(7).integers(0, 37, (2, 11))
    with torch.no_grad():
        theirs = ref(input_ids=torch.from_numpy(ids)).last_hidden_state.numpy()
    assert_close(ours(jnp.asarray(ids)).last_hidden_state, theirs, 1e-4)
