"""IP-Adapter on the Stable Diffusion and SDXL pipelines (eqxdiff.pipelines._ip_adapter) against diffusers'
``load_ip_adapter`` and ``ip_adapter_image`` / ``ip_adapter_image_embeds``, float32, tiny random pipelines, a random
adapter and image encoder saved as diffusers reads them, guidance on, the same initial latents."""

import contextlib

import jax
import numpy as np
import pytest
import torch
from PIL import Image

import eqxdiff
from eqxdiff.loading import CheckpointError, state_dict, without_adapters
from eqxdiff.models import ip_adapter as ipa
from eqxdiff.pipelines import InputError, save_pipeline

from . import _lora_files as files
from . import _tiny_sdxl
from ._ip_adapter_files import as_numpy, ip_adapter_state, plus_image_proj, save_ip_adapter
from ._tiny_sd import build_pipeline
from ._util import nhwc_to_nchw

PICTURE = Image.fromarray(np.random.default_rng(5).integers(0, 256, (40, 48, 3), dtype=np.uint8))
STEPS = dict(num_inference_steps=3, guidance_scale=6.0)


def _max_pixel_diff(ours_uint8, ref_float):
    return int(np.max(np.abs(ours_uint8.astype(int) - (ref_float * 255).round().astype(int))))


def _build(kind, folder):
    if kind == "sd":
        return build_pipeline(folder / "pipe")
    return _tiny_sdxl.build_base(folder / "pipe")


@pytest.fixture(scope="module", params=["sd", "sdxl"])
def pipes(request, tmp_path_factory):
    """(diffusers pipeline, eqxdiff pipeline, the adapter's folder), each pipeline with the same random IP-Adapter
    loaded from that folder."""
    return adapted_pipes(request.param, tmp_path_factory.mktemp(f"ip_{request.param}"))


def adapted_pipes(kind, folder):
    """(diffusers pipeline, eqxdiff pipeline, the adapter's folder) of ``kind`` ("sd" or "sdxl") saved in
    ``folder``, the same random IP-Adapter loaded on each."""
    ref = _build(kind, folder)
    save_ip_adapter(folder / "ip", ref.unet)
    ref.load_ip_adapter(str(folder / "ip"), subfolder="", weight_name="ip-adapter.safetensors")
    pipe = eqxdiff.load_pipeline(folder / "pipe")
    pipe.load_ip_adapter(folder / "ip", subfolder="", weight_name="ip-adapter.safetensors")
    return ref, pipe, folder / "ip"


@contextlib.contextmanager
def second_adapter(ref, pipe, source):
    """Both pipelines with a second random adapter (a state dict) after the fixture's file; the file alone again
    after."""
    state = ip_adapter_state(ref.unet, seed=5)
    try:
        ref.load_ip_adapter([str(source), state], subfolder=["", None], weight_name=["ip-adapter.safetensors", None])
        pipe.load_ip_adapter([source, as_numpy(state)], subfolder=["", None],
                             weight_name=["ip-adapter.safetensors", None])
        yield
    finally:
        ref.load_ip_adapter(str(source), subfolder="", weight_name="ip-adapter.safetensors")
        pipe.load_ip_adapter(source, subfolder="", weight_name="ip-adapter.safetensors")


def _reference(ref, latents, **kwargs):
    with torch.no_grad():
        return np.asarray(ref("a red cat", latents=nhwc_to_nchw(latents), output_type="np", height=32, width=32,
                              num_images_per_prompt=2, **STEPS, **kwargs).images)


def _ours(pipe, latents, **kwargs):
    return pipe("a red cat", latents=latents, height=32, width=32, num_images_per_prompt=2, progress=False,
                **STEPS, **kwargs)


