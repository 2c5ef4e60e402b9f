"""IP-Adapter masks (diffusers' ``cross_attention_kwargs={"ip_adapter_masks": ...}``, eqxdiff's ``ip_adapter_masks=``)
and per-image scales on the Stable Diffusion and SDXL pipelines against diffusers, float32, tiny random pipelines and
adapters, guidance on, the same initial latents; the mask resizing against ``IPAdapterMaskProcessor``."""

import contextlib
import warnings

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from eqxdiff.models import ip_adapter as ipa
from eqxdiff.pipelines import InputError, InputTypeError, downsample_mask, prepare_ip_adapter_masks
from eqxdiff.pipelines import _ip_adapter_masks as masks_module
from eqxdiff.pipelines._ip_adapter_masks import as_adapter_masks

from ._util import nhwc_to_nchw
from .test_ip_adapter_pipeline import (
    OTHER,
    PICTURE,
    STEPS,
    _max_pixel_diff,
    _ours,
    _reference,
    adapted_pipes,
    second_adapter,
)
from .test_recompile import no_compile


def _mask_image(size, box, kind="rectangle") -> Image.Image:
    image = Image.new("L", size, 0)
    getattr(ImageDraw.Draw(image), kind)(box, fill=255)
    return image


LEFT = _mask_image((32, 32), (0, 0, 17, 31))
DISC = _mask_image((32, 32), (6, 4, 30, 26), "ellipse")
WIDE = _mask_image((40, 24), (10, 0, 30, 16))


def _processed(images, height=32, width=32):
    """diffusers' masks for one adapter: ``IPAdapterMaskProcessor().preprocess`` reshaped to ``[1, n, h, w]``."""
    from diffusers.image_processor import IPAdapterMaskProcessor

    masks = IPAdapterMaskProcessor().preprocess(images, height=height, width=width)
    return masks.reshape(1, masks.shape[0], masks.shape[2], masks.shape[3])


def test_downsample_matches_diffusers():
    """:func:`downsample_mask` against ``IPAdapterMaskProcessor.downsample`` (torch's bicubic, the grid arithmetic,
    the zero padding or cut of another aspect) within 1e-6; :func:`prepare_ip_adapter_masks` is its preprocess."""
    from diffusers.image_processor import IPAdapterMaskProcessor

    rng = np.random.default_rng(0)
    for h, w in [(32, 32), (40, 48), (64, 32), (17, 53), (1024, 1024), (768, 512)]:
        for queries in [4, 24, 64, 80, 96, 256, 1024, 4096]:
            mask = (rng.random((h, w)) > 0.5).astype(np.float32)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # diffusers' aspect warning
                expected = IPAdapterMaskProcessor.downsample(torch.from_numpy(mask)[None], 1, queries, 1)[0, :, 0]
            np.testing.assert_allclose(downsample_mask(mask, queries), expected.numpy(), rtol=0, atol=1e-6,
                                       err_msg=f"{h} x {w} mask, {queries} queries")
    for images, size in (([LEFT, DISC], (32, 32)), ([WIDE], (40, 24)), ([DISC.convert("RGB")], (30, 45))):
        np.testing.assert_array_equal(prepare_ip_adapter_masks(images, height=size[0], width=size[1]),
                                      _processed(images, *size).numpy())


def test_value_masks_match_diffusers():
    """Masks given as float arrays or torch tensors (values in [0, 1], diffusers' nearest resize) as
    ``IPAdapterMaskProcessor().preprocess`` makes them. Found by the masks fuzz: a float array was made into a PIL
    image (all 0 after the 0.5 threshold) and a tensor was refused."""
    values = np.random.default_rng(1).random((33, 17)).astype(np.float32)
    for given in ([values, values[::-1]], [values[..., None]], [torch.from_numpy(values)[None]]):
        for size in ((32, 32), (40, 24), (36, 30)):
            np.testing.assert_array_equal(prepare_ip_adapter_masks(given, height=size[0], width=size[1]),
                                          _processed(given, *size).numpy())


@pytest.fixture(scope="module", params=["sd", "sdxl"])
def pipes(request, tmp_path_factory):
    """(diffusers pipeline, eqxdiff pipeline, the adapter's folder), the same random IP-Adapter on each."""
    return adapted_pipes(request.param, tmp_path_factory.mktemp(f"ipmask_{request.param}"))


