"""LoRA files on Wan 2.1 / 2.2 (``eqxdiff.pipelines._lora_wan.WAN``), each a random file (every tensor random and
non-zero) at the tiny pipeline configs, compared on the transformer (<= 1e-4, the plain call and the cached
cross-attention keys/values path) with diffusers' ``WanPipeline.load_lora_weights``, unfused and fused; each file
switched off and on unfused, a strength and a hotswap compile nothing (``no_compile``):

- diffusers / PEFT (``transformer.``);
- the original names (ComfyUI / diffusion-pipe: ``diffusion_model.blocks.N.self_attn.q.lora_down.weight``, ``.alpha``;
  ai-toolkit-style ``lora_A`` / ``lora_B``), read by diffusers' ``_convert_non_diffusers_wan_lora_to_diffusers``;
- musubi-tuner (``lora_unet_blocks_N_...``), read by its ``_convert_musubi_wan_lora_to_diffusers``;
- lightx2v's distillation files (LoRA pairs with ``diff_b``, ``head.head.diff``, the norms' ``diff`` / ``diff_b`` and
  the modulation tables' ``diff_m``): diffusers reads the pairs, the biases and ``head.head.diff`` and drops the rest,
  which the reference adds by lightx2v's own formula (``tools/extract/lora_merger.py`` in ModelTC/LightX2V: ``W +
  alpha * diff``, ``X.diff_m`` -> ``X.modulation``), in torch, on diffusers' weights;
- a text-to-video file in an image-to-video model (diffusers pads the added k/v with zero LoRAs:
  ``_maybe_expand_t2v_lora_for_i2v``), and an image-to-video file with ``k_img`` / ``v_img`` and ``img_emb``.

Names go through diffusers' own converters in the references; the original module names come from diffusers'
``convert_wan_transformer_to_diffusers`` too (``_original_names``), not from eqxdiff's rules.
"""

import copy

import diffusers
import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

import eqxdiff
from eqxdiff.loading import CheckpointError, convert_tensors, formats, inverse
from eqxdiff.pipelines._lora_format import detect_family

from . import _lora_files as files
from . import _tiny_wan as tiny
from ._util import assert_close, nchw_to_nhwc, nhwc_to_nchw, rel_error
from .test_recompile import no_compile

BLOCKS = r"^blocks\.\d+\.(attn[12]\.(to_[qkv]|to_out\.0)|ffn\.net\.(0\.proj|2))$"
EMBEDDERS = r"^condition_embedder\.(time_embedder\.linear_[12]|text_embedder\.linear_[12]|time_proj)$"
IMAGE = r"^(blocks\.\d+\.attn2\.add_[kv]_proj|condition_embedder\.image_embedder\.ff\.net\.(0\.proj|2))$"


def _build(folder, transformer_config, seed):
    ref = tiny.save(diffusers.WanPipeline(**tiny.text_components(seed), vae=tiny.vae(tiny.VAE_21, seed + 5),
                                          scheduler=tiny.scheduler(),
                                          transformer=tiny.build_transformer(transformer_config, seed=seed + 7)),
                    folder)
    return ref, eqxdiff.load_pipeline(folder)


