"""LoRA files on Stable Diffusion, end to end against diffusers (<= 2/255 per pixel, the same latents).

Each format is a random file built here at the tiny pipeline's sizes (every tensor random and non-zero): diffusers /
PEFT (``lora_A``/``lora_B``, ``lora_B.bias``, rank and alpha patterns from the metadata header, text encoder too),
diffusers' legacy ``to_q_lora.down`` names and ``lora.up.bias``, kohya (diffusers-like names, ``alpha``, LoCon
convolutions), PEFT's DoRA,
and a LyCORIS file mixing LoHa (with Tucker cores), LoKr, LoCon with ``lora_mid``, ``dora_scale``, a full
``diff``/``diff_b`` and kohya's ``lora_te_`` (reference: LyCORIS' own reader and modules in diffusers' forward, which
diffusers cannot load; a Tucker LoKr, which LyCORIS' reader mis-ranks, is proven layer by layer in
tests/test_lora_nn.py). Fused formats share the pipeline's compiled program (a fused model has the structure of the
plain one); unfused ones compile once per adapter structure, after which strengths, switches, another file of the
same shapes and a hotswap under ``max_rank`` compile nothing (counted as tests/test_recompile.py counts)."""

import warnings

import jax
import numpy as np
import pytest
import torch

import eqxdiff
from eqxdiff.loading import AdaptersNotSavedWarning, CheckpointError, state_dict
from eqxdiff.pipelines._lora import LoraWarning

from . import _lora_files as files
from . import _tiny_sd
from ._util import nhwc_to_nchw, rel_error
from .test_recompile import no_compile

CALL = dict(prompt="a red cat", negative_prompt="blurry", height=32, width=32, num_inference_steps=3,
            guidance_scale=5.0)
LATENTS = np.random.default_rng(0).standard_normal((1, 16, 16, 4)).astype(np.float32)
UNET = r"(attn[12]\.to_(q|k|v|out\.0)|ff\.net\.(0\.proj|2)|proj_(in|out)|resnets\.\d\.(conv[12]|time_emb_proj))$"
TEXT = r"self_attn\.(q|k|v|out)_proj$|mlp\.fc[12]$"


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sd")
    ref = _tiny_sd.build_pipeline(folder, scheduler="ddim")
    pipe = eqxdiff.load_pipeline(folder)
    base = _ours(pipe)  # compiles the plain pipeline once
    return ref, pipe, base, tmp_path_factory.mktemp("loras")


def _ours(pipe, **extra) -> np.ndarray:
    return np.asarray(pipe(**CALL, latents=LATENTS, progress=False, **extra))


def _theirs(ref, **extra) -> np.ndarray:
    with torch.no_grad():
        return ref(**CALL, latents=nhwc_to_nchw(LATENTS), output_type="np", **extra).images


def text_modules(ref, pattern: str) -> dict:
    """The text encoder's layers by their checkpoint names, the names LoRA files use."""
    return files.modules(files.checkpoint_named(ref.text_encoder), pattern)


def _close(ours: np.ndarray, theirs: np.ndarray, what: str) -> None:
    worst = int(np.max(np.abs(ours.astype(int) - (theirs * 255).round().astype(int))))
    assert worst <= 2, f"{what}: {worst}/255 from diffusers"


def _moved(ours: np.ndarray, base: np.ndarray, what: str) -> None:
    assert np.max(np.abs(ours.astype(int) - base.astype(int))) > 8, f"{what}: the adapter did not move the output"


# -- files -----------------------------------------------------------------------------------------------------------


def peft_file(ref, path, seed=0, ranks=None, bias=True):
    """diffusers/PEFT: UNet and text encoder, ``lora_B.bias`` (PEFT cannot fuse it into the UNet's bias-less
    projections, so the fused test goes without), a rank pattern and an alpha pattern in the metadata."""
    rand = files.Rand(seed)
    ranks = ranks or {"to_k": 2}
    tensors = {**files.peft(files.modules(ref.unet, UNET), "unet.", rand, rank=4, bias=bias, ranks=ranks),
               **files.peft(text_modules(ref, TEXT), "text_encoder.", rand, rank=4, bias=bias)}
    metadata = {"unet.r": 4, "unet.lora_alpha": 8, "unet.rank_pattern": ranks, "unet.alpha_pattern": {"to_v": 3},
                "unet.target_modules": ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "proj_in",
                                        "proj_out", "conv1", "conv2", "time_emb_proj"], "unet.lora_bias": bias,
                "text_encoder.r": 4, "text_encoder.lora_alpha": 2, "text_encoder.lora_bias": bias,
                "text_encoder.target_modules": ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]}
    return files.save(tensors, path, metadata)