def _both(ref, pipe, latents, scale, masks, images=((PICTURE, OTHER),)):
    """(ours, diffusers') images with ``masks`` (a list per adapter of torch masks or None) at ``scale``."""
    images = [list(i) if isinstance(i, tuple) else i for i in images]
    ref.set_ip_adapter_scale(scale)
    pipe.set_ip_adapter_scale(scale)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # diffusers' aspect warning
        expected = _reference(ref, latents, ip_adapter_image=images, cross_attention_kwargs={"ip_adapter_masks": masks})
    ours = _ours(pipe, latents, ip_adapter_image=images,
                 ip_adapter_masks=[None if m is None else m.numpy() for m in masks])
    return ours, expected


def test_masks_and_per_image_scales_match_diffusers(pipes):
    """One adapter, two images, two masks, one scale per image: each image attended alone and weighted by its mask
    at every resolution, as diffusers. Then new masks (another aspect too) and new scales compile nothing; diffusers'
    cross_attention_kwargs gives the argument's images. Before, eqxdiff refused the masks by name."""
    ref, pipe, _ = pipes
    latents = np.random.default_rng(0).standard_normal((2, 16, 16, 4)).astype(np.float32)
    masks = _processed([LEFT, DISC])
    ours, expected = _both(ref, pipe, latents, [[0.7, 0.4]], [masks])
    assert _max_pixel_diff(ours, expected) <= 2
    unmasked = _ours(pipe, latents, ip_adapter_image=[[PICTURE, OTHER]], ip_adapter_masks=[np.ones_like(masks)])
    assert np.abs(unmasked.astype(int) - ours.astype(int)).max() > 2  # the masks matter
    given = pipe("a red cat", latents=latents, height=32, width=32, num_images_per_prompt=2, progress=False,
                 ip_adapter_image=[[PICTURE, OTHER]], cross_attention_kwargs={"ip_adapter_masks": [masks.numpy()]},
                 **STEPS)
    np.testing.assert_array_equal(given, ours)
    wide = _processed([WIDE, DISC], height=24, width=40)  # another aspect than the output's: the zero-padded path
    for scale, other in (([[0.9, 0.2]], _processed([DISC, LEFT])), (0.6, wide)):
        with no_compile("a new mask or scale"):
            ours, expected = _both(ref, pipe, latents, scale, [other])
        assert _max_pixel_diff(ours, expected) <= 2


def test_per_image_scales_in_a_per_block_dict_match_diffusers(pipes):
    """diffusers' per-image scales inside a per-block dict: a part's list (every block of it), a block's list, the
    mid block's, the other layers 0 (or a number for every image), as values (new ones compile nothing). Before,
    eqxdiff refused them by name."""
    ref, pipe, _ = pipes
    latents = np.random.default_rng(5).standard_normal((2, 16, 16, 4)).astype(np.float32)
    masks = [_processed([LEFT, DISC])]
    up = sorted({b for part, b, _ in ipa.cross_attention_blocks(pipe.unet) if part == "up"})
    scales = ({"down": [[0.7, 0.2]], "mid": [[0.3, 0.9]], "up": {f"block_{up[-1]}": [[0.1, 0.8]]}},
              {"up": {f"block_{up[0]}": [[0.9, 0.5]]}, "mid": 0.6})
    for i, scale in enumerate(scales):  # the second: new values, compiles nothing
        with no_compile("new per-image scales in a dict") if i else contextlib.nullcontext():
            ours, expected = _both(ref, pipe, latents, scale, masks)
        assert _max_pixel_diff(ours, expected) <= 2, scale
    plain, _ = _both(ref, pipe, latents, 0.5, masks)
    assert np.abs(plain.astype(int) - ours.astype(int)).max() > 2  # the per-block per-image scales matter
    with pytest.raises(InputError, match=r"per-image scales have \[2, 3\] entries in different layers"):
        pipe.set_ip_adapter_scale({"down": [[0.7, 0.2]], "mid": [[0.3, 0.9, 0.1]]})