class Case:
    """A diffusers pipeline and ours from one folder, the transformer's inputs and its outputs without adapters."""

    def __init__(self, folder, config, seed, text=6, image=None):
        self.ref, self.pipe = _build(folder, config, seed)
        rng = np.random.default_rng(seed)
        c = self.ref.transformer.config
        self.inputs = dict(x=rng.standard_normal((1, 2, 4, 4, c.in_channels)).astype(np.float32),
                           t=np.array([700.0], np.float32),
                           text=rng.standard_normal((1, text, c.text_dim)).astype(np.float32),
                           image=None if image is None else rng.standard_normal((1, image, c.image_dim)
                                                                                ).astype(np.float32))
        self.base = self.theirs()
        assert_close(self.ours()[0], self.base, what="the transformer without adapters")  # compiles the plain model
        self.names = _original_names(self.ref.transformer)

    def theirs(self, transformer=None) -> np.ndarray:
        i = self.inputs
        image = None if i["image"] is None else torch.from_numpy(i["image"])
        with torch.no_grad():
            out = (transformer or self.ref.transformer)(
                hidden_states=nhwc_to_nchw(i["x"]), timestep=torch.from_numpy(i["t"]),
                encoder_hidden_states=torch.from_numpy(i["text"]), encoder_hidden_states_image=image).sample
        return np.asarray(nchw_to_nhwc(out))

    def ours(self, transformer=None) -> tuple:
        i = self.inputs
        return _forward(transformer or self.pipe.transformer, *(jnp.asarray(v) if v is not None else None
                                                                 for v in (i["x"], i["t"], i["text"], i["image"])))

    def check(self, theirs: np.ndarray, what: str) -> None:
        """Our transformer (plain and with cached keys/values) equals ``theirs`` and moved from the base."""
        plain, cached = self.ours()
        assert_close(plain, theirs, what=f"{what} (plain call)")
        assert_close(cached, theirs, what=f"{what} (cached cross-attention keys/values)")
        assert rel_error(plain, self.base) > 1e-2, f"{what}: the adapter did not move the output"

    def switch(self, unfused: np.ndarray, what: str) -> None:
        """Unfused adapters (LoRA pairs and whole differences alike: norms, modulation tables) switched off and on
        again compile nothing: off gives the output without adapters, on the adapted one again."""
        self.pipe.disable_lora()
        with no_compile(f"{what} disabled"):
            plain, cached = self.ours()
        assert_close(plain, self.base, what=f"{what} disabled (plain call)")
        assert_close(cached, self.base, what=f"{what} disabled (cached cross-attention keys/values)")
        self.pipe.enable_lora()
        with no_compile(f"{what} enabled again"):
            self.check(unfused, f"{what} enabled again")

    def diffusers_outputs(self, path, **modified) -> tuple[np.ndarray, np.ndarray]:
        """diffusers' transformer with the file loaded: ``(unfused, fused)``; ``modified`` (name -> change) added to
        its weights first (what diffusers drops, by the format's formula)."""
        original = self.ref.transformer
        self.ref.transformer = _changed(original, modified) if modified else original
        try:
            self.ref.load_lora_weights(str(path))
            unfused = self.theirs()
            self.ref.fuse_lora()
            fused = self.theirs()
        finally:
            self.ref.unfuse_lora()
            self.ref.unload_lora_weights()
            self.ref.transformer = original
        return unfused, fused

    def against_diffusers(self, path, what: str, **modified) -> None:
        unfused, fused = self.diffusers_outputs(path, **modified)
        self.pipe.load_lora_weights(path)
        try:
            self.check(unfused, f"{what} unfused")
            self.switch(unfused, what)
            self.pipe.fuse_lora()
            with no_compile(f"{what} fused"):
                self.check(fused, f"{what} fused")
        finally:
            self.pipe.unfuse_lora()
            self.pipe.unload_lora_weights()


@eqx.filter_jit
def _forward(model, x, t, text, image):
    return model(x, t, text, image), model(x, t, cross_kv=model.cross_attention_kv(text, image))


def _original_names(transformer) -> dict[str, str]:
    """diffusers parameter name -> its original Wan name, by diffusers' own single-file converter (the candidates
    from eqxdiff's inverse rules, each confirmed by the converter)."""
    state = {k: v.numpy() for k, v in transformer.state_dict().items()}
    out = {}
    for original in convert_tensors(state, inverse(formats.wan_transformer())):
        (name,) = convert_wan_transformer_to_diffusers({original: torch.zeros(1)})
        out[name] = original
    assert set(out) == set(state)
    return out


def _module(names: dict, module: str) -> str:
    """The original module name of diffusers' ``module`` (a Linear or a norm)."""
    return names[module + ".weight"][: -len(".weight")]


def _changed(model, changes: dict):
    """A copy of ``model`` with ``changes`` (parameter name -> difference) added."""
    model = copy.deepcopy(model)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, change in changes.items():
            params[name] += change.reshape(params[name].shape)
    return model


def _kohya_pairs(case, mods: dict, prefix: str, rand, *, rank=4, alpha=2.0, dotted=True, roles=("lora_down",
                 "lora_up")) -> dict:
    """``lora_down`` / ``lora_up`` (or ``lora_A`` / ``lora_B``) under the original module names, with ``.alpha`` on
    the blocks' layers (diffusers' converter reads alphas there only: elsewhere it refuses them)."""
    out = {}
    for name, m in mods.items():
        key = prefix + (_module(case.names, name) if dotted else _module(case.names, name).replace(".", "_"))
        out[f"{key}.{roles[0]}.weight"] = rand.down(rank, m)
        out[f"{key}.{roles[1]}.weight"] = rand.up(rank, m)
        if alpha is not None and name.startswith("blocks."):
            out[f"{key}.alpha"] = torch.tensor(alpha)
    return out