def legacy_file(ref, path):
    """diffusers' attention-processor names: ``unet.<...>.processor.to_q_lora.down.weight``, text encoder
    ``lora_linear_layer``."""
    rand, tensors = files.Rand(1), {}
    for name, m in files.modules(ref.unet, r"attn[12]\.to_(q|k|v|out\.0)$").items():
        block, proj = name.rsplit(".", 1) if not name.endswith("out.0") else (name[:-len(".to_out.0")], "to_out")
        tensors[f"unet.{block}.processor.{proj}_lora.down.weight"] = rand.down(4, m)
        tensors[f"unet.{block}.processor.{proj}_lora.up.weight"] = rand.up(4, m)
    for name, m in text_modules(ref, r"self_attn\.(q|v)_proj$").items():
        tensors[f"text_encoder.{name}.lora_linear_layer.down.weight"] = rand.down(4, m)
        tensors[f"text_encoder.{name}.lora_linear_layer.up.weight"] = rand.up(4, m)
    return files.save(tensors, path)


def legacy_bias_file(ref, path):
    """PEFT's ``lora_B.bias`` in diffusers' older names, as ``convert_state_dict_to_diffusers`` writes a bias LoRA
    (training scripts save so): ``unet.<name>.lora.up.bias``, ``text_encoder.<name>.lora_linear_layer.up.bias``, on
    layers with a bias (PEFT fuses it into theirs)."""
    rand = files.Rand(5)
    names = {"lora_A.weight": "down.weight", "lora_B.weight": "up.weight", "lora_B.bias": "up.bias"}
    tensors = {**files.peft(files.modules(ref.unet, r"(to_out\.0|ff\.net\.2|conv1)$"), "unet.", rand, bias=True),
               **files.peft(text_modules(ref, r"self_attn\.(q|v)_proj$"), "text_encoder.", rand, bias=True)}
    layer = {"unet.": ".lora.", "text_encoder.": ".lora_linear_layer."}
    return files.save({next(k.replace(f".{a}", layer[p] + b) for p in layer if k.startswith(p)
                            for a, b in names.items() if k.endswith(a)): v for k, v in tensors.items()}, path)


def kohya_file(ref, path, seed=2):
    """kohya: diffusers-like names with underscores, ``alpha``, LoCon on the ResNets' 3x3 convolutions (the text
    encoder's ``lora_te_`` is in the LyCORIS file: diffusers 0.42 cannot read it under transformers 5)."""
    return files.save(files.kohya(files.modules(ref.unet, UNET), "lora_unet_", files.Rand(seed), rank=4, alpha=2.0),
                      path)


def dora_file(ref, path, seed=3):
    rand = files.Rand(seed)
    return files.save(files.peft(files.modules(ref.unet, r"attn[12]\.to_(q|v)$|ff\.net\.2$"), "unet.", rand,
                                 rank=4, dora=True), path)


def lycoris_file(ref, path):
    """A LyCORIS file mixing kinds per layer, kohya-named."""
    rand, t = files.Rand(4), {}
    unet = dict(ref.unet.named_modules())
    key = lambda name: files.underscored("lora_unet_", name)  # noqa: E731
    a = "down_blocks.0.attentions.0.transformer_blocks.0."
    t.update(files.loha(key(a + "attn1.to_q"), unet[a + "attn1.to_q"], rand))
    t.update(files.loha(key("down_blocks.0.resnets.0.conv1"), unet["down_blocks.0.resnets.0.conv1"], rand,
                        tucker=True))
    t.update(files.lokr(key(a + "attn2.to_k"), unet[a + "attn2.to_k"], rand))
    t.update(files.lokr(key("up_blocks.1.resnets.0.conv2"), unet["up_blocks.1.resnets.0.conv2"], rand))
    t.update(files.kohya({"up_blocks.1.resnets.1.conv1": unet["up_blocks.1.resnets.1.conv1"]}, "lora_unet_", rand,
                         mid=True))
    t.update(files.kohya({a + "attn1.to_v": unet[a + "attn1.to_v"]}, "lora_unet_", rand, dora=True))
    t.update(files.full(key(a + "ff.net.2"), unet[a + "ff.net.2"], rand))
    t.update(files.full(key("mid_block.attentions.0.proj_out"), unet["mid_block.attentions.0.proj_out"], rand))
    te = text_modules(ref, TEXT)
    t.update(files.loha(files.underscored("lora_te_", "text_model.encoder.layers.0.self_attn.q_proj"),
                        te["text_model.encoder.layers.0.self_attn.q_proj"], rand))
    t.update(files.kohya({n: m for n, m in te.items() if "layers.1" in n}, "lora_te_", rand, rank=3, alpha=1.0))
    return files.save(t, path)