def test_images_match_diffusers_and_a_new_scale_compiles_nothing(pipes):
    ref, pipe, _ = pipes
    latents = np.random.default_rng(0).standard_normal((2, 16, 16, 4)).astype(np.float32)
    ref.set_ip_adapter_scale(1.0)
    pipe.set_ip_adapter_scale(1.0)
    ours = _ours(pipe, latents, ip_adapter_image=PICTURE)
    assert _max_pixel_diff(ours, _reference(ref, latents, ip_adapter_image=PICTURE)) <= 2
    ref.set_ip_adapter_scale(0.4)
    pipe.set_ip_adapter_scale(0.4)
    weaker = _ours(pipe, latents, ip_adapter_image=PICTURE)
    assert pipe.timings["call_compile"] == 0.0  # the scale is a value in the UNet: the same programs run
    assert _max_pixel_diff(weaker, _reference(ref, latents, ip_adapter_image=PICTURE)) <= 2
    assert np.abs(weaker.astype(int) - ours.astype(int)).max() > 2  # the scale matters
    # diffusers' own image embeddings ([negative; positive]) given instead of the image: the same images
    with torch.no_grad():
        embeds = ref.prepare_ip_adapter_image_embeds(PICTURE, None, "cpu", 1, True)
    given = _ours(pipe, latents, ip_adapter_image_embeds=[e.numpy() for e in embeds])
    assert _max_pixel_diff(given, _reference(ref, latents, ip_adapter_image=PICTURE)) <= 2


BLOCK_SCALES = {  # InstantStyle's per-block configs, for the tiny UNets' blocks with attention
    "sd": [{"down": 0.7, "up": {"block_1": [0.2, 0.9]}}, {"up": {"block_1": 0.5}}, 0.3],
    "sdxl": [{"down": {"block_1": 0.4}, "mid": 0.8, "up": {"block_0": [0.0, 1.0]}}, {"up": {"block_0": [0.6]}}],
}


def test_image_prompts_are_read_as_diffusers_reads_them(pipes):
    """encode_image as diffusers': an RGBA picture goes to the image processor as it is (which composites it over
    white; eqxdiff dropped the alpha before), a torch tensor is already the processor's pixel_values (eqxdiff resized
    and normalised it again before); the embeddings and Plus's hidden states within 1e-4. Found by the pipeline-level
    IP-Adapter fuzz's probe of input kinds."""
    ref, pipe, _ = pipes
    rng = np.random.default_rng(7)
    rgba = Image.fromarray(rng.integers(0, 256, (40, 36, 4), dtype=np.uint8), "RGBA")
    pixels = torch.from_numpy(rng.standard_normal((2, 3, 32, 32)).astype(np.float32))
    for image in (rgba, pixels):
        for hidden in (False, True):
            with torch.no_grad():
                expected = ref.encode_image(image, "cpu", 1, output_hidden_states=hidden)
            for theirs, ours in zip(expected, pipe.encode_image(image, output_hidden_states=hidden)):
                np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), rtol=0, atol=1e-4 * np.abs(
                    theirs.numpy()).max())
    with pytest.raises(InputError, match=r"pixel_values \[n, 3, 32, 32\], as diffusers takes it; got \(1, 3, 40, 36\)"):
        pipe.encode_image(torch.zeros(1, 3, 40, 36))


def test_per_block_scales_are_diffusers(pipes):
    ref, pipe, _ = pipes
    kind = "sdxl" if "XL" in type(pipe).__name__ else "sd"
    for config in BLOCK_SCALES[kind]:
        ref.set_ip_adapter_scale(config)
        pipe.set_ip_adapter_scale(config)
        theirs = [p.scale for name, p in ref.unet.attn_processors.items() if name.endswith("attn2.processor")]
        np.testing.assert_array_equal(ipa.ip_adapter_scales(pipe.unet), np.asarray(theirs, np.float32))
    with pytest.raises(InputError, match=r"down.block_7 has no attention layers; down has \['block_"):
        pipe.set_ip_adapter_scale({"down": {"block_7": 1.0}})
    with pytest.raises(InputError, match="takes 1 or 2 scales"):
        pipe.set_ip_adapter_scale({"up": {f"block_{1 if kind == 'sd' else 0}": [1.0, 0.0, 1.0]}})