@pytest.fixture(scope="module")
def t2v(tmp_path_factory):
    return Case(tmp_path_factory.mktemp("wan_t2v"), tiny.T2V_PIPELINE, seed=0), tmp_path_factory.mktemp("loras")


@pytest.fixture(scope="module")
def i2v(tmp_path_factory):
    # diffusers' added k/v attention takes the last 512 context tokens as the text
    case = Case(tmp_path_factory.mktemp("wan_i2v"), tiny.I2V_PIPELINE, seed=1, text=512, image=5)
    return case, tmp_path_factory.mktemp("loras_i2v")


# -- diffusers / PEFT, original names, musubi: against diffusers --------------------------------------------------


def test_peft_unfused_fused_strength_and_hotswap(t2v):
    """diffusers/PEFT names on the blocks and the condition embedder: unfused and fused as diffusers; a strength of
    0.5 and a hotswap of another file of the same targets (the original names, ranks padded under max_rank)
    compile nothing and equal diffusers with the same."""
    case, folder = t2v
    rand = files.Rand(10)
    mods = {**files.modules(case.ref.transformer, BLOCKS), **files.modules(case.ref.transformer, EMBEDDERS)}
    path = files.save(files.peft(mods, "transformer.", rand, rank=4), folder / "peft.safetensors")
    case.against_diffusers(path, "PEFT")

    other = files.save(_kohya_pairs(case, mods, "diffusion_model.", files.Rand(11), rank=3, alpha=1.5),
                       folder / "comfy_rank3.safetensors")
    expected_other, _ = case.diffusers_outputs(other)
    case.ref.load_lora_weights(str(path), adapter_name="p")
    case.ref.set_adapters("p", 0.5)
    half = case.theirs()
    case.ref.unload_lora_weights()
    case.pipe.load_lora_weights(path, adapter_name="p", max_rank=4)
    try:
        case.ours()  # compiles the padded structure once
        case.pipe.set_adapters("p", 0.5)
        with no_compile("a Wan LoRA's strength"):
            case.check(half, "PEFT at strength 0.5")
        case.pipe.set_adapters("p", 1.0)
        case.pipe.load_lora_weights(other, adapter_name="p", hotswap=True)
        with no_compile("a hotswapped Wan LoRA"):
            case.check(expected_other, "original names hotswapped")
    finally:
        case.pipe.unfuse_lora()
        case.pipe.unload_lora_weights()


@pytest.mark.parametrize("style", ["comfyui", "ai-toolkit"])
def test_original_names_match_diffusers(t2v, style):
    """ComfyUI / diffusion-pipe (``diffusion_model.`` + original names, ``lora_down`` / ``lora_up`` / ``.alpha``) and
    the ``lora_A`` / ``lora_B`` form without alphas, on the blocks, the embedders and the output head."""
    case, folder = t2v
    mods = {**files.modules(case.ref.transformer, BLOCKS), **files.modules(case.ref.transformer, EMBEDDERS),
            **files.modules(case.ref.transformer, r"^proj_out$")}
    kwargs = dict(alpha=2.0) if style == "comfyui" else dict(alpha=None, roles=("lora_A", "lora_B"))
    tensors = _kohya_pairs(case, mods, "diffusion_model.", files.Rand(20 + len(style)), **kwargs)
    assert "diffusion_model.blocks.1.cross_attn.o.lora_down.weight" in tensors or style != "comfyui"
    case.against_diffusers(files.save(tensors, folder / f"{style}.safetensors"), style)


def test_musubi_matches_diffusers(t2v):
    """musubi-tuner: ``lora_unet_`` + the original names with underscores, every block's attention and MLP."""
    case, folder = t2v
    tensors = _kohya_pairs(case, files.modules(case.ref.transformer, BLOCKS), "lora_unet_", files.Rand(30), rank=2,
                           alpha=4.0, dotted=False)
    assert "lora_unet_blocks_0_self_attn_q.lora_down.weight" in tensors
    case.against_diffusers(files.save(tensors, folder / "musubi.safetensors"), "musubi")