def lycoris_reference(ref, path):
    """The diffusers pipeline running LyCORIS' own reading of the file in its modules' forward."""
    with files.lycoris_applied(path, {"lora_unet": ref.unet, "lora_te": files.checkpoint_named(ref.text_encoder)}):
        return _theirs(ref)


def _diffusers(ref, path, fuse: bool, weights=None):
    ref.load_lora_weights(str(path), adapter_name="x")
    try:
        if weights is not None:
            ref.set_adapters("x", weights)
        if fuse:
            ref.fuse_lora()
        return _theirs(ref)
    finally:
        if fuse:
            ref.unfuse_lora()
        ref.unload_lora_weights()


# -- formats, fused (the plain pipeline's program) -------------------------------------------------------------------

FORMATS = {"peft": lambda ref, path: peft_file(ref, path, bias=False), "legacy": legacy_file, "kohya": kohya_file,
           "legacy_bias": legacy_bias_file,
           "dora": dora_file}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_format_fused_matches_diffusers(sd, fmt):
    ref, pipe, base, folder = sd
    path = FORMATS[fmt](ref, folder / f"{fmt}.safetensors")
    expected = _diffusers(ref, path, fuse=True)
    pipe.load_lora_weights(path, adapter_name=fmt)
    originals = {c: [np.asarray(x).copy() for x in _leaves(getattr(pipe, c))] for c in ("unet", "text_encoder")}
    try:
        pipe.fuse_lora()
        with no_compile(f"{fmt} fused"):
            got = _ours(pipe)
        _close(got, expected, f"{fmt} fused")
        _moved(got, base, fmt)
        pipe.unfuse_lora()
        for c, leaves in originals.items():  # unfusing gives back the very bytes
            assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(leaves, _leaves(getattr(pipe, c))))
    finally:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()


def _leaves(model):
    return jax.tree.leaves(model)


def test_lycoris_kinds_match_lycoris_fused(sd):
    """LoHa, LoKr, LoCon with ``lora_mid``, ``dora_scale`` and full differences, fused (each kind's unfused path
    is checked against LyCORIS layer by layer in tests/test_lora_nn.py)."""
    ref, pipe, base, folder = sd
    path = lycoris_file(ref, folder / "lycoris.safetensors")
    expected = lycoris_reference(ref, path)
    pipe.load_lora_weights(path)
    try:
        pipe.fuse_lora()
        with no_compile("LyCORIS fused"):
            got = _ours(pipe)
        _close(got, expected, "LyCORIS kinds, fused")
        _moved(got, base, "LyCORIS kinds")
    finally:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()


# -- unfused: strengths, switches, another file, hotswap -------------------------------------------------------------