def test_bad_inputs_name_the_fix(pipes, tmp_path):
    _, pipe, _ = pipes
    with pytest.raises(InputError, match=r"ip_adapter_image_embeds\[0\] has shape \(2, 1, 5\)"):
        _ours(pipe, None, ip_adapter_image_embeds=[np.zeros((2, 1, 5), np.float32)])
    with pytest.raises(InputError, match="unload_ip_adapter"):
        _ours(pipe, None)
    with pytest.raises(InputError, match="not both"):
        _ours(pipe, None, ip_adapter_image=PICTURE, ip_adapter_image_embeds=[np.zeros((2, 1, 12), np.float32)])
    with pytest.raises(InputError, match="'down', 'mid' and 'up'"):
        pipe.set_ip_adapter_scale({"middle": 1.0})
    (tmp_path / "ip-adapter.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="pickle"):
        pipe.load_ip_adapter(tmp_path, subfolder=None, weight_name="ip-adapter.bin")
    plain = type(pipe).from_pipe(pipe)
    plain.unload_ip_adapter()
    assert pipe.ip_adapter is not None  # (the other pipeline keeps its adapter)
    with pytest.raises(InputError, match="no IP-Adapter is loaded; load one first: pipe.load_ip_adapter"):
        _ours(plain, None, ip_adapter_image=PICTURE)
    with pytest.raises(InputError, match="no IP-Adapter is loaded"):
        plain.set_ip_adapter_scale(0.5)


def test_save_pretrained_leaves_the_adapter_out(pipes, tmp_path):
    """pipe.save_pretrained and save_pipeline(pipe) write the folder without the adapter (models_to_save; the
    latter wrote the adapter's layers into the UNet's folder before)."""
    _, pipe, _ = pipes
    pipe.save_pretrained(tmp_path / "saved")
    save_pipeline(pipe, tmp_path / "direct")
    assert pipe.ip_adapter is not None  # (still loaded here)
    for name in ("saved", "direct"):
        again = eqxdiff.load_pipeline(tmp_path / name)
        assert again.ip_adapter is None and not ipa.has_ip_adapters(again.unet)
        assert not any("_ip" in k for k in state_dict(again.unet)), f"{name}: the adapter's layers were written"


def test_the_image_encoder_is_placed_as_the_pipelines_encoders(pipes):
    """load_ip_adapter's CLIP image encoder goes where the pipeline's own encoders go: in host memory with
    offload_encoders (it stayed on the device before), read onto the mesh with the plan on one (it sat on one
    device before); the images are the one-device pipeline's."""
    from jax.sharding import NamedSharding

    from eqxdiff.parallel import MeshConfig, make_mesh

    _, pipe, folder = pipes
    if "text_encoder_2" in pipe.components:
        pytest.skip("one pipeline suffices: the placement is the shared loader's")
    latents = np.random.default_rng(0).standard_normal((2, 16, 16, 4)).astype(np.float32)
    mesh = make_mesh(MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=-1))
    for options in (dict(offload_encoders=True), dict(mesh=mesh)):
        placed = eqxdiff.load_pipeline(folder.parent / "pipe", **options)
        placed.load_ip_adapter(folder, subfolder="", weight_name="ip-adapter.safetensors")
        leaves = jax.tree.leaves(placed.ip_adapter.image_encoder)
        if "mesh" in options:
            assert all(isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh for x in leaves)
            plans = [m.plan for m in jax.tree.leaves(placed.ip_adapter.image_encoder, is_leaf=lambda m: hasattr(
                m, "plan")) if hasattr(m, "plan")]
            assert plans and all(plan.mesh == mesh for plan in plans)
        else:
            assert all(isinstance(x, np.ndarray) for x in leaves)
        pipe.set_ip_adapter_scale(1.0)
        images = [_ours(p, latents, ip_adapter_image=PICTURE).astype(int) for p in (placed, pipe)]
        assert np.abs(images[0] - images[1]).max() <= 1