# -- lightx2v: LoRA pairs with diff, diff_b and diff_m ---------------------------------------------------------------


def _lightx2v(case, rand, *, image: bool) -> tuple[dict, dict]:
    """A lightx2v-style file and the changes diffusers drops (the norms' ``diff`` / ``diff_b``, the modulation
    tables' ``diff_m``, a Linear's whole ``diff``), by diffusers parameter name."""
    t = case.ref.transformer
    pattern = f"{BLOCKS}|{EMBEDDERS}" + (f"|{IMAGE}" if image else "")
    mods = files.modules(t, pattern)
    tensors = _kohya_pairs(case, mods, "diffusion_model.", rand, rank=4, alpha=8.0)
    for name, m in mods.items():  # biases through diff_b (diffusers: lora_B.bias)
        tensors[f"diffusion_model.{_module(case.names, name)}.diff_b"] = rand.vector(m.weight.shape[0])
    head = t.proj_out  # lightx2v's head: a whole difference (diffusers: an identity lora_B)
    tensors["diffusion_model.head.head.diff"] = rand(*head.weight.shape, scale=0.05)
    tensors["diffusion_model.head.head.diff_b"] = rand.vector(head.weight.shape[0])
    dropped = {}
    norms = files.modules(t, r"(norm_[qk]|norm_added_k|norm2|image_embedder\.norm[12])$",
                          kinds=(torch.nn.LayerNorm, torch.nn.RMSNorm, diffusers.models.normalization.RMSNorm,
                                 diffusers.models.normalization.FP32LayerNorm))
    for name, m in norms.items():
        original = f"diffusion_model.{_module(case.names, name)}"
        tensors[f"{original}.diff"] = dropped[f"{name}.weight"] = rand.vector(m.weight.shape[0], 0.1)
        if getattr(m, "bias", None) is not None:
            tensors[f"{original}.diff_b"] = dropped[f"{name}.bias"] = rand.vector(m.weight.shape[0], 0.1)
    for i, block in enumerate(t.blocks):
        tensors[f"diffusion_model.blocks.{i}.diff_m"] = dropped[f"blocks.{i}.scale_shift_table"] = \
            rand(*block.scale_shift_table.shape, scale=0.1)
    tensors["diffusion_model.head.diff_m"] = dropped["scale_shift_table"] = rand(*t.scale_shift_table.shape,
                                                                                 scale=0.1)
    o = t.blocks[0].attn1.to_out[0]  # a whole weight difference on a Linear (diffusers leaves .diff keys out)
    tensors["diffusion_model.blocks.0.self_attn.o.diff"] = dropped["blocks.0.attn1.to_out.0.weight"] = \
        rand(*o.weight.shape, scale=0.05)
    assert len(norms) >= 4 * len(t.blocks)
    return tensors, dropped


@pytest.mark.parametrize("which", ["t2v", "i2v"])
def test_lightx2v_diff_files(which, request):
    """lightx2v's distillation files, text- and image-to-video (``k_img`` / ``v_img``, ``norm_k_img``, ``img_emb``):
    the pairs and biases as diffusers reads them, the rest by lightx2v's formula; unfused and fused. A strength
    scales the differences with the pairs (they sit in the layers' adapter slots)."""
    case, folder = request.getfixturevalue(which)
    tensors, dropped = _lightx2v(case, files.Rand(40), image=which == "i2v")
    if which == "i2v":
        assert "diffusion_model.blocks.1.cross_attn.norm_k_img.diff" in tensors
        assert "diffusion_model.img_emb.proj.3.lora_down.weight" in tensors
    path = files.save(tensors, folder / f"lightx2v_{which}.safetensors")
    case.against_diffusers(path, f"lightx2v {which}", **dropped)


def test_t2v_lora_in_an_i2v_model(i2v):
    """A text-to-video file (no ``k_img``) in the image-to-video model: diffusers expands it with zero LoRAs on the
    added k/v (``_maybe_expand_t2v_lora_for_i2v``); eqxdiff leaves those layers unadapted: the same numbers."""
    case, folder = i2v
    mods = files.modules(case.ref.transformer, BLOCKS)
    tensors = _kohya_pairs(case, mods, "diffusion_model.", files.Rand(50), rank=4)
    assert not any("k_img" in k for k in tensors)
    case.against_diffusers(files.save(tensors, folder / "t2v_in_i2v.safetensors"), "T2V LoRA in I2V")