def test_unfused_values_compile_nothing(sd):
    """One compile for the adapters' structure (ranks padded to ``max_rank``); then a strength, per-block strengths,
    switching off and on, a file of the same ranks and targets, and a hotswap of other ranks are values, each
    checked against diffusers (or the plain output)."""
    ref, pipe, base, folder = sd
    a = peft_file(ref, folder / "a.safetensors", seed=10)
    b = peft_file(ref, folder / "b.safetensors", seed=11)
    c = peft_file(ref, folder / "c.safetensors", seed=12, ranks={"to_k": 6, "to_q": 5})
    with pytest.raises(CheckpointError, match="max_rank=4"):
        pipe.load_lora_weights(c, adapter_name="a", max_rank=4)
    pipe.load_lora_weights(a, adapter_name="a", max_rank=8)
    try:
        first = _ours(pipe)
        _close(first, _diffusers(ref, a, fuse=False), "PEFT unfused")
        _moved(first, base, "PEFT unfused")
        blocks = {"unet": {"down": {"block_0": 0.0}, "mid": 0.5, "up": {"block_1": [1.0, 0.3]}}, "text_encoder": 0.7}
        checks = [("strength 0.5", lambda: pipe.set_adapters("a", 0.5), _diffusers(ref, a, False, 0.5)),
                  ("per-block", lambda: pipe.set_adapters(["a"], [blocks]), _diffusers(ref, a, False, blocks)),
                  ("disabled", pipe.disable_lora, None),
                  ("enabled", pipe.enable_lora, None)]
        for what, change, expected in checks:
            change()
            with no_compile(what):
                got = _ours(pipe)
            if what == "disabled":
                assert np.max(np.abs(got.astype(int) - base.astype(int))) <= 1, "disabled adapters still act"
            elif expected is not None:
                _close(got, expected, what)
        assert pipe.get_active_adapters() == ["a"]
        pipe.delete_adapters("a")
        pipe.load_lora_weights(b, adapter_name="b", max_rank=8)
        with no_compile("another file of the same shapes"):
            other = _ours(pipe)
        _close(other, _diffusers(ref, b, fuse=False), "second file")
        assert not np.array_equal(other, first)
        pipe.load_lora_weights(c, adapter_name="b", hotswap=True)
        with no_compile("hotswap"):
            swapped = _ours(pipe)
        assert pipe.get_list_adapters() == {"unet": ["b"], "text_encoder": ["b"]}
        _close(swapped, _diffusers(ref, c, fuse=False), "hotswapped")
    finally:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()
    with no_compile("unloaded"):
        np.testing.assert_array_equal(_ours(pipe), base)


def test_call_lora_scale_matches_diffusers(sd):
    """``cross_attention_kwargs={"scale": s}`` multiplies the adapters' strengths for that call only, in the UNet and
    the text encoder (diffusers' ``scale_lora_layers`` in the UNet's forward and ``encode_prompt``), on top of
    ``set_adapters``' weight; a new scale compiles nothing, the next call is back at full strength, and adapters fused
    into the weights keep theirs. The adapter structure is test_unfused_values_compile_nothing's (one program)."""
    ref, pipe, base, folder = sd
    path = peft_file(ref, folder / "scaled.safetensors", seed=13)
    ref.load_lora_weights(str(path), adapter_name="s")
    try:
        half = _theirs(ref, cross_attention_kwargs={"scale": 0.5})
        ref.set_adapters("s", 0.8)
        weighted = _theirs(ref, cross_attention_kwargs={"scale": 1.5})
    finally:
        ref.unload_lora_weights()
        ref._lora_scale = 1.0  # diffusers keeps a call's scale and scales later text-encoder loads by it (README)
    pipe.load_lora_weights(path, adapter_name="s", max_rank=8)
    try:
        full = _ours(pipe)
        with no_compile("cross_attention_kwargs scale 0.5"):
            got = _ours(pipe, cross_attention_kwargs={"scale": 0.5})
        _close(got, half, "LoRA scale 0.5")
        assert np.max(np.abs(got.astype(int) - full.astype(int))) > 8, "the scale did not move the output"
        with no_compile("the next call"):
            np.testing.assert_array_equal(_ours(pipe), full)
        pipe.set_adapters("s", 0.8)
        with no_compile("weight 0.8, scale 1.5"):
            _close(_ours(pipe, cross_attention_kwargs={"scale": 1.5}), weighted, "weight 0.8 x scale 1.5")
    finally:
        pipe.unload_lora_weights()
    pipe.load_lora_weights(peft_file(ref, folder / "scaled_fused.safetensors", seed=14, bias=False))
    try:
        pipe.fuse_lora()
        with no_compile("fused (the plain program)"):
            fused = _ours(pipe)
            np.testing.assert_array_equal(_ours(pipe, cross_attention_kwargs={"scale": 0.5}), fused)
        _moved(fused, base, "fused")
    finally:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()