def test_image_to_image_takes_the_adapter_as_diffusers(pipes, monkeypatch):
    """Image-to-image runs the same call: diffusers' img2img class on the same components (the adapter loaded),
    from the same image latents and noise."""
    ref, pipe, _ = pipes
    if "XL" in type(pipe).__name__:
        from diffusers.pipelines.stable_diffusion_xl import pipeline_stable_diffusion_xl_img2img as module

        img2img = module.StableDiffusionXLImg2ImgPipeline(**ref.components)
    else:
        from diffusers.pipelines.stable_diffusion import pipeline_stable_diffusion_img2img as module

        img2img = module.StableDiffusionImg2ImgPipeline(**ref.components, requires_safety_checker=False)
    img2img.set_progress_bar_config(disable=True)
    rng = np.random.default_rng(2)
    clean = rng.standard_normal((1, 16, 16, 4)).astype(np.float32)  # image latents, as a hand-over gives them
    noise = rng.standard_normal((2, 16, 16, 4)).astype(np.float32)
    monkeypatch.setattr(module, "randn_tensor", lambda *a, **k: nhwc_to_nchw(noise))
    ref.set_ip_adapter_scale(0.7)
    pipe.set_ip_adapter_scale(0.7)
    with torch.no_grad():
        expected = np.asarray(img2img("a red cat", image=nhwc_to_nchw(clean), strength=0.7, output_type="np",
                                      num_images_per_prompt=2, ip_adapter_image=PICTURE, **STEPS).images)
    ours = pipe("a red cat", image=clean, latents=noise, strength=0.7, num_images_per_prompt=2,
                ip_adapter_image=PICTURE, progress=False, **STEPS)
    assert _max_pixel_diff(ours, expected) <= 2


OTHER = Image.fromarray(np.random.default_rng(6).integers(0, 256, (36, 30, 3), dtype=np.uint8))


def test_two_images_on_one_adapter_match_diffusers(pipes):
    """diffusers' list of images for an adapter (``[[a, b]]``): both images' tokens read together, as images and as
    diffusers' embeddings ``[2 (negative; positive), 2 images, embed]``; the same count compiles nothing again.
    Before, eqxdiff refused a second image."""
    ref, pipe, _ = pipes
    latents = np.random.default_rng(3).standard_normal((2, 16, 16, 4)).astype(np.float32)
    ref.set_ip_adapter_scale(0.8)
    pipe.set_ip_adapter_scale(0.8)
    expected = _reference(ref, latents, ip_adapter_image=[[PICTURE, OTHER]])
    ours = _ours(pipe, latents, ip_adapter_image=[[PICTURE, OTHER]])
    assert _max_pixel_diff(ours, expected) <= 2
    assert ipa.image_counts(pipe.unet) == (1,)  # the call's count went with the call, not onto the pipeline
    assert np.abs(ours.astype(int) - _ours(pipe, latents, ip_adapter_image=PICTURE).astype(int)).max() > 2
    with torch.no_grad():
        embeds = ref.prepare_ip_adapter_image_embeds([[PICTURE, OTHER]], None, "cpu", 1, True)
    assert tuple(embeds[0].shape[:2]) == (2, 2)
    given = _ours(pipe, latents, ip_adapter_image_embeds=[e.numpy() for e in embeds])
    assert pipe.timings["denoise_compile"] == 0.0  # two images again (after one): the first call's loop
    assert _max_pixel_diff(given, expected) <= 2
    with pytest.raises(InputError, match=r"2 entries for 1 IP-Adapter\(s\).*\[\[image_a, image_b\]\]"):
        _ours(pipe, None, ip_adapter_image=[PICTURE, OTHER])


def test_two_adapters_with_one_and_two_images_match_diffusers(pipes):
    """Two adapters (the fixture's file and a state dict), 1 and 2 images: the second adapter's tokens, twice as
    many, after the first's."""
    ref, pipe, source = pipes
    with second_adapter(ref, pipe, source):
        ref.set_ip_adapter_scale([0.9, 0.6])
        pipe.set_ip_adapter_scale([0.9, 0.6])
        latents = np.random.default_rng(4).standard_normal((2, 16, 16, 4)).astype(np.float32)
        images = [PICTURE, [OTHER, PICTURE]]
        assert _max_pixel_diff(_ours(pipe, latents, ip_adapter_image=images),
                               _reference(ref, latents, ip_adapter_image=images)) <= 2