def test_a_mask_per_row_matches_diffusers(pipes):
    """A mask entry with one row per row of the UNet's batch (guidance: [negative; positive], 2 images per prompt:
    4 rows), each row its own masks, as diffusers' attention reads them; 2 rows (per image, without guidance's
    halves), on which diffusers fails, are refused naming the counts. Before, any first dim but 1 was refused."""
    ref, pipe, _ = pipes
    latents = np.random.default_rng(7).standard_normal((2, 16, 16, 4)).astype(np.float32)
    pairs = ([LEFT, DISC], [DISC, LEFT], [LEFT, LEFT], [DISC, DISC])
    per_row = torch.cat([_processed(list(pair)) for pair in pairs])
    ours, expected = _both(ref, pipe, latents, [[0.8, 0.5]], [per_row])
    assert _max_pixel_diff(ours, expected) <= 2
    one, _ = _both(ref, pipe, latents, [[0.8, 0.5]], [per_row[:1]])
    assert np.abs(one.astype(int) - ours.astype(int)).max() > 2  # the rows matter
    with pytest.raises(InputError, match=r"ip_adapter_masks\[0\] has 2 rows for the UNet's batch of 4"):
        _ours(pipe, latents, ip_adapter_image=[[PICTURE, OTHER]], ip_adapter_masks=[per_row[:2].numpy()])


def test_two_adapters_one_masked_match_diffusers(pipes):
    """Two adapters, the first unmasked (its image attended as before) and the second's two images masked."""
    ref, pipe, source = pipes
    with second_adapter(ref, pipe, source):
        latents = np.random.default_rng(4).standard_normal((2, 16, 16, 4)).astype(np.float32)
        ours, expected = _both(ref, pipe, latents, [0.5, [0.8, 0.6]], [None, _processed([DISC, LEFT])],
                               images=[PICTURE, (OTHER, PICTURE)])
        assert _max_pixel_diff(ours, expected) <= 2


def test_bad_masks_name_the_fix(pipes):
    _, pipe, _ = pipes
    masks = _processed([LEFT, DISC]).numpy()
    call = dict(ip_adapter_image=[[PICTURE, OTHER]])
    pipe.set_ip_adapter_scale(1.0)
    with pytest.raises(InputError, match=r"2 entries for 1 IP-Adapter\(s\).*None for an adapter without a mask"):
        _ours(pipe, None, ip_adapter_masks=[masks, masks], **call)
    with pytest.raises(InputError, match=r"ip_adapter_masks\[0\] has shape \(2, 32, 32\); each entry is \[1, images"):
        _ours(pipe, None, ip_adapter_masks=[masks[0]], **call)
    with pytest.raises(InputError, match="holds 2 masks for the adapter's 1 image"):
        _ours(pipe, None, ip_adapter_masks=[masks], ip_adapter_image=PICTURE)
    with pytest.raises(InputTypeError, match="ip_adapter_masks given both as an argument and in cross_attention_kw"):
        _ours(pipe, None, ip_adapter_masks=[masks], cross_attention_kwargs={"ip_adapter_masks": [masks]}, **call)
    pipe.set_ip_adapter_scale([[0.5, 0.5]])
    try:
        with pytest.raises(InputError, match=r"one scale per image \(\[0.5, 0.5\]\).*masked images only"):
            _ours(pipe, None, **call)
        with pytest.raises(InputError, match="2 per-image scales for 1 masked image"):
            _ours(pipe, None, ip_adapter_masks=[masks[:, :1]], ip_adapter_image=PICTURE)
        pipe.set_ip_adapter_scale({"down": [[0.5, 0.6]]})  # per-image scales in some layers: masks needed there too
        with pytest.raises(InputError, match=r"one scale per image \(\[0.5, 0.6\]\).*masked images only"):
            _ours(pipe, None, **call)
        pipe.set_ip_adapter_scale({"down": [[0.0, 0.0]]})  # all 0: diffusers skips those layers, no mask needed
        pipe.check_ip_adapter_arguments(call)
    finally:
        pipe.set_ip_adapter_scale(1.0)
    plain = type(pipe).from_pipe(pipe)
    plain.unload_ip_adapter()
    with pytest.raises(InputError, match="ip_adapter_masks: no IP-Adapter is loaded"):
        _ours(plain, None, ip_adapter_masks=[masks])
    # diffusers' older form, one tensor [adapters, 1, h, w]: one mask per adapter
    (one,) = as_adapter_masks(torch.from_numpy(masks[0][:, None]), 2)[1:]
    np.testing.assert_array_equal(one, masks[:, 1:])
    with pytest.raises(InputError, match=r"ip_adapter_masks of shape \(2, 32, 32\): give a list"):
        as_adapter_masks(masks[0], 2)