def test_fuse_lora_fuses_named_adapters_active_or_not(sd):
    """``fuse_lora(adapter_names=["b"])`` fuses ``b`` at its strength although ``set_adapters`` left it inactive, as
    diffusers does (PEFT merges a named adapter whatever the active set); the active ``a`` stays unfused. Found by
    the lorasweep: the inactive adapter's switch (0) was fused with it, so nothing of it was, silently. Weight space
    against diffusers' fused UNet, no compile."""
    ref, pipe, base, folder = sd
    a = peft_file(ref, folder / "named_a.safetensors", seed=40, bias=False)
    b = peft_file(ref, folder / "named_b.safetensors", seed=41, bias=False)
    ref.load_lora_weights(str(a), adapter_name="a")
    ref.load_lora_weights(str(b), adapter_name="b")
    try:
        ref.set_adapters("a", 0.5)
        ref.fuse_lora(adapter_names=["b"])
        expected = {k.replace(".base_layer", ""): v.detach().numpy().copy() for k, v in ref.unet.state_dict().items()
                    if "lora_" not in k}
    finally:
        ref.unfuse_lora()
        ref.unload_lora_weights()
    before, models = state_dict(pipe.unet), (pipe.unet, pipe.text_encoder)
    pipe.load_lora_weights(a, adapter_name="a")
    pipe.load_lora_weights(b, adapter_name="b")
    try:
        pipe.set_adapters("a", 0.5)
        pipe.fuse_lora(adapter_names=["b"])
        assert pipe.get_active_adapters() == ["a"]
        with pytest.warns(AdaptersNotSavedWarning):  # a, unfused, is left out: the weights hold b
            ours = state_dict(pipe.unet)
        pipe.unload_lora_weights()  # as diffusers: b stays fused (how a LoRA is baked in before saving), a goes
        with warnings.catch_warnings():
            warnings.simplefilter("error", AdaptersNotSavedWarning)  # no adapter is left
            unloaded = state_dict(pipe.unet)
    finally:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()
        pipe.unet, pipe.text_encoder = models
    bad = {k: rel_error(v, expected[k]) for k, v in ours.items() if rel_error(v, expected[k]) > 1e-4}
    assert not bad, f"fused weights differ from diffusers': {bad}"
    assert sum(not np.array_equal(v, before[k]) for k, v in ours.items()) > 20, "b was not fused"
    assert all(np.array_equal(v, ours[k]) for k, v in unloaded.items()), "unloading undid the fused weights"


def test_deleting_the_active_adapter_activates_the_first_left(sd):
    """Deleting a model's only active adapter makes the first one it still holds active (at its strength), with a
    warning, as diffusers' ``delete_adapters`` (PEFT's ``delete_adapter``). Found by the lorasweep: none was left
    active (255/255 from diffusers). Fused, in weight space against diffusers', no compile."""
    ref, pipe, base, folder = sd
    a = peft_file(ref, folder / "deleted_a.safetensors", seed=42, bias=False)
    b = peft_file(ref, folder / "deleted_b.safetensors", seed=43, bias=False)
    for p in (ref, pipe):
        p.load_lora_weights(a if p is pipe else str(a), adapter_name="a")
        p.load_lora_weights(b if p is pipe else str(b), adapter_name="b")
        p.set_adapters(["a", "b"], [0.7, 1.0])
        p.set_adapters("b")
    try:
        ref.delete_adapters("b")
        assert ref.get_active_adapters() == ["a"]
        ref.fuse_lora()
        expected = {k.replace(".base_layer", ""): v.detach().numpy().copy() for k, v in ref.unet.state_dict().items()
                    if "lora_" not in k}
    finally:
        ref.unfuse_lora()
        ref.unload_lora_weights()
    try:
        with pytest.warns(LoraWarning, match=r"'a' in text_encoder, unet"):
            pipe.delete_adapters("b")
        assert pipe.get_active_adapters() == ["a"]
        pipe.fuse_lora()
        ours = state_dict(pipe.unet)
    finally:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()
    bad = {k: rel_error(v, expected[k]) for k, v in ours.items() if rel_error(v, expected[k]) > 1e-4}
    assert not bad, f"fused weights differ from diffusers': {bad}"


def _fused_weights(model) -> dict:
    return {k.replace(".base_layer", ""): v.detach().numpy().copy() for k, v in model.state_dict().items()
            if "lora_" not in k}


