"""Conversion rules: each rule's result and inverse, laziness over the memmap, errors that name the rule and the
tensor, and models read from other formats (OpenCLIP's fused text tower, single-file prefixes, ComfyUI's T5) equal
to the same model read from its transformers folder, and to transformers."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

import eqxdiff
from eqxdiff.loading import (
    Concat,
    ConversionError,
    Dim,
    Drop,
    Keep,
    LazyTensor,
    Rename,
    Reshape,
    SafetensorsFile,
    Split,
    Substitute,
    SwapHalves,
    TensorDict,
    Tie,
    Transpose,
    convert,
    convert_tensors,
    formats,
    inverse,
    state_dict,
)

from ._util import assert_close, randomize_torch


def _arange(*shape, start=0):
    return (np.arange(np.prod(shape), dtype=np.float32) + start).reshape(shape)


def _same(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k, v in a.items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(b[k]), err_msg=k)


# -- each rule, and its inverse ---------------------------------------------------------------------------------------


def _bfl_like(width, mlp, layers=2):
    """Tensors in a made-up 'other' format: a prefix, fused qkv, BFL-style linear1 (q, k, v, mlp), a transposed
    projection, (shift, scale) halves, a 1x1 conv, a tied embedding and tensors the model does not use."""
    t = {"step": np.zeros((), np.int64), "m.emb": _arange(7, width, start=-3)}
    for i in range(layers):
        s = 1000 * (i + 1)
        t[f"m.blocks.{i}.qkv.weight"] = _arange(3 * width, width, start=s)
        t[f"m.blocks.{i}.linear1.weight"] = _arange(3 * width + mlp, width, start=-s)
        t[f"m.blocks.{i}.linear1.bias"] = _arange(3 * width + mlp, start=s / 2)
        t[f"m.blocks.{i}.proj"] = _arange(width, 2 * width, start=s / 3)
        t[f"m.blocks.{i}.attn_conv.weight"] = _arange(width, width, 1, 1, start=s / 5)
    t["m.final.adaLN"] = _arange(2 * width, width, start=7)
    return t


def _rules():
    return [
        Drop("step"),
        Rename("m.{name}", "{name}"),
        Split("blocks.{i}.qkv.weight", ("blocks.{i}.to_q.weight", "blocks.{i}.to_k.weight", "blocks.{i}.to_v.weight")),
        Split("blocks.{i}.linear1.bias", ("blocks.{i}.q.bias", "blocks.{i}.k.bias", "blocks.{i}.v.bias",
                                         "blocks.{i}.mlp.bias"),  # sized by the weight, so split before it
              sizes=(Dim(1, "blocks.{i}.linear1.weight"),) * 3 + (-1,)),
        Split("blocks.{i}.linear1.weight", ("blocks.{i}.q.weight", "blocks.{i}.k.weight", "blocks.{i}.v.weight",
                                           "blocks.{i}.mlp.weight"), sizes=(Dim(1), Dim(1), Dim(1), -1)),
        Concat(("blocks.{i}.k.weight", "blocks.{i}.v.weight"), "blocks.{i}.kv.weight"),
        Transpose("blocks.{i}.proj", target="blocks.{i}.proj.weight"),
        Reshape("blocks.{i}.attn_conv.weight", (Dim(0), Dim(1)), target="blocks.{i}.attn.weight",
                inverse_shape=(Dim(0), Dim(1), 1, 1)),
        SwapHalves("final.adaLN", target="final.linear.weight"),
        Tie("emb", ("shared.weight", "encoder.embed.weight")),  # after the prefix: its inverse adds it to all
    ]


@pytest.mark.parametrize("width,mlp", [(4, 16), (6, 10)])
def test_rules_convert_and_invert(width, mlp):
    stored = _bfl_like(width, mlp)
    ours = convert_tensors(stored, _rules())
    for i in range(2):
        qkv, lin1 = stored[f"m.blocks.{i}.qkv.weight"], stored[f"m.blocks.{i}.linear1.weight"]
        bias = stored[f"m.blocks.{i}.linear1.bias"]
        for j, p in enumerate("qkv"):
            np.testing.assert_array_equal(ours[f"blocks.{i}.to_{p}.weight"], qkv[j * width:(j + 1) * width])
        np.testing.assert_array_equal(ours[f"blocks.{i}.q.weight"], lin1[:width])
        np.testing.assert_array_equal(ours[f"blocks.{i}.kv.weight"], lin1[width:3 * width])
        np.testing.assert_array_equal(ours[f"blocks.{i}.mlp.weight"], lin1[3 * width:])
        assert ours[f"blocks.{i}.mlp.weight"].shape == (mlp, width)
        np.testing.assert_array_equal(ours[f"blocks.{i}.v.bias"], bias[2 * width:3 * width])
        np.testing.assert_array_equal(ours[f"blocks.{i}.mlp.bias"], bias[3 * width:])
        np.testing.assert_array_equal(ours[f"blocks.{i}.proj.weight"], stored[f"m.blocks.{i}.proj"].T)
        np.testing.assert_array_equal(ours[f"blocks.{i}.attn.weight"],
                                      stored[f"m.blocks.{i}.attn_conv.weight"][..., 0, 0])
    ada = stored["m.final.adaLN"]
    np.testing.assert_array_equal(ours["final.linear.weight"], np.concatenate([ada[width:], ada[:width]]))
    np.testing.assert_array_equal(ours["shared.weight"], stored["m.emb"])
    np.testing.assert_array_equal(ours["encoder.embed.weight"], stored["m.emb"])
    assert "step" not in ours and not any(k.startswith("m.") for k in ours)

    back = convert_tensors(ours, inverse(_rules()))  # the other way: everything but the dropped tensor returns
    _same(back, {k: v for k, v in stored.items() if k != "step"})


def test_substitute_keep_and_swap_halves_on_other_axes():
    t = {"a.x": _arange(2, 6), "b.x": _arange(3), "c": _arange(3, 2, 4)}
    out = convert_tensors(t, [Keep(("a.{n}", "c")), Substitute(r"^a\.", "model.a."), SwapHalves("c", axis=-1),
                              Transpose("c", (2, 0, 1))])
    assert sorted(out) == ["c", "model.a.x"]
    c = np.concatenate([t["c"][..., 2:], t["c"][..., :2]], -1).transpose(2, 0, 1)
    np.testing.assert_array_equal(out["c"], c)
    _same(convert_tensors(out, inverse([SwapHalves("c", axis=-1), Transpose("c", (2, 0, 1))])),
          {"c": t["c"], "model.a.x": t["a.x"]})


# -- laziness ---------------------------------------------------------------------------------------------------------


def test_split_pieces_are_views_of_the_memmap(tmp_path):
    save_file({"blocks.0.qkv": torch.arange(48.0).reshape(12, 4)}, str(tmp_path / "f.safetensors"))
    f = SafetensorsFile(tmp_path / "f.safetensors")
    view = convert(f, [Split("blocks.{i}.qkv", ("q.{i}", "k.{i}", "v.{i}")), Transpose("k.{i}")])
    for name in ("q.0", "k.0", "v.0"):
        piece = view.get(name)
        assert isinstance(piece, np.memmap) and np.shares_memory(piece, f.get("blocks.0.qkv")), name
    np.testing.assert_array_equal(view.get("k.0"), np.arange(16.0, 32.0).reshape(4, 4).T)


class _Recording(TensorDict):
    """Hands out lazy tensors that log the boxes read from them."""

    def __init__(self, tensors):
        super().__init__(tensors)
        self.reads = []

    def get(self, name):
        arr = super().get(name)

        def read(box):
            self.reads.append((name, tuple((s.start, s.stop) for s in box)))
            return arr[box]
        return LazyTensor(arr.shape, arr.dtype, read)


def test_concat_reads_only_the_slice_asked_for():
    source = _Recording({"q": _arange(4, 6), "k": _arange(4, 6, start=100), "v": _arange(4, 6, start=200)})
    view = convert(source, [Concat(("q", "k", "v"), "qkv"), Transpose("qkv")])
    assert view.shape("qkv") == (6, 12) and source.reads == []  # nothing read to learn names and shapes
    part = view.get("qkv")[1:3, 5:9]  # columns 5..8 of the transposed fused tensor: rows 1..3 of k, 0 of v
    np.testing.assert_array_equal(part, np.concatenate([source._tensors[n] for n in "qkv"])[5:9, 1:3].T)
    assert source.reads == [("k", ((1, 4), (1, 3))), ("v", ((0, 1), (1, 3)))]
    np.testing.assert_array_equal(np.asarray(view.get("qkv")), np.concatenate([source._tensors[n] for n in "qkv"]).T)


# -- errors name the rule and the tensor ----------------------------------------------------------------------------


def test_errors_name_the_rule_and_the_tensor():
    t = TensorDict({"blocks.0.qkv.weight": _arange(9, 2), "blocks.0.q": _arange(2), "blocks.1.q": _arange(2),
                    "blocks.0.k": _arange(2), "odd": _arange(3, 2), "w": _arange(2, 3)})

    def fails(rule, match):
        with pytest.raises(ConversionError, match=match):
            convert(t, [rule])

    fails(Rename("block.{i}.qkv.weight", "x.{i}"),
          r"Rename\(source='block.\{i\}.qkv.weight'.*no tensor in the checkpoint matches.*closest.*"
          r"'blocks.0.qkv.weight'")
    convert(t, [Rename("nothing.{i}", "x.{i}", optional=True)])  # optional: fine
    fails(Split("blocks.{i}.qkv.weight", ("a.{i}", "b.{i}")), r"Split.*'blocks.0.qkv.weight' has 9 along axis 0.*"
                                                               r"2 equal parts; give sizes")
    fails(Split("blocks.{i}.qkv.weight", ("a.{i}", "b.{i}"), sizes=(4, 4)), r"shape \(9, 2\).*sizes are \[4, 4\]")
    fails(Split("blocks.{i}.qkv.weight", ("a.{i}", "b.{i}"), sizes=(Dim(0, "blocks.{i}.bias"), -1)),
          r"size is read from 'blocks.0.bias' \(for 'blocks.0.qkv.weight'\), which the checkpoint does not hold")
    fails(Concat(("blocks.{i}.q", "blocks.{i}.k"), "blocks.{i}.qk"),
          r"Concat.*holds 'blocks.1.q' but not 'blocks.1.k', which go with it")
    fails(Concat(("w", "odd"), "wo", axis=1), r"tensors 'w', 'odd' have shapes \[\(2, 3\), \(3, 2\)\]")
    fails(SwapHalves("odd"), r"SwapHalves.*'odd' of shape \(3, 2\) has no axis 0 of even length")
    fails(Reshape("odd", (4, -1)), r"Reshape.*'odd' of shape \(3, 2\) cannot be reshaped to \(4, 1\)")
    fails(Transpose("odd", (0, 2, 1)), r"'odd' has shape \(3, 2\); perm \(0, 2, 1\) is not a permutation")
    fails(Rename("blocks.{i}.q", "w"), r"'blocks.0.q' and 'blocks.1.q' both become 'w'")
    fails(Rename("odd", "w"), r"makes 'w' from 'odd', but the checkpoint already holds a tensor of that name")
    fails(Substitute(r"^blocks\.\d\.", ""), r"'blocks.0.q' and 'blocks.1.q' both become 'q'")
    with pytest.raises(ConversionError, match=r"Substitute.*has no inverse"):
        inverse([Substitute("a", "b")])
    with pytest.raises(ConversionError, match=r"Reshape.*has no inverse"):
        inverse([Reshape("a", (2, 3))])
    with pytest.raises(ValueError, match=r"target 'x.\{j\}' uses placeholder\(s\) \['j'\]"):
        Rename("a.{i}", "x.{j}")
    with pytest.raises(ValueError, match="at most one size may be -1"):
        Split("a", ("b", "c"), sizes=(-1, -1))
    with pytest.raises(ValueError, match="every source must capture the same placeholders"):
        Concat(("a.{i}", "b"), "c")
    with pytest.raises(TypeError, match="a conversion is a sequence of rules"):
        convert(t, [("a", "b")])


# -- models from other formats ----------------------------------------------------------------------------------------

CLIP_CONFIGS = {
    "bigG-like": dict(vocab_size=99, hidden_size=32, intermediate_size=37, projection_dim=16, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=12, hidden_act="gelu", bos_token_id=0,
                      eos_token_id=2, pad_token_id=1),
    "H-like": dict(vocab_size=101, hidden_size=24, intermediate_size=40, projection_dim=20, num_hidden_layers=3,
                   num_attention_heads=2, max_position_embeddings=10, hidden_act="quick_gelu", layer_norm_eps=1e-6,
                   bos_token_id=97, eos_token_id=98, pad_token_id=0),
}


def _openclip_file(sd: dict) -> dict:
    """OpenCLIP's names for a transformers CLIP text tower, written out by hand (as open_clip stores it)."""
    out = {"logit_scale": torch.tensor(4.6),
           "token_embedding.weight": sd["text_model.embeddings.token_embedding.weight"],
           "positional_embedding": sd["text_model.embeddings.position_embedding.weight"],
           "ln_final.weight": sd["text_model.final_layer_norm.weight"],
           "ln_final.bias": sd["text_model.final_layer_norm.bias"],
           "text_projection": sd["text_projection.weight"].T.contiguous()}
    layers = {int(k.split(".")[3]) for k in sd if k.startswith("text_model.encoder.layers.")}
    for i in layers:
        ours, theirs = f"text_model.encoder.layers.{i}.", f"transformer.resblocks.{i}."
        for kind in ("weight", "bias"):
            out[theirs + f"attn.in_proj_{kind}"] = torch.cat([sd[ours + f"self_attn.{p}_proj.{kind}"] for p in "qkv"])
            for a, b in (("attn.out_proj", "self_attn.out_proj"), ("ln_1", "layer_norm1"), ("ln_2", "layer_norm2"),
                         ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
                out[theirs + f"{a}.{kind}"] = sd[ours + f"{b}.{kind}"]
    return out


@pytest.fixture(scope="module", params=list(CLIP_CONFIGS))
def clip(request, tmp_path_factory):
    """A random transformers CLIPTextModelWithProjection saved as a folder, and its inputs."""
    cfg = CLIP_CONFIGS[request.param]
    torch.manual_seed(0)
    ref = transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(**cfg)).eval()
    randomize_torch(ref, seed=1)
    folder = tmp_path_factory.mktemp("clip") / request.param
    ref.save_pretrained(folder)
    ids = np.random.default_rng(0).integers(3, cfg["vocab_size"] - 4, (2, cfg["max_position_embeddings"]))
    ids[:, -1] = cfg["vocab_size"] - 1 if cfg["eos_token_id"] == 2 else cfg["eos_token_id"]
    with torch.no_grad():
        out = ref(torch.from_numpy(ids))
    return folder, ref, ids, out


