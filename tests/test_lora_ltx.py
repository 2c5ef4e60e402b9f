"""LoRA files on LTX-Video (``eqxdiff.pipelines._lora_ltx.LTX``), at the tiny pipeline config, compared in weight
space (no compile): each file loaded and fused gives the transformer diffusers' ``LTXPipeline.load_lora_weights`` +
``fuse_lora`` gives (every weight <= 1e-4), and unloading gives back the weights bit for bit.

- diffusers / PEFT: a ``peft.LoraConfig`` with ``use_rslora``, ``rank_pattern`` / ``alpha_pattern`` and DoRA on the
  attention, saved by ``LTXPipeline.save_lora_weights`` (the alphas in its metadata);
- LTX-Video-Trainer / ComfyUI: ``diffusion_model.`` + diffusers' names (read by diffusers'
  ``_convert_non_diffusers_ltxv_lora_to_diffusers``), and + the original names (``patchify_proj``, ``adaln_single``)
  with ``lora_down`` / ``lora_up`` / ``.alpha``, against the PEFT file of the same tensors.
"""

import diffusers
import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model_state_dict

import eqxdiff
from eqxdiff.loading import CheckpointError, state_dict
from eqxdiff.pipelines._lora_format import detect_family

from . import _lora_files as files
from . import _tiny_ltx as tiny
from ._util import rel_error

ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
# the attention, the feed-forward, the patch embedding, the timestep embedder and the caption projection
MODULES = r"(attn[12]\.(to_[qkv]|to_out\.0)|ff\.net\.(0\.proj|2)|^proj_in|time_embed\.(linear|emb\.timestep_embedder" \
          r"\.linear_1)|caption_projection\.linear_2)$"


@pytest.fixture(scope="module")
def ltx(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ltx")
    ref = tiny.build_pipeline(folder / "pipe")
    return ref, eqxdiff.load_pipeline(folder / "pipe"), folder


def _weights(transformer) -> dict[str, np.ndarray]:
    """diffusers' transformer weights (copies: unfusing changes them in place), adapter layers' base weights under
    their own names."""
    return {k.replace(".base_layer", ""): v.detach().numpy().copy() for k, v in transformer.state_dict().items()
            if "lora_" not in k}


def _diffusers_fused(ref, path) -> dict[str, np.ndarray]:
    ref.load_lora_weights(str(path))
    try:
        ref.fuse_lora()
        return _weights(ref.transformer)
    finally:
        ref.unfuse_lora()
        ref.unload_lora_weights()


def _check(pipe, path, expected: dict, what: str, layers: int) -> None:
    """Our fused transformer equals ``expected`` weight for weight, its ``layers`` adapted weights moved; unloading
    restores it exactly."""
    before = state_dict(pipe.transformer)
    pipe.load_lora_weights(path)
    try:
        pipe.fuse_lora()
        ours = state_dict(pipe.transformer)
    finally:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()
    assert set(ours) == set(expected)
    bad = {k: rel_error(ours[k], expected[k]) for k in ours if rel_error(ours[k], expected[k]) > 1e-4}
    assert not bad, f"{what}: fused weights differ from diffusers': {bad}"
    moved = [k for k in ours if not np.allclose(ours[k], before[k])]
    assert len(moved) == layers, f"{what}: {moved} changed"
    after = state_dict(pipe.transformer)
    assert all(np.array_equal(after[k], before[k]) for k in before), f"{what}: unloading changed the weights"


def test_peft_config_file(ltx):
    """rsLoRA, rank / alpha patterns and DoRA on the attention, saved by diffusers: as diffusers fuses it."""
    ref, pipe, folder = ltx
    model = diffusers.LTXVideoTransformer3DModel.from_config(ref.transformer.config)
    model.load_state_dict(ref.transformer.state_dict())
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=6, use_rslora=True, use_dora=True, init_lora_weights=False,
                        target_modules=ATTENTION + ["ff.net.0.proj", "proj_in", "time_embed.linear"],
                        rank_pattern={"transformer_blocks.0.attn1.to_q": 8, "ff.net.0.proj": 2},
                        alpha_pattern={"transformer_blocks.1.attn2.to_k": 16, "proj_in": 1})
    model.add_adapter(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.3 / p.shape[-1] ** 0.5)
            if "lora_magnitude" in name:
                p.mul_(1 + 0.2 * torch.randn_like(p))
    diffusers.LTXPipeline.save_lora_weights(str(folder / "peft"), transformer_lora_layers=get_peft_model_state_dict(
        model), transformer_lora_adapter_metadata=config.to_dict())
    path = folder / "peft" / "pytorch_lora_weights.safetensors"
    _check(pipe, path, _diffusers_fused(ref, path), "PEFT LoraConfig", layers=2 + 2 * 9)


def test_trainer_and_original_names(ltx):
    """``diffusion_model.`` files, in diffusers' names (as diffusers reads them) and in the original ones with kohya
    roles and alphas: the same fused weights as the PEFT file of the same tensors."""
    ref, pipe, folder = ltx
    mods = files.modules(ref.transformer, MODULES)
    peft = files.peft(mods, "transformer.", files.Rand(1), rank=4)
    assert detect_family(peft)[0] == "LTX-Video"
    expected = _diffusers_fused(ref, files.save(peft, folder / "peft.safetensors"))
    trainer = {k.replace("transformer.", "diffusion_model.", 1): v for k, v in peft.items()}
    trainer_path = files.save(trainer, folder / "trainer.safetensors")
    assert all(rel_error(v, expected[k]) <= 1e-6 for k, v in _diffusers_fused(ref, trainer_path).items())
    _check(pipe, trainer_path, expected, "diffusion_model. + diffusers names", len(mods))
    original = {}
    for key, v in trainer.items():
        key = key.replace(".proj_in.", ".patchify_proj.").replace(".time_embed.", ".adaln_single.")
        original[key.replace("lora_A", "lora_down").replace("lora_B", "lora_up")] = v
        if ".lora_A." in key:
            original[key.replace("lora_A.weight", "alpha")] = torch.tensor(4.0)  # = the rank: scale 1, as PEFT's
    assert "diffusion_model.adaln_single.linear.lora_down.weight" in original
    _check(pipe, files.save(original, folder / "original.safetensors"), expected, "original names", len(mods))


def test_errors(ltx):
    """A key this model lacks is listed with the fix; a Wan file is named as one."""
    ref, pipe, folder = ltx
    peft = files.peft(files.modules(ref.transformer, r"attn1\.to_q$"), "transformer.", files.Rand(2), rank=2)
    peft.update({"transformer.transformer_blocks.9.attn1.to_q.lora_A.weight": torch.ones(2, 32),
                 "transformer.transformer_blocks.9.attn1.to_q.lora_B.weight": torch.ones(32, 2)})
    with pytest.raises(CheckpointError,
                       match=r"2 of the .* adapt nothing .*transformer_blocks\.9\.attn1.*strict=False"):
        pipe.load_lora_weights(files.save(peft, folder / "extra.safetensors"))
    wan = {f"diffusion_model.blocks.{i}.self_attn.q.lora_{r}.weight": torch.ones(2, 2) for i in range(2)
           for r in ("down", "up")}
    with pytest.raises(CheckpointError, match=r"is a LoRA for Wan .*not for LTX-Video"):
        pipe.load_lora_weights(files.save(wan, folder / "wan.safetensors"))