def test_active_adapters_are_kept_per_model(sd):
    """Active adapters are per model, as diffusers keeps them (PEFT's state is in each model's layers): a UNet-only
    file loaded after a UNet + text-encoder one is the UNet's active adapter and leaves the text encoder's on; a
    delete then wakes the first adapter left in the model whose active ones went, there only. Found by the LoRA fuzz
    (SDXL seed 516: one active list for the pipeline switched the text encoder's adapter off, 0.087 from diffusers'
    fused CLIP). Fused, in weight space against diffusers' UNet and text encoder, no compile."""
    ref, pipe, base, folder = sd
    both = peft_file(ref, folder / "per_model_both.safetensors", seed=44, bias=False)
    unet_only = files.save(files.peft(files.modules(ref.unet, UNET), "unet.", files.Rand(45), rank=2),
                           folder / "per_model_unet.safetensors")
    expected, models = {}, (pipe.unet, pipe.text_encoder)
    for p in (ref, pipe):
        p.load_lora_weights(both if p is pipe else str(both), adapter_name="both")
        p.load_lora_weights(unet_only if p is pipe else str(unet_only), adapter_name="unet_only")
    try:
        assert pipe._lora().active == {"unet": ["unet_only"], "text_encoder": ["both"]}
        ref.fuse_lora(components=["unet", "text_encoder"])
        expected["load"] = {"unet": _fused_weights(ref.unet),
                            "text_encoder": _fused_weights(files.checkpoint_named(ref.text_encoder))}
        ref.unfuse_lora(components=["unet", "text_encoder"])
        ref.set_adapters(["both"])
        ref.load_lora_weights(str(unet_only), adapter_name="again")
        ref.delete_adapters(["both", "again"])  # the UNet's active "again" goes: its first left, unet_only, wakes
        ref.fuse_lora(components=["unet"])
        expected["delete"] = {"unet": _fused_weights(ref.unet)}
    finally:
        ref.unfuse_lora()
        ref.unload_lora_weights()
    try:
        pipe.fuse_lora(components=["unet", "text_encoder"])
        with pytest.warns(AdaptersNotSavedWarning, match="UNet"):  # "both", inactive there, stays unfused
            ours = {"load": {c: state_dict(getattr(pipe, c)) for c in ("unet", "text_encoder")}}
        pipe.unfuse_lora()
        pipe.set_adapters(["both"])
        pipe.load_lora_weights(unet_only, adapter_name="again")
        with pytest.warns(LoraWarning, match=r"'unet_only' in unet"):
            pipe.delete_adapters(["both", "again"])
        assert pipe._lora().active == {"unet": ["unet_only"]}
        pipe.fuse_lora()
        with warnings.catch_warnings():
            warnings.simplefilter("error", AdaptersNotSavedWarning)  # unet_only, the one left, is fused
            ours["delete"] = {"unet": state_dict(pipe.unet)}
    finally:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()
        pipe.unet, pipe.text_encoder = models
    for when, weights in expected.items():
        for component, theirs in weights.items():
            bad = {k: rel_error(v, theirs[k]) for k, v in ours[when][component].items()
                   if rel_error(v, theirs[k]) > 1e-4}
            assert not bad, f"{when}: fused {component} differs from diffusers': {bad}"


def test_dora_adapters_compose_in_the_active_order(sd):
    """Two PEFT DoRA adapters on the same layers compose in ``set_adapters``' order, as PEFT (each DoRA factor
    multiplies the layer's output so far, in the active order), and ``fuse_lora(adapter_names=...)`` merges them in
    the names' order, as PEFT. Found by the LoRA fuzz (SDXL seed 457, Wan 617: 16-43% from diffusers' weights): they
    composed in load order. Fused, in weight space against diffusers', no compile."""
    ref, pipe, base, folder = sd
    a, b = dora_file(ref, folder / "order_a.safetensors", 44), dora_file(ref, folder / "order_b.safetensors", 45)
    for p in (ref, pipe):
        p.load_lora_weights(a if p is pipe else str(a), adapter_name="a")
        p.load_lora_weights(b if p is pipe else str(b), adapter_name="b")
        p.set_adapters(["b", "a"], [1.3, 0.8])
    try:
        for names in (None, ["a", "b"]):
            ref.fuse_lora(adapter_names=names)
            expected = {k.replace(".base_layer", ""): v.detach().numpy().copy()
                        for k, v in ref.unet.state_dict().items() if "lora_" not in k}
            ref.unfuse_lora()
            pipe.fuse_lora(adapter_names=names)
            ours = state_dict(pipe.unet)
            pipe.unfuse_lora()
            bad = {k: rel_error(v, expected[k]) for k, v in ours.items() if rel_error(v, expected[k]) > 1e-4}
            assert not bad, f"fused {names} differ from diffusers': {bad}"
    finally:
        for p in (ref, pipe):
            p.unfuse_lora()
            p.unload_lora_weights()