def test_image_to_image_takes_the_masks_as_diffusers(pipes, monkeypatch):
    """Image-to-image (diffusers' img2img class on the same components) runs the same masks, resolved once in the
    call (by its check)."""
    ref, pipe, _ = pipes
    if "XL" in type(pipe).__name__:
        pytest.skip("one pipeline suffices: the call is the one above")
    from diffusers.pipelines.stable_diffusion import pipeline_stable_diffusion_img2img as module

    img2img = module.StableDiffusionImg2ImgPipeline(**ref.components, requires_safety_checker=False)
    img2img.set_progress_bar_config(disable=True)
    rng = np.random.default_rng(2)
    clean = rng.standard_normal((1, 16, 16, 4)).astype(np.float32)
    noise = rng.standard_normal((2, 16, 16, 4)).astype(np.float32)
    monkeypatch.setattr(module, "randn_tensor", lambda *a, **k: nhwc_to_nchw(noise))
    masks = _processed([DISC, LEFT])
    ref.set_ip_adapter_scale([[0.9, 0.5]])
    pipe.set_ip_adapter_scale([[0.9, 0.5]])
    images = [[PICTURE, OTHER]]
    with torch.no_grad():
        expected = np.asarray(img2img("a red cat", image=nhwc_to_nchw(clean), strength=0.7, output_type="np",
                                      num_images_per_prompt=2, ip_adapter_image=images,
                                      cross_attention_kwargs={"ip_adapter_masks": [masks]}, **STEPS).images)
    convert, converted = masks_module.host_array, []
    monkeypatch.setattr(masks_module, "host_array", lambda *a: converted.append(a) or convert(*a))
    ours = pipe("a red cat", image=clean, latents=noise, strength=0.7, num_images_per_prompt=2,
                ip_adapter_image=images, ip_adapter_masks=[masks.numpy()], progress=False, **STEPS)
    assert _max_pixel_diff(ours, expected) <= 2
    assert len(converted) == 1  # resolved once, by the call's check (the conditioning takes them as they are)


def test_generate_takes_masks(pipes, tmp_path):
    """eqxdiff-generate's --ip-adapter-mask, repeated like --ip-adapter-image: the one adapter's mask files, made
    into masks at the output size by the call (as IPAdapterMaskProcessor reads the files there); refused without
    --ip-adapter."""
    from eqxdiff.cli import generate

    _, pipe, folder = pipes
    if "XL" in type(pipe).__name__:
        pytest.skip("one pipeline suffices: the flags are the UNet pipelines' own")
    files = []
    for name, image in (("picture", PICTURE), ("other", OTHER), ("left", LEFT), ("wide", WIDE)):
        image.save(tmp_path / f"{name}.png")
        files.append(str(tmp_path / f"{name}.png"))
    argv = ["--model", str(folder.parent / "pipe"), "--prompt", "a red cat", "--height", "32", "--width", "32"]
    masks = ["--ip-adapter-mask", files[2], "--ip-adapter-mask", files[3]]
    kwargs = generate.validate([*argv, "--ip-adapter", str(folder / "ip-adapter.safetensors"), "--ip-adapter-image",
                                files[0], "--ip-adapter-image", files[1], *masks]).kwargs
    (read,) = kwargs["ip_adapter_masks"]
    assert [np.asarray(x).tolist() for x in read] == [np.asarray(Image.open(f).convert("RGB")).tolist()
                                                       for f in files[2:]]
    latents = np.random.default_rng(5).standard_normal((2, 16, 16, 4)).astype(np.float32)
    pipe.set_ip_adapter_scale([[0.8, 0.6]])
    try:
        expected = _ours(pipe, latents, ip_adapter_image=[[PICTURE, OTHER]],
                         ip_adapter_masks=[prepare_ip_adapter_masks([LEFT, WIDE], height=32, width=32)])
        with no_compile("masks from files"):
            ours = _ours(pipe, latents, ip_adapter_image=kwargs["ip_adapter_image"], ip_adapter_masks=[read])
    finally:
        pipe.set_ip_adapter_scale(1.0)
    np.testing.assert_array_equal(ours, expected)
    with pytest.raises(InputError, match="--ip-adapter-masks needs --ip-adapter"):
        generate.validate([*argv, *masks])