def test_plus_adapter_from_a_dict_matches_diffusers(pipes):
    """IP-Adapter Plus (the Resampler over the image encoder's penultimate hidden states), given as a state dict in
    memory; the image encoder loaded with the first adapter stays. (Last in the file: it replaces the adapter.)"""
    ref, pipe, _ = pipes
    state = {"image_proj": plus_image_proj(ref.unet.config.cross_attention_dim, seed=8),
             "ip_adapter": ip_adapter_state(ref.unet, seed=4)["ip_adapter"]}
    ref.load_ip_adapter(state, subfolder=None, weight_name=None)
    pipe.load_ip_adapter(state)
    latents = np.random.default_rng(1).standard_normal((2, 16, 16, 4)).astype(np.float32)
    expected = _reference(ref, latents, ip_adapter_image=PICTURE)
    assert _max_pixel_diff(_ours(pipe, latents, ip_adapter_image=PICTURE), expected) <= 2
    with torch.no_grad():
        embeds = ref.prepare_ip_adapter_image_embeds(PICTURE, None, "cpu", 1, True)
    assert embeds[0].ndim == 4  # [negative; positive], images, tokens, dim
    given = _ours(pipe, latents, ip_adapter_image_embeds=[e.numpy() for e in embeds])
    assert _max_pixel_diff(given, expected) <= 2


def _ip_scales(unet) -> list:
    return [np.asarray(x) for path, x in jax.tree_util.tree_leaves_with_path(unet)
            if "ip_scale" in jax.tree_util.keystr(path)]


def test_lora_and_ip_adapter_keep_each_other(pipes, tmp_path):
    """A LoRA and an IP-Adapter on one UNet, in either order: unloading one leaves the other as it was, and
    unfuse_lora gives back a UNet with the IP-Adapter and its scales. Found reviewing the IP-Adapter change: the
    LoRA kept the UNet as first loaded, so unload_lora_weights gave back one without the IP-Adapter's layers while
    pipe.ip_adapter still appended image tokens (then read as text), and after unload_ip_adapter gave back one with
    them (which split the text's last tokens off as image tokens). Bookkeeping only: nothing compiles."""
    ref, pipe, _ = pipes
    lora = files.save(files.peft(files.modules(ref.unet, r"attn[12]\.to_(q|k|v|out\.0)$"), "unet.", files.Rand(3),
                                 rank=2), tmp_path / "lora.safetensors")
    state = as_numpy(ip_adapter_state(ref.unet, seed=9))
    before = pipe.unet, pipe.ip_adapter
    try:
        pipe.load_lora_weights(lora, adapter_name="style")  # the IP-Adapter first (the fixture's), then a LoRA
        pipe.unload_ip_adapter()
        assert without_adapters(pipe.unet)[1], "unloading the IP-Adapter took the LoRA out"
        pipe.unload_lora_weights()
        assert not ipa.has_ip_adapters(pipe.unet), "unload_lora_weights gave back the IP-Adapter unloaded before"

        pipe.load_lora_weights(lora, adapter_name="style")  # a LoRA first, then an IP-Adapter at scale 0.5
        pipe.load_ip_adapter(state)
        pipe.set_ip_adapter_scale(0.5)
        pipe.fuse_lora()
        pipe.unfuse_lora()
        assert without_adapters(pipe.unet)[1] and all(np.all(s == 0.5) for s in _ip_scales(pipe.unet))
        pipe.unload_lora_weights()
        assert not without_adapters(pipe.unet)[1], "the LoRA stayed"
        scales = _ip_scales(pipe.unet)
        assert scales and all(np.all(s == 0.5) for s in scales), "unload_lora_weights lost the IP-Adapter or its scale"
    finally:
        pipe.unload_lora_weights()
        pipe.unet, pipe.ip_adapter = before