# -- refusals ----------------------------------------------------------------------------------------------------------


def test_strict_errors_and_warnings(sd):
    ref, pipe, base, folder = sd
    good = files.kohya(files.modules(ref.unet, r"attn1\.to_q$"), "lora_unet_", files.Rand(30), rank=2)
    bad = {f"lora_unet_no_such_layer_{i}.lora_{p}.weight": torch.ones(2, 2) for i in range(12) for p in ("down", "up")}
    path = files.save({**good, **bad}, folder / "partly.safetensors")
    with pytest.raises(CheckpointError, match=r"24 of the .* adapt nothing .*no_such_layer.*and 14 more"):
        pipe.load_lora_weights(path)
    with pytest.warns(LoraWarning, match="adapt nothing"):
        name = pipe.load_lora_weights(path, strict=False)
    try:
        assert name == "default_0" and pipe.get_active_adapters() == ["default_0"]
        with pytest.raises(ValueError, match="already loaded"):
            pipe.load_lora_weights(path, adapter_name="default_0", strict=False)
        with pytest.raises(ValueError, match="no adapter named"):
            pipe.set_adapters("nope")
        with pytest.raises(ValueError, match="per-block weights: down \\['block_1'\\] name blocks without"):
            pipe.set_adapters("default_0", {"unet": {"down": {"block_1": 1.0}}})
        with pytest.raises(ValueError, match="hotswap=True replaces a loaded adapter"):
            pipe.load_lora_weights(path, adapter_name="other", hotswap=True)
    finally:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()
    nothing = files.save({"some.random.tensor": torch.ones(3)}, folder / "nothing.safetensors")
    with pytest.raises(CheckpointError, match="Nothing in the file applies"):
        pipe.load_lora_weights(nothing)
    flux = {f"lora_unet_double_blocks_{i}_img_attn_qkv.lora_down.weight": torch.ones(2, 8) for i in range(3)}
    flux.update({k.replace("down", "up"): torch.ones(24, 2) for k in list(flux)})
    with pytest.raises(CheckpointError, match=r"is a LoRA for Flux.1 \(keys such as .*\), not for Stable Diffusion"):
        pipe.load_lora_weights(files.save(flux, folder / "flux.safetensors"))
    te2 = files.kohya(text_modules(ref, TEXT), "lora_te2_", files.Rand(31), rank=2)
    with pytest.raises(CheckpointError, match="is a LoRA for Stable Diffusion XL"):
        pipe.load_lora_weights(files.save(te2, folder / "sdxl.safetensors"))
    with pytest.raises(CheckpointError, match="pickle"):
        pipe.load_lora_weights(folder / "lora.ckpt")
    with pytest.raises(CheckpointError, match="not found"):
        pipe.load_lora_weights(folder / "missing.safetensors")


def test_inspect_reports_a_file_and_what_fits(sd):
    ref, pipe, base, folder = sd
    path = lycoris_file(ref, folder / "inspected.safetensors")
    report = eqxdiff.lora.inspect(path)
    assert report.family == "Stable Diffusion 1.x/2.x"
    layers1 = len([n for n in text_modules(ref, TEXT) if "layers.1" in n])
    assert report.adapter_types == {"LoHa": 3, "LoKr": 2, "LoCon (Tucker)": 1, "LoRA + DoRA": 1, "full diff": 2,
                                    "LoRA": layers1}
    assert report.components == {"unet": 8, "text_encoder": 1 + layers1} and report.modules == 9 + layers1
    assert report.ranks == {2: 2, 3: 3 + layers1, 4: 2, "full": 2}
    fits = eqxdiff.lora.inspect(path, pipe)
    assert fits.supported and len(fits.matched) == 9 + layers1 and not fits.unmatched
    assert "StableDiffusionPipeline: yes" in str(fits)