def _equal_models(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b) and len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@eqx.filter_jit
def _run(model, ids):
    out = model(ids)
    return out.last_hidden_state, out.text_embeds


def test_openclip_text_tower_from_an_sdxl_single_file(clip, tmp_path):
    folder, ref, ids, want = clip
    sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    stored = {formats.SDXL_OPENCLIP + k: v for k, v in _openclip_file(sd).items()}
    stored["model.diffusion_model.input_blocks.0.0.weight"] = torch.zeros(2, 2)  # other components of the file
    stored["conditioner.embedders.0.transformer.text_model.final_layer_norm.weight"] = torch.ones(3)
    save_file(stored, str(tmp_path / "sd_xl.safetensors"))
    rules = [*formats.select(formats.SDXL_OPENCLIP), *formats.openclip_text()]

    model = eqxdiff.load(tmp_path / "sd_xl.safetensors", model_class="CLIPTextModelWithProjection", config=folder,
                         conversion=rules)
    plain = eqxdiff.load(folder)
    _equal_models(model, plain)  # the same weights as the transformers folder gives, so the same outputs
    hidden, embeds = _run(model, jnp.asarray(ids))
    for a, b in zip((hidden, embeds), _run(plain, jnp.asarray(ids))):  # one compiled program, the same weights and
        np.testing.assert_array_equal(a, b)  # inputs: the same float32 operations, exactly equal on any CPU
    assert_close(hidden, want.last_hidden_state.numpy(), what="last_hidden_state")
    assert_close(embeds, want.text_embeds.numpy(), what="text_embeds")
    # and back: eqxdiff's state dict through the inverse rules is the OpenCLIP part of the file
    back = convert_tensors(state_dict(plain), inverse(rules))
    _same(back, {k: v.numpy() for k, v in stored.items() if k.startswith(formats.SDXL_OPENCLIP)
                 and not k.endswith("logit_scale")})


