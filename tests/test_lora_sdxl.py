"""LoRA files on SDXL, fused, end to end (<= 2/255 per pixel; fused models share the plain pipeline's program):
kohya's SGM-named UNet (``lora_unet_input_blocks_4_1_...``, as kohya trains SDXL) against diffusers, which maps SGM
blocks itself (``_maybe_map_sgm_blocks_to_diffusers``); both text encoders in PEFT names against diffusers and in
kohya's ``lora_te1_`` / ``lora_te2_`` against LyCORIS' reader (diffusers 0.42 cannot read kohya text encoders under
transformers 5). The SGM names of the tiny UNet come from eqxdiff's single-file rules, which tests/test_single_file.py
checks against diffusers' own converter; the proof here is that diffusers puts the file's adapters where eqxdiff does.
"""

import numpy as np
import pytest
import torch

import eqxdiff
from eqxdiff.loading import convert_tensors, inverse
from eqxdiff.loading.single_file import ldm_unet

from . import _lora_files as files
from . import _tiny_sdxl as tiny
from ._util import nhwc_to_nchw
from .test_lora_sd import _close, _moved
from .test_recompile import no_compile

CALL = dict(prompt="a red cat", negative_prompt="blurry", height=32, width=32, num_inference_steps=3,
            guidance_scale=5.0)
LATENTS = np.random.default_rng(1).standard_normal((1, 16, 16, 4)).astype(np.float32)
UNET = r"(attn[12]\.to_(q|k|v|out\.0)|ff\.net\.(0\.proj|2)|proj_(in|out)|resnets\.\d\.(conv[12]|time_emb_proj))$"
TEXT = r"self_attn\.(q|k|v|out)_proj$|mlp\.fc[12]$"


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sdxl")
    ref = tiny.build_base(folder)
    pipe = eqxdiff.load_pipeline(folder)
    return ref, pipe, _ours(pipe), tmp_path_factory.mktemp("sdxl_loras")


def _ours(pipe) -> np.ndarray:
    return np.asarray(pipe(**CALL, latents=LATENTS, progress=False))


def _theirs(ref) -> np.ndarray:
    with torch.no_grad():
        return ref(**CALL, latents=nhwc_to_nchw(LATENTS), output_type="np").images


def sgm_names(pipe, ref) -> dict[str, str]:
    """diffusers module name -> SGM module name, by eqxdiff's single-file rules (inverse of ``ldm_unet``)."""
    state = ref.unet.state_dict()
    tagged = {k: np.full(tuple(v.shape), i, np.float32) for i, (k, v) in enumerate(state.items())}
    names = list(state)
    sgm = convert_tensors(tagged, inverse(ldm_unet(pipe.unet.config, prefix="")))
    out = {}
    for k, v in sgm.items():
        if k.endswith(".weight"):
            out[names[int(v.flat[0])][:-len(".weight")]] = k[:-len(".weight")]
    return out


def _fused(pipe, path):
    pipe.load_lora_weights(path)
    try:
        pipe.fuse_lora()
        with no_compile("a fused SDXL LoRA"):
            return _ours(pipe)
    finally:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()


def _diffusers(ref, path):
    ref.load_lora_weights(str(path))
    try:
        ref.fuse_lora()
        return _theirs(ref)
    finally:
        ref.unfuse_lora()
        ref.unload_lora_weights()


def text(ref, which: str, pattern: str = TEXT) -> dict:
    return files.modules(files.checkpoint_named(getattr(ref, which)), pattern)


def test_kohya_sgm_unet(sdxl):
    ref, pipe, base, folder = sdxl
    rename = sgm_names(pipe, ref)
    mods = {rename[n]: m for n, m in files.modules(ref.unet, UNET).items()}
    assert any(n.startswith("input_blocks.3.1.transformer_blocks.1.") for n in mods)  # SGM names, depth 2
    path = files.save(files.kohya(mods, "lora_unet_", files.Rand(40), rank=4, alpha=3.0), folder / "sgm.safetensors")
    assert eqxdiff.lora.inspect(path, pipe).supported
    got = _fused(pipe, path)
    _close(got, _diffusers(ref, path), "kohya SGM UNet")
    _moved(got, base, "kohya SGM UNet")


def test_text_encoders(sdxl):
    ref, pipe, base, folder = sdxl
    rand = files.Rand(41)
    peft = files.save({**files.peft(text(ref, "text_encoder"), "text_encoder.", rand, rank=4),
                       **files.peft(text(ref, "text_encoder_2"), "text_encoder_2.", rand, rank=2)},
                      folder / "te_peft.safetensors")
    got = _fused(pipe, peft)
    _close(got, _diffusers(ref, peft), "PEFT text encoders")
    _moved(got, base, "PEFT text encoders")
    kohya = files.save({**files.kohya(text(ref, "text_encoder"), "lora_te1_", rand, rank=4, alpha=2.0),
                        **files.kohya(text(ref, "text_encoder_2"), "lora_te2_", rand, rank=2, alpha=4.0)},
                       folder / "te_kohya.safetensors")
    got = _fused(pipe, kohya)
    with files.lycoris_applied(kohya, {"lora_te1": files.checkpoint_named(ref.text_encoder),
                                       "lora_te2": files.checkpoint_named(ref.text_encoder_2)}):
        expected = _theirs(ref)
    _close(got, expected, "kohya text encoders")
    _moved(got, base, "kohya text encoders")
