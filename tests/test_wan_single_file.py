"""Wan's original checkpoints through the single-file layouts (``eqxdiff.pipelines.wan.SINGLE_FILE_LAYOUTS``): a
transformer file in the Wan-AI repositories' names (bare, ComfyUI's ``model.diffusion_model.``, or sharded) and the
Wan 2.1 / 2.2 VAE files, each read by ``eqxdiff.load(file, config=...)`` (no ``conversion=``: the layouts' parts are
found by the tensors) and, for a transformer or VAE file with the rest of the pipeline from a folder, by
``eqxdiff.load_pipeline(file, config=folder)``.

Proven against diffusers: its ``from_single_file`` (``WanTransformer3DModel``, ``AutoencoderKLWan`` for the 2.1
VAE) reads the same files into the very weights eqxdiff reads; Wan 2.2's VAE, which diffusers' single-file reader
does not know, against the mapping of its ``scripts/convert_wan_to_diffusers.py`` (``convert_vae_22``, written out
below). The configs inferred from the tensors are the reference models' configs (the values the tensors do not show
are Wan's published ones). Only weights are compared here (no program compiles): the models' numbers are
``tests/test_wan_model.py``'s and ``tests/test_wan_vae.py``'s.
"""

import json
import re

import diffusers
import numpy as np
import pytest
import torch
from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

import eqxdiff
from eqxdiff.loading import (
    CheckpointError,
    SafetensorsFile,
    convert,
    convert_tensors,
    formats,
    inverse,
    state_dict,
    write_safetensors,
)
from eqxdiff.pipelines import InputError, InputWarning, single_file_class
from eqxdiff.pipelines.wan_i2v import WanImageToVideoPipeline

from . import _tiny_wan as tiny
from ._util import randomize_torch


@pytest.fixture(scope="module")
def i2v(tmp_path_factory):
    """A tiny Wan 2.1 image-to-video folder (added k/v, CLIP processor) and its transformer's state dict."""
    folder = tmp_path_factory.mktemp("wan_i2v")
    ref = tiny.build_i2v(folder, seed=2)
    return folder, {k: v.numpy() for k, v in ref.transformer.state_dict().items()}


def _original(state: dict, prefix: str = "") -> dict:
    return {prefix + k: v for k, v in convert_tensors(state, inverse(formats.wan_transformer())).items()}


def _assert_weights(model, expected: dict, what: str):
    got = state_dict(model)
    assert set(got) == set(expected), what
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=f"{what}: {name}")


def _write(tensors: dict, path):
    write_safetensors(tensors, path)
    return path


def _torch_state(model) -> dict:
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


# -- the transformer --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["", formats.WAN_DIFFUSION_MODEL])
def test_transformer_file_equals_diffusers_from_single_file(i2v, prefix, tmp_path):
    """An image-to-video transformer in the original names (k_img / v_img, norm3, img_emb), bare or below ComfyUI's
    prefix: eqxdiff.load(file, config=) reads exactly what diffusers' from_single_file reads, which is the folder's
    model."""
    folder, state = i2v
    path = _write(_original(state, prefix), tmp_path / "wan2.1_i2v_tiny.safetensors")
    theirs = tiny.WanTransformer3DModel.from_single_file(str(path), config=str(folder / "transformer"),
                                                         torch_dtype=torch.float32)
    expected = _torch_state(theirs)
    assert set(expected) == set(state) and all(np.array_equal(expected[k], state[k]) for k in state)
    _assert_weights(eqxdiff.load(path, config=folder / "transformer"), expected, "original-named file")