def test_sd1_single_file_prefix_sharded_and_stacked(clip, tmp_path):
    folder, ref, _, _ = clip
    stored = {formats.SD1_CLIP + k: v for k, v in ref.state_dict().items() if k != "text_projection.weight"}
    stored |= {"first_stage_model.decoder.conv_in.weight": torch.zeros(1), "alphas_cumprod": torch.ones(4)}
    save_file(stored, str(tmp_path / "v1.safetensors"))
    mesh = jax.make_mesh((8,), ("fsdp",), devices=jax.devices()[:8], axis_types=(jax.sharding.AxisType.Auto,))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "fsdp"))  # each device: 1/8 of a leaf
    model = eqxdiff.load(tmp_path / "v1.safetensors", model_class="CLIPTextModel", config=folder, scan_layers=True,
                         conversion=formats.select(formats.SD1_CLIP),
                         sharding=lambda spec, shape: split if len(shape) > 1 and shape[1] % 8 == 0 else None)
    sharded = [x for x in jax.tree_util.tree_leaves(model) if x.sharding == split]
    assert len(sharded) >= 6 and all(x.addressable_shards[0].data.shape[1] * 8 == x.shape[1] for x in sharded)
    plain = eqxdiff.load(folder, model_class="CLIPTextModel", scan_layers=True,
                         conversion=[Drop("text_projection.weight")])  # a folder read through rules too
    _equal_models(model, plain)  # test_clip holds the folder's model to transformers