def test_generate_takes_an_ip_adapter(tmp_path):
    """eqxdiff-generate's --ip-adapter FILE, --ip-adapter-scale and --ip-adapter-image: the Python API's image,
    recorded in the PNG; a repeated --ip-adapter-image is the adapter's list of images; bad combinations are refused
    before loading."""
    from eqxdiff.cli import generate
    from eqxdiff.pipelines import read_parameters

    ref = build_pipeline(tmp_path / "pipe")
    save_ip_adapter(tmp_path / "ip", ref.unet)
    PICTURE.save(tmp_path / "picture.png")
    adapter = tmp_path / "ip" / "ip-adapter.safetensors"
    argv = ["--model", str(tmp_path / "pipe"), "--prompt", "a red cat", "--height", "32", "--width", "32",
            "--num-inference-steps", "2", "--seed", "0"]
    ip = ["--ip-adapter", str(adapter), "--ip-adapter-image", str(tmp_path / "picture.png")]
    paths = generate.main([*argv, *ip, "--ip-adapter-scale", "0.6", "--output-dir", str(tmp_path / "out")])
    params = read_parameters(paths[0])
    assert params["ip_adapter"] == str(adapter) and params["ip_adapter_scale"] == 0.6
    pipe = eqxdiff.load_pipeline(tmp_path / "pipe")
    pipe.load_ip_adapter(tmp_path / "ip", weight_name="ip-adapter.safetensors")
    pipe.set_ip_adapter_scale(0.6)
    expected = pipe("a red cat", height=32, width=32, num_inference_steps=2, seed=0, progress=False,
                    ip_adapter_image=Image.open(tmp_path / "picture.png"))
    np.testing.assert_array_equal(np.asarray(Image.open(paths[0]).convert("RGB")), expected[0])
    OTHER.save(tmp_path / "other.png")  # --ip-adapter-image repeated: both images on the one adapter ([[a, b]])
    twice = generate.validate([*argv, *ip, "--ip-adapter-image", str(tmp_path / "other.png")]).kwargs
    (images,) = twice["ip_adapter_image"]
    assert [np.asarray(x).tolist() for x in images] == [np.asarray(PICTURE).tolist(), np.asarray(OTHER).tolist()]
    (tmp_path / "ip-adapter.bin").write_bytes(b"")
    for extra, match in [
        (ip[2:], "--ip-adapter-image needs --ip-adapter"),
        (ip[:2], "--ip-adapter needs --ip-adapter-image"),
        (["--ip-adapter", str(tmp_path / "ip-adapter.bin"), *ip[2:]], "give a .safetensors file"),
    ]:
        with pytest.raises(InputError, match=match):
            generate.validate([*argv, *extra])


def test_generate_takes_several_ip_adapters(tmp_path):
    """eqxdiff-generate's --ip-adapter repeated: the adapters loaded together, one --ip-adapter-image (and mask) each
    in their order, --ip-adapter-scale one per adapter: the Python API's image, recorded as lists; wrong counts are
    refused before loading. Before, --ip-adapter took one file and --ip-adapter-scale one number."""
    from eqxdiff.cli import generate
    from eqxdiff.pipelines import read_parameters

    ref = build_pipeline(tmp_path / "pipe")
    for name, seed in (("ip", 2), ("ip2", 7)):
        save_ip_adapter(tmp_path / name, ref.unet, seed=seed)
    PICTURE.save(tmp_path / "picture.png")
    OTHER.save(tmp_path / "other.png")
    adapters = [tmp_path / name / "ip-adapter.safetensors" for name in ("ip", "ip2")]
    argv = ["--model", str(tmp_path / "pipe"), "--prompt", "a red cat", "--height", "32", "--width", "32",
            "--num-inference-steps", "2", "--seed", "0"]
    ip = ["--ip-adapter", str(adapters[0]), "--ip-adapter", str(adapters[1]),
          "--ip-adapter-image", str(tmp_path / "picture.png"), "--ip-adapter-image", str(tmp_path / "other.png")]
    scales = ["--ip-adapter-scale", "0.6", "--ip-adapter-scale", "0.3"]
    paths = generate.main([*argv, *ip, *scales, "--output-dir", str(tmp_path / "out")])
    params = read_parameters(paths[0])
    assert params["ip_adapter"] == [str(a) for a in adapters] and params["ip_adapter_scale"] == [0.6, 0.3]
    pipe = eqxdiff.load_pipeline(tmp_path / "pipe")
    pipe.load_ip_adapter([tmp_path / "ip", tmp_path / "ip2"], weight_name="ip-adapter.safetensors")
    pipe.set_ip_adapter_scale([0.6, 0.3])
    expected = pipe("a red cat", height=32, width=32, num_inference_steps=2, seed=0, progress=False,
                    ip_adapter_image=[Image.open(tmp_path / "picture.png"), Image.open(tmp_path / "other.png")])
    np.testing.assert_array_equal(np.asarray(Image.open(paths[0]).convert("RGB")), expected[0])
    masks = ["--ip-adapter-mask", str(tmp_path / "picture.png")] * 2
    checked = generate.validate([*argv, *ip, *masks]).kwargs
    assert len(checked["ip_adapter_masks"]) == 2 and all(len(m) == 1 for m in checked["ip_adapter_masks"])
    for extra, match in [
        (ip[:6], r"--ip-adapter-image given 1 time\(s\) for 2 --ip-adapter: give one per adapter"),
        ([*ip, *masks[:2]], r"--ip-adapter-mask given 1 time\(s\) for 2 --ip-adapter"),
        ([*ip, *scales, *scales[:2]], "--ip-adapter-scale given 3 times for 2 --ip-adapter"),
        (scales, "--ip-adapter-scale needs --ip-adapter"),
    ]:
        with pytest.raises(InputError, match=match):
            generate.validate([*argv, *extra])