# -- what a file is, and files for other families ---------------------------------------------------------------------


def test_inspect_and_other_families(t2v):
    case, folder = t2v
    tensors = _kohya_pairs(case, files.modules(case.ref.transformer, BLOCKS), "lora_unet_", files.Rand(60),
                           dotted=False)
    path = files.save(tensors, folder / "musubi_inspect.safetensors")
    report = eqxdiff.lora.inspect(path, case.pipe)
    assert report.family == "Wan" and report.supported
    assert detect_family(tensors)[0] == "Wan"
    flux = {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(2, 4),
            "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.ones(4, 2),
            "transformer.single_transformer_blocks.0.proj_out.lora_A.weight": torch.ones(2, 4),
            "transformer.single_transformer_blocks.0.proj_out.lora_B.weight": torch.ones(4, 2)}
    with pytest.raises(CheckpointError, match=r"is a LoRA for Flux.1 \(keys such as .*\), not for Wan"):
        case.pipe.load_lora_weights(files.save(flux, folder / "flux.safetensors"))
    extra = dict(tensors, **{"diffusion_model.blocks.7.self_attn.q.lora_down.weight": torch.ones(2, 24),
                             "diffusion_model.blocks.7.self_attn.q.lora_up.weight": torch.ones(24, 2)})
    with pytest.raises(CheckpointError, match=r"2 of the .* adapt nothing .*blocks\.7\.self_attn\.q"):
        case.pipe.load_lora_weights(files.save(extra, folder / "extra.safetensors"))
    # diffusers/PEFT names (``transformer.``, as Flux's files have) with a block this model lacks: Wan's keys, not
    # Flux's (the error named Flux.1); it lists the extra keys and the fix
    peft = files.peft(files.modules(case.ref.transformer, BLOCKS), "transformer.", files.Rand(61), rank=2)
    assert detect_family(peft)[0] == "Wan"
    peft.update({"transformer.blocks.7.attn1.to_q.lora_A.weight": torch.ones(2, 24),
                 "transformer.blocks.7.attn1.to_q.lora_B.weight": torch.ones(24, 2)})
    with pytest.raises(CheckpointError, match=r"2 of the .* adapt nothing .*blocks\.7\.attn1\.to_q.*strict=False"):
        case.pipe.load_lora_weights(files.save(peft, folder / "extra_peft.safetensors"))


def test_load_into_transformer_2(t2v, tmp_path):
    """Wan 2.2 A14B: ``load_lora_weights(file, load_into_transformer_2=True)`` adapts the low-noise expert as
    diffusers' keyword does (<= 1e-4 against diffusers' ``transformer_2`` with the same file), and leaves
    ``transformer`` as it was; a pipeline without the second expert refuses the keyword."""
    ref = tiny.build_a14b(tmp_path / "a14b", seed=3)
    pipe = eqxdiff.load_pipeline(tmp_path / "a14b")
    case = t2v[0]
    i = case.inputs
    args = [jnp.asarray(v) for v in (i["x"], i["t"], i["text"])] + [None]
    high, low = _forward(pipe.transformer, *args)[0], _forward(pipe.transformer_2, *args)[0]
    mods = files.modules(ref.transformer_2, BLOCKS)
    path = files.save(files.peft(mods, "transformer.", files.Rand(30), rank=4), tmp_path / "low_noise.safetensors")
    ref.load_lora_weights(str(path), adapter_name="low", load_into_transformer_2=True)
    assert pipe.load_lora_weights(path, adapter_name="low", load_into_transformer_2=True) == "low"
    theirs = case.theirs(ref.transformer_2)
    ours = _forward(pipe.transformer_2, *args)[0]
    assert_close(ours, theirs, what="transformer_2 with load_into_transformer_2")
    assert rel_error(ours, low) > 1e-2, "the adapter did not move transformer_2's output"
    np.testing.assert_array_equal(_forward(pipe.transformer, *args)[0], high)
    assert pipe.get_active_adapters() == ["low"]
    with pytest.raises(ValueError, match="no transformer_2"):
        case.pipe.load_lora_weights(path, load_into_transformer_2=True)