def test_sharded_original_transformer_folder(i2v, tmp_path):
    """The Wan-AI repositories' layout: diffusion_pytorch_model-0000N-of-00002.safetensors with their index, in the
    original names; eqxdiff.load(folder, config=) reads them through the same part."""
    folder, state = i2v
    original = _original(state)
    names = sorted(original)
    shards = {"diffusion_pytorch_model-00001-of-00002.safetensors": names[: len(names) // 2],
              "diffusion_pytorch_model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        write_safetensors({k: original[k] for k in keys}, tmp_path / file)
    index = {"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (tmp_path / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    _assert_weights(eqxdiff.load(tmp_path, config=folder / "transformer"), state, "sharded original files")


@pytest.mark.parametrize("extra", [
    dict(),  # text-to-video
    dict(image_dim=8, added_kv_proj_dim=256, cross_attn_norm=False),  # 2.1 image-to-video
    dict(image_dim=8, added_kv_proj_dim=256, pos_embed_seq_len=10, in_channels=36, out_channels=16),  # FLF2V
    dict(patch_size=(1, 2, 1), in_channels=12, out_channels=12, freq_dim=32),  # other patch and sizes
])
def test_transformer_config_from_the_tensors(extra, tmp_path):
    """Every config value the tensors show is read from them (patch, widths, layers, channels, cross-attention
    norm, image width, added k/v, first-last-frame positions); the others are Wan's published ones (heads of 128)."""
    config = {**dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=4,
                     out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                     qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024), **extra}
    ref = diffusers.WanTransformer3DModel(**config)
    path = _write(_original(_torch_state(ref), formats.WAN_DIFFUSION_MODEL), tmp_path / "t.safetensors")
    inferred = formats.wan_transformer_config(SafetensorsFile(path), where="file", prefix=formats.WAN_DIFFUSION_MODEL)
    expected = {k: v for k, v in ref.config.items() if not k.startswith("_")}
    expected["patch_size"] = list(expected["patch_size"])
    assert inferred == {"_class_name": "WanTransformer3DModel", **expected}


def test_load_pipeline_from_a_transformer_file(i2v, tmp_path):
    """load_pipeline(file, config=folder): the transformer from the file, the rest (UMT5, VAE, CLIP and its
    processor, tokenizer, scheduler) from the folder, as the folder's model_index.json names it; a folder without
    transformer/config.json makes eqxdiff read the config from the tensors, which cannot give the head count of
    this tiny model (24 channels): the error says so and what to pass."""
    folder, state = i2v
    path = _write(_original(state, formats.WAN_DIFFUSION_MODEL), tmp_path / "comfy_i2v.safetensors")
    assert single_file_class(path, config=folder) is WanImageToVideoPipeline
    pipe = eqxdiff.load_pipeline(path, config=folder)
    assert isinstance(pipe, WanImageToVideoPipeline) and pipe.image_processor is not None
    _assert_weights(pipe.transformer, state, "the file's transformer")
    from_folder = eqxdiff.load(folder, "vae")
    _assert_weights(pipe.vae, state_dict(from_folder), "the folder's VAE")
    assert pipe.tokenizer is not None and pipe.image_encoder is not None

    bare = tmp_path / "no_transformer_config"
    bare.mkdir()
    (bare / "model_index.json").write_text((folder / "model_index.json").read_text())
    with pytest.raises(CheckpointError, match=r"width 24 is not a multiple of Wan's 128-channel heads.*Pass config="):
        eqxdiff.load_pipeline(path, config=bare)


# -- the VAE ----------------------------------------------------------------------------------------------------------


def _vae(seed: int, **config) -> diffusers.AutoencoderKLWan:
    vae = diffusers.AutoencoderKLWan(**config).eval()
    randomize_torch(vae, seed=seed)
    return vae


def test_wan21_vae_file_equals_diffusers_from_single_file(tmp_path):
    """The released 2.1 layout (4 levels, 2 residual blocks; narrow): eqxdiff.load(file, config=) reads what
    diffusers' from_single_file reads (its converter hard-codes that layout); its config comes from the tensors."""
    reference = _vae(6, base_dim=2, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2)
    reference.save_pretrained(tmp_path / "vae")
    state = _torch_state(reference)
    path = _write(convert_tensors(state, inverse(formats.wan_vae())), tmp_path / "wan_2.1_vae.safetensors")
    theirs = diffusers.AutoencoderKLWan.from_single_file(str(path), config=str(tmp_path / "vae"),
                                                         torch_dtype=torch.float32)
    expected = _torch_state(theirs)
    assert all(np.array_equal(expected[k], state[k]) for k in state)
    _assert_weights(eqxdiff.load(path, config=tmp_path / "vae"), expected, "Wan 2.1 VAE file")
    inferred = formats.wan_vae_config(SafetensorsFile(path), where="file")
    stored = {k: v for k, v in reference.config.items() if not k.startswith("_") and k != "dropout"}
    assert inferred == {"_class_name": "AutoencoderKLWan", **stored}


def _vae22_names(name: str) -> str:
    """diffusers' scripts/convert_wan_to_diffusers.py, convert_vae_22: the middle, heads and quant convs as the 2.1
    converter maps them; ``encoder.downsamples.X.downsamples.Y`` is ``encoder.down_blocks.X.resnets.Y`` (residual
    blocks and shortcuts, renamed as 2.1's) or ``encoder.down_blocks.X.downsampler`` (``resample`` / ``time_conv``:
    the index dropped); the decoder's ``upsamples.X.upsamples.Y`` the same with ``up_blocks`` / ``upsampler``."""
    for side, theirs, ours, sampler in (("encoder", "downsamples", "down_blocks", "downsampler"),
                                        ("decoder", "upsamples", "up_blocks", "upsampler")):
        head = f"{side}.{theirs}."
        if not name.startswith(head):
            continue
        level, _, index, rest = name[len(head):].split(".", 3)
        if rest.startswith(("resample", "time_conv")):
            return f"{side}.{ours}.{level}.{sampler}.{rest}"
        for a, b in (("residual.0.gamma", "norm1.gamma"), ("residual.2.", "conv1."), ("residual.3.gamma",
                     "norm2.gamma"), ("residual.6.", "conv2."), ("shortcut.", "conv_shortcut.")):
            rest = rest.replace(a, b)
        return f"{side}.{ours}.{level}.resnets.{index}.{rest}"
    return next(iter(convert_wan_vae_to_diffusers({name: torch.zeros(())})))


def test_wan22_vae_file_equals_the_convert_script(tmp_path):
    """Wan 2.2's VAE (nested levels, 2x2 patchified pixels, a wider decoder): its original names (the rules'
    inverse) are what convert_vae_22 maps back to the reference's names; eqxdiff.load(file, config=) reads the
    reference's weights, and the config comes from the tensors (the latent statistics: Wan2.2_VAE's published ones)."""
    reference = _vae(7, **dict(tiny.VAE_22, base_dim=2, dim_mult=[1, 2, 4, 4], num_res_blocks=2, decoder_base_dim=4))
    reference.save_pretrained(tmp_path / "vae")
    state = _torch_state(reference)
    original = convert_tensors(state, inverse(formats.wan_vae(residual=True)))
    assert {"encoder.downsamples.1.downsamples.2.time_conv.weight", "decoder.upsamples.0.upsamples.3.resample.1.bias",
            "decoder.upsamples.2.upsamples.0.shortcut.weight", "decoder.middle.1.to_qkv.weight"} <= set(original)
    assert {_vae22_names(k): k for k in original}.keys() == state.keys()
    path = _write(original, tmp_path / "Wan2.2_VAE.safetensors")
    _assert_weights(eqxdiff.load(path, config=tmp_path / "vae"), state, "Wan 2.2 VAE file")
    inferred = formats.wan_vae_config(SafetensorsFile(path), where="file")
    stored = {k: v for k, v in reference.config.items() if not k.startswith("_") and k != "dropout"}
    stored.update(latents_mean=list(formats.WAN22_LATENTS_MEAN), latents_std=list(formats.WAN22_LATENTS_STD))
    assert inferred == {"_class_name": "AutoencoderKLWan", **stored}


def test_load_pipeline_from_a_vae_file(i2v, tmp_path):
    """An original VAE file is a Wan layout too: the pipeline's VAE from it (its config from the folder), the rest
    from the folder."""
    folder, _ = i2v
    vae = state_dict(eqxdiff.load(folder, "vae"))
    path = _write(convert_tensors(vae, inverse(formats.wan_vae(num_res_blocks=1))),
                             tmp_path / "wan_vae.safetensors")
    pipe = eqxdiff.load_pipeline(path, config=folder)
    _assert_weights(pipe.vae, vae, "the file's VAE")


@pytest.mark.parametrize("cut", ["blocks.1.ffn.2.weight", "head.modulation"])
def test_a_cut_file_names_what_it_lacks(i2v, cut, tmp_path):
    """A file missing a tensor is read through the Wan part it fits best, so the error names the one missing
    tensor in the file's names (not every name of another layout), be it one of a repeated block's or a single
    tensor such as head.modulation (which used to fail as a rule that matched nothing). Without head.modulation, a
    Wan layout's signature, load_pipeline names the layout and the tensor (it used to say the file was in no layout
    eqxdiff knows and list other families' prefixes)."""
    folder, state = i2v
    original = _original(state)
    del original[cut]
    path = _write(original, tmp_path / "cut.safetensors")
    missing = rf"WanTransformer3DModel in file .*: 1 tensor\(s\) missing: '{re.escape(cut)}'\. The file is incomplete"
    with pytest.raises(CheckpointError, match=missing):
        eqxdiff.load(path, config=folder / "transformer")
    if cut == "head.modulation":  # a layout's signature: the pipeline loader says which layout and what it lacks
        with pytest.raises(CheckpointError, match=r"is almost a Wan file \(the 'wan' layout\): it holds "
                                                  r"'patch_embedding\.weight' but lacks 'head\.modulation', so the "
                                                  r"file is incomplete or damaged; download it again"):
            eqxdiff.load_pipeline(path, config=folder)
    else:
        with pytest.raises(CheckpointError, match=rf"1 tensor\(s\) missing: '{re.escape(cut)}'"):
            eqxdiff.load_pipeline(path, config=folder)
        # a whole file with the config of another Wan model (text-to-video: no added k/v) says so, not 'rules'
        t2v = {k: v for k, v in json.loads((folder / "transformer" / "config.json").read_text()).items()
               if k not in ("added_kv_proj_dim", "image_dim")}
        with pytest.raises(CheckpointError, match=r"unexpected tensor.*add_k_proj.*original names, but its tensors "
                                                  r"are not those of the config passed: pass config="):
            eqxdiff.load(_write(_original(state), tmp_path / "whole.safetensors"), config=t2v)


def test_a_config_of_other_widths_names_the_files_tensors(i2v, tmp_path):
    """A whole file read with the config of another size (here another feed-forward width) names the tensors of
    another shape in the file's own names, a few of them, with the fix (it used to name them in diffusers' names,
    one clause per tensor, from the model's fill)."""
    folder, state = i2v
    path = _write(_original(state), tmp_path / "whole.safetensors")
    config = {**json.loads((folder / "transformer" / "config.json").read_text()), "ffn_dim": 8}
    with pytest.raises(CheckpointError, match=r"WanTransformer3DModel in file .*: 6 tensor\(s\) of another shape: .*"
                                              r"'blocks\.0\.ffn\.0\.weight' is \(32, 24\), the config gives "
                                              r"\(8, 24\).* and 2 more\. .*pass config= the config of the model it "
                                              r"holds$") as info:
        eqxdiff.load(path, config=config)
    assert "ffn.net" not in str(info.value)


def test_a_scaled_float8_file_is_refused_by_name(i2v, tmp_path):
    """ComfyUI's *_fp8_scaled files store each float8 weight divided by a per-layer scale_weight (and a scaled_fp8
    marker): read without the scales the weights would be wrong (diffusers' from_single_file drops them with a
    warning), so eqxdiff refuses the file and says what it is and what to load instead. A plain float8_e4m3fn file
    is cast, as diffusers casts it."""
    import ml_dtypes

    folder, state = i2v
    original = _original(state, formats.WAN_DIFFUSION_MODEL)
    plain = {k: v.astype(ml_dtypes.float8_e4m3fn) if v.ndim == 2 else v for k, v in original.items()}
    got = state_dict(eqxdiff.load(_write(plain, tmp_path / "fp8.safetensors"), config=folder / "transformer"))
    name = "blocks.0.attn1.to_q.weight"
    np.testing.assert_array_equal(got[name], state[name].astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    scaled = {**plain, formats.WAN_DIFFUSION_MODEL + "scaled_fp8": np.zeros((0,), ml_dtypes.float8_e4m3fn),
              formats.WAN_DIFFUSION_MODEL + "blocks.0.self_attn.q.scale_weight": np.ones((1,), np.float32)}
    refused = r"is a ComfyUI scaled float8 file .*'model.diffusion_model.blocks.0.self_attn.q.scale_weight'.*" \
              r"load a bfloat16 / float16 release"
    with pytest.raises(CheckpointError, match=refused):
        eqxdiff.load(_write(scaled, tmp_path / "fp8_scaled.safetensors"), config=folder / "transformer")
    # a Flux file's fused qkv scale used to fail its Split rule ('1 along axis 0 does not cut into 3 equal parts')
    from . import _tiny_flux

    flux = _tiny_flux.build_transformer(_tiny_flux.TRANSFORMER)
    flux.save_pretrained(tmp_path / "flux")
    bfl = {**_tiny_flux.bfl_tensors(flux), "double_blocks.0.img_attn.qkv.scale_weight": np.ones((1,), np.float32)}
    with pytest.raises(CheckpointError, match=r"is a ComfyUI scaled float8 file .*img_attn\.qkv\.scale_weight"):
        eqxdiff.load(_write(bfl, tmp_path / "flux_fp8_scaled.safetensors"), config=tmp_path / "flux")


def test_another_familys_config_is_named(i2v, tmp_path):
    """A Wan file with config= another family's model (an LTX-Video transformer's or VAE's config, alone or in a
    folder) says which layout and model the file holds and what config= to pass, instead of listing every tensor
    the other model lacks (eqxdiff.load) or failing on a config value of the other family (load_pipeline). A path
    with config= that is no file says so."""
    folder, state = i2v
    path = _write(_original(state, formats.WAN_DIFFUSION_MODEL), tmp_path / "wan.safetensors")
    ltx = {"_class_name": "LTXVideoTransformer3DModel", "in_channels": 8, "num_attention_heads": 2,
           "attention_head_dim": 8, "cross_attention_dim": 16, "num_layers": 1, "caption_channels": 16}
    with pytest.raises(CheckpointError, match=r"is a Wan file \(the 'wan_comfyui' layout, holding the transformer "
                                              r"\(WanTransformer3DModel\)\), not a LTXVideoTransformer3DModel .*pass "
                                              r"config= the config of the model it holds"):
        eqxdiff.load(path, config=ltx)
    other = tmp_path / "ltx_folder"
    (other / "transformer").mkdir(parents=True)
    (other / "model_index.json").write_text(json.dumps({"_class_name": "LTXPipeline"}))
    (other / "transformer" / "config.json").write_text(json.dumps(ltx))
    with pytest.raises(CheckpointError, match=r"describes a LTXVideoTransformer3DModel as its transformer, but the "
                                              r"file is a Wan file .*whose transformer is a WanTransformer3DModel; "
                                              r"pass config= a diffusers Wan folder"):
        eqxdiff.load_pipeline(path, config=other)
    vae = _write(convert_tensors(state_dict(eqxdiff.load(folder, "vae")), inverse(formats.wan_vae(num_res_blocks=1))),
                 tmp_path / "wan_vae.safetensors")
    ltx_vae = {"_class_name": "AutoencoderKLLTXVideo", "latent_channels": 8, "block_out_channels": [8, 16, 32, 32],
               "decoder_block_out_channels": [8, 16, 32, 32], "layers_per_block": [1, 1, 1, 1, 1],
               "decoder_layers_per_block": [1, 1, 1, 1, 1], "patch_size": 2}
    with pytest.raises(CheckpointError, match=r"is a Wan file \(the 'wan_vae' layout.* not a AutoencoderKLLTXVideo"):
        eqxdiff.load(vae, config=ltx_vae)
    with pytest.raises(CheckpointError, match=r"no file .*typo\.safetensors'; check its path"):
        eqxdiff.load_pipeline(tmp_path / "typo.safetensors", config=folder)


@pytest.mark.parametrize("release, hub_id", [
    ("WAN21_T2V_1_3B", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"), ("WAN21_T2V_14B", "Wan-AI/Wan2.1-T2V-14B-Diffusers"),
    ("WAN21_I2V_14B", "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"),
    ("WAN21_FLF2V_14B", "Wan-AI/Wan2.1-FLF2V-14B-720P-Diffusers"),
    ("WAN22_TI2V_5B", "Wan-AI/Wan2.2-TI2V-5B-Diffusers"), ("WAN21_VAE", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"),
    ("WAN22_VAE", "Wan-AI/Wan2.2-TI2V-5B-Diffusers")])
def test_released_files_suggest_their_own_hub_folder(release, hub_id):
    """A released model's original file (on the meta device: names and shapes; bare and below ComfyUI's prefix) is
    told apart by its tensors, so the config= eqxdiff's messages suggest is its own Hub folder (they used to suggest
    the 1.3B text-to-video folder for every file; diffusers' from_single_file fetches that, 14B T2V or 14B I2V, by
    width). Which layout reads the file changes nothing else: every release's part is the same."""
    from eqxdiff.core import single_file_layouts
    from eqxdiff.loading.single_file import Shapes, detect_in

    config = getattr(tiny, release)
    vae = release.endswith("VAE")
    with torch.device("meta"):
        model = (diffusers.AutoencoderKLWan if vae else diffusers.WanTransformer3DModel)(**config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    rules = formats.wan_vae(residual=bool(config.get("is_residual"))) if vae else formats.wan_transformer()
    for prefix in ("",) if vae else ("", formats.WAN_DIFFUSION_MODEL):
        view = convert(Shapes(shapes), inverse(rules))
        file = Shapes({prefix + n: tuple(view.shape(n)) for n in view.names()})
        assert detect_in(file, "file", single_file_layouts()).hub_id == hub_id, prefix


# -- Wan 2.2 A14B's two expert files ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def a14b(tmp_path_factory):
    """A tiny Wan 2.2 A14B folder and two expert files (ComfyUI's names) of other random weights than its own."""
    folder = tmp_path_factory.mktemp("wan_a14b")
    tiny.build_a14b(folder, seed=3)
    files, states = {}, {}
    for name, seed in (("high", 21), ("low", 22)):
        states[name] = _torch_state(tiny.build_transformer(tiny.T2V_PIPELINE, seed=seed))
        files[name] = _write(_original(states[name], formats.WAN_DIFFUSION_MODEL), folder / f"{name}.safetensors")
    return folder, files, states


def test_expert_files_fill_the_components_named(a14b):
    """load_pipeline({component: file}, config=folder) puts each expert file where the mapping says (both files,
    or the low-noise one alone with the high-noise expert from the folder), each checked as a lone file is; a lone
    expert file fills the transformer and says so (it used to be read as the high-noise expert without a word)."""
    import warnings

    folder, files, states = a14b
    pipe = eqxdiff.load_pipeline({"transformer": files["high"], "transformer_2": files["low"]}, config=folder)
    _assert_weights(pipe.transformer, states["high"], "high-noise file")
    _assert_weights(pipe.transformer_2, states["low"], "low-noise file")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the mapping is explicit: no warning
        pipe = eqxdiff.load_pipeline({"transformer_2": files["low"]}, config=folder)
    _assert_weights(pipe.transformer_2, states["low"], "low-noise file alone")
    _assert_weights(pipe.transformer, state_dict(eqxdiff.load(folder, "transformer")), "the folder's high-noise")
    said = (r"holds one WanTransformer3DModel, read as the transformer; config=.* lists transformer_2 of the same "
            r"class, read from it\. .*eqxdiff\.load_pipeline\(\{'transformer_2': .*low\.safetensors'\}, config=")
    with pytest.warns(InputWarning, match=said):
        pipe = eqxdiff.load_pipeline(files["low"], config=folder)
    _assert_weights(pipe.transformer, states["low"], "lone file")
    cut = {k: v for k, v in _original(states["low"], formats.WAN_DIFFUSION_MODEL).items() if "blocks.1.ffn.2" not in k}
    with pytest.raises(CheckpointError, match=r"cut\.safetensors.*missing: 'model\.diffusion_model\.blocks\.1\.ffn"):
        eqxdiff.load_pipeline({"transformer": files["high"], "transformer_2": _write(cut, folder / "cut.safetensors")},
                              config=folder)


def test_bad_expert_mappings_say_the_fix(a14b, i2v, tmp_path):
    """A mapping naming no model component, a component the file cannot be (a transformer file as the VAE), one
    the folder does not list (a Wan 2.1 folder has no transformer_2), a missing file or no mapping form: one line
    naming the fix; so do files of two families."""
    folder, files, _ = a14b
    for mapping, message in [
        ({"transformer_3": files["low"]}, r"WanPipeline has no model component 'transformer_3'; name one of \["),
        ({"tokenizer": files["low"]}, r"has no model component 'tokenizer'"),
        ({"vae": files["low"]}, r"holds a WanTransformer3DModel .*cannot be the vae of a WanPipeline \(a "
                                r"AutoencoderKLWan\); map the file to 'transformer' or 'transformer_2'$"),
        ({"transformer_2": tmp_path / "typo.safetensors"}, r"no file .*typo\.safetensors'; check its path"),
        ({}, r"a mapping of single files is \{component name: \.safetensors file\}"),
    ]:
        with pytest.raises(CheckpointError, match=message) as info:
            eqxdiff.load_pipeline(mapping, config=folder)
        assert "\n" not in str(info.value)
    from . import _tiny_flux

    flux = _tiny_flux.bfl_tensors(_tiny_flux.build_transformer(_tiny_flux.TRANSFORMER))
    flux = _write(flux, tmp_path / "f.safetensors")
    with pytest.raises(CheckpointError, match=r"^the mapping \{'transformer': .*high\.safetensors', 'transformer_2': "
                                              r".*f\.safetensors'\} holds files of Flux and Wan models, not of one "
                                              r"pipeline; map files of one model family$"):
        eqxdiff.load_pipeline({"transformer": files["high"], "transformer_2": flux}, config=folder)
    with pytest.raises(CheckpointError, match=r"lists no transformer_2 \(model_index\.json\).*pass config= a folder "
                                              r"of a pipeline with a transformer_2"):
        eqxdiff.load_pipeline({"transformer_2": files["low"]}, config=i2v[0])


def test_generate_loads_the_expert_files(a14b, i2v, tmp_path):
    """eqxdiff-generate --model high --component transformer_2=low --config folder loads the mapping
    load_pipeline's test above proves (checked before loading); the flag without --config, in the wrong form, twice,
    naming --model's own component, a component the pipeline lacks or one --config does not list is one line naming
    the fix, before anything loads."""
    from eqxdiff.cli import generate
    from eqxdiff.cli._generate_flags import model_files

    folder, files, _ = a14b
    base = ["--model", str(files["high"]), "--prompt", "a fox", "--output-dir", str(tmp_path)]
    checked = generate.validate([*base, "--config", str(folder), "--component", f"transformer_2={files['low']}"])
    assert model_files(checked.args.run) == {"transformer": str(files["high"]), "transformer_2": str(files["low"])}
    for flags, message in [
        (["--component", f"transformer_2={files['low']}"], r"^--component goes with .* give both"),
        (["--config", str(folder), "--component", "transformer_2"], r"must be COMPONENT=FILE"),
        (["--config", str(folder), "--component", "transformer_2=a", "--component", "transformer_2=b"], "twice"),
        (["--config", str(folder), "--component", f"transformer={files['low']}"],
         r"^--component transformer=\.\.\. names the component --model's file fills"),
        (["--config", str(folder), "--component", f"transformer_3={files['low']}"],  # was refused once loading
         r"^--component transformer_3=FILE: a WanPipeline has no model component 'transformer_3'; name one of \["),
        (["--config", str(i2v[0]), "--component", f"transformer_2={files['low']}"],
         r"^--component transformer_2=FILE: --config .* lists no transformer_2 \(model_index\.json\).*pass --config "
         r"a folder of a pipeline with a transformer_2"),
    ]:
        with pytest.raises(InputError, match=message):
            generate.validate([*base, *flags])