T5_CONFIGS = {
    "relu": dict(vocab_size=103, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                 relative_attention_num_buckets=8, feed_forward_proj="relu"),
    "gated-gelu": dict(vocab_size=97, d_model=24, d_kv=6, d_ff=40, num_layers=3, num_heads=3,
                       relative_attention_num_buckets=6, relative_attention_max_distance=12,
                       feed_forward_proj="gated-gelu"),
}


@pytest.mark.parametrize("name,tied", [("relu", "shared.weight"), ("gated-gelu", "encoder.embed_tokens.weight")])
def test_t5_encoder_from_a_comfyui_file(name, tied, tmp_path):
    torch.manual_seed(0)
    ref = transformers.T5EncoderModel(transformers.T5Config(**T5_CONFIGS[name])).eval()
    randomize_torch(ref, seed=2)
    ref.save_pretrained(tmp_path / "t5")
    stored = {formats.COMFY_T5XXL + k: v.contiguous() for k, v in ref.state_dict().items()
              if k not in ("shared.weight", "encoder.embed_tokens.weight") or k == tied}  # the tied table once
    stored["text_encoders.clip_l.transformer.text_model.final_layer_norm.weight"] = torch.ones(3)
    save_file(stored, str(tmp_path / "flux_all_in_one.safetensors"))
    model = eqxdiff.load(tmp_path / "flux_all_in_one.safetensors", model_class="T5EncoderModel",
                         config=tmp_path / "t5", conversion=formats.select(formats.COMFY_T5XXL))
    plain = eqxdiff.load(tmp_path / "t5")
    _equal_models(model, plain)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, T5_CONFIGS[name]["vocab_size"], (2, 7)))
    got = eqx.filter_jit(lambda m, x: m(x).last_hidden_state)(model, ids)
    with torch.no_grad():
        want = ref(torch.from_numpy(np.array(ids))).last_hidden_state.numpy()
    assert_close(got, want)