def test_controlnet_takes_the_adapter_as_diffusers(tmp_path):
    """A ControlNet pipeline with an IP-Adapter: the UNet reads the image tokens, the net the text alone, as in
    diffusers' StableDiffusionControlNetPipeline (within 2/255, guidance on), here with two images on the adapter (the
    net strips both images' tokens). Before, the ControlNet pipelines refused the adapter; with the image tokens left
    in the net's context the images are off (the net reads them as text)."""
    from . import _tiny_controlnet as tiny

    ref = tiny.build_sd(tmp_path / "cn", tiny.controlnet(tiny.SD_PIPE_CONTROLNET, 11))
    save_ip_adapter(tmp_path / "ip", ref.unet)
    ref.load_ip_adapter(str(tmp_path / "ip"), subfolder="", weight_name="ip-adapter.safetensors")
    pipe = eqxdiff.load_pipeline(tmp_path / "cn")
    pipe.load_ip_adapter(tmp_path / "ip", weight_name="ip-adapter.safetensors")
    control = tiny.control_images(1, 32, seed=3)
    latents = np.random.default_rng(1).standard_normal((1, 16, 16, 4)).astype(np.float32)
    with torch.no_grad():
        expected = ref("a red cat", image=torch.from_numpy(control).permute(0, 3, 1, 2).float() / 255,
                       latents=nhwc_to_nchw(latents), output_type="np", ip_adapter_image=[[PICTURE, OTHER]],
                       **STEPS).images
    ours = pipe("a red cat", image=control, latents=latents, ip_adapter_image=[[PICTURE, OTHER]], progress=False,
                **STEPS)
    assert _max_pixel_diff(ours, expected) <= 2


def test_the_refiner_call_gets_no_ip_adapter_image():
    """eqxdiff-generate --ip-adapter with --refiner: the adapter is on the --model pipeline alone, so the refiner's
    call (SDXL img2img, which takes ip_adapter_image and ip_adapter_masks) is handed neither (before, its pre-load
    check refused the command: no IP-Adapter loaded on the refiner)."""
    from eqxdiff.cli._compose import refiner_kwargs

    flags = ["prompt", "num_inference_steps", "ip_adapter_image", "ip_adapter_masks", "image"]
    out = refiner_kwargs(flags, {"prompt": "a cat", "num_inference_steps": 4, "ip_adapter_image": "face.png",
                                 "ip_adapter_masks": [["mask.png"]]}, None)
    assert out == {"prompt": "a cat", "num_inference_steps": 4, "image": None}
