"""The LTX-Video pipelines end to end against diffusers 0.42 in float32 (every pixel within 2/255 from the same initial
latents): text-to-video with guidance_rescale and the timestep-conditioned decoder (decode_timestep, and
decode_noise_scale with diffusers' noise replaced by eqxdiff's draw), image-to-video (the image's latents sampled with
the same posterior noise on both sides), image conditions at frame 0 and at a later index, video-clip conditions at
frame 0 and at a later index, the two-stage recipe's upsampling and refinement, then eqxdiff-generate's MP4 and the
errors. Prompts go
through a character tokenizer saved in the folder (both sides tokenize alike) and a tiny T5.

One tiny folder (tests/_tiny_ltx.py: the 0.9.5 VAE, 16x spatial and 8x temporal, random latent statistics) is built
for the module; every video has 9 frames of 32x32 pixels (2 latent frames of 2x2; the clips' test 25) and every call
3 steps, so the calls of a pipeline share their compiled programs.
"""

import diffusers
import jax
import numpy as np
import pytest
import torch
from diffusers.models.autoencoders import vae as autoencoder_vae
from diffusers.pipelines.ltx import pipeline_ltx, pipeline_ltx_condition
from diffusers.pipelines.ltx.pipeline_ltx_condition import (
    LTXVideoCondition as RefCondition,
)
from PIL import Image

import eqxdiff
from eqxdiff.cli import generate
from eqxdiff.loading import SafetensorsFile, convert_tensors, formats, inverse, state_dict, write_safetensors
from eqxdiff.pipelines import InputError, read_parameters, read_video, save_single_file, write_video
from eqxdiff.pipelines._latents import noise_draws
from eqxdiff.pipelines.ltx import LTXPipeline, decode_keys
from eqxdiff.pipelines.ltx_condition import LTXConditionPipeline, LTXVideoCondition, condition_keys
from eqxdiff.pipelines.ltx_i2v import LTXImageToVideoPipeline
from eqxdiff.pipelines.ltx_upsample import LTXLatentUpsamplePipeline

from . import _tiny_ltx as tiny
from ._util import assert_close

PROMPTS = ["a red cat", "two dogs"]
NEGATIVES = ["blurry", ""]
VIDEO = dict(height=32, width=32, num_frames=9, num_inference_steps=3, max_sequence_length=16)
SHAPE = (2, 2, 2, 2, 8)  # latents of two 9-frame 32x32 videos: [n, T, h, w, C]


def pixels_off(ours_uint8, ref_float) -> int:
    return int(np.max(np.abs(ours_uint8.astype(int) - (np.asarray(ref_float) * 255).round().astype(int))))


def noise(shape=SHAPE, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def ncthw(latents) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(np.asarray(latents), -1, 1)))


def packed(latents) -> torch.Tensor:
    """Channels-last latents as diffusers' packed tokens (patch 1: a reshape)."""
    latents = np.asarray(latents)
    return torch.from_numpy(np.ascontiguousarray(latents.reshape(latents.shape[0], -1, latents.shape[-1])))


def picture(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def ltx(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ltx")
    return tiny.build_pipeline(folder), eqxdiff.load_pipeline(folder), folder


@pytest.fixture(scope="module")
def i2v(ltx):
    ref, pipe, _ = ltx
    return diffusers.LTXImageToVideoPipeline(**ref.components), LTXImageToVideoPipeline.from_pipe(pipe)


# -- parity with diffusers ------------------------------------------------------------------------------------------


def test_text_to_video_matches_diffusers(ltx, monkeypatch):
    """Two prompts with negatives, guidance_rescale, the decoder at decode_timestep 0.05 with no noise mixed in; then
    with decode_noise_scale 0.025, diffusers' decode noise being eqxdiff's draw from the call's key; then diffusers'
    embeddings as prompt_embeds with their masks."""
    ref, pipe, _ = ltx
    assert type(pipe) is LTXPipeline and pipe.vae.config.timestep_conditioning and pipe.default_fps == 25
    x = noise()
    kwargs = dict(guidance_scale=3.0, guidance_rescale=0.5, decode_timestep=0.05, **VIDEO)
    with torch.no_grad():
        expected = ref(PROMPTS, negative_prompt=NEGATIVES, latents=packed(x), decode_noise_scale=0.0,
                       output_type="np", **kwargs).frames
    ours = pipe(PROMPTS, negative_prompt=NEGATIVES, latents=x, decode_noise_scale=0.0, seed=3, progress=False,
                **kwargs)
    assert ours.shape == (2, 9, 32, 32, 3) and ours.dtype == np.uint8
    assert pixels_off(ours, expected) <= 2 and np.std(ours) > 1

    decode_noise = ncthw(jax.random.normal(decode_keys(jax.random.key(3))[0], SHAPE))
    monkeypatch.setattr(pipeline_ltx, "randn_tensor", lambda shape, **_: decode_noise)
    with torch.no_grad():
        noised = ref(PROMPTS, negative_prompt=NEGATIVES, latents=packed(x), decode_noise_scale=0.025,
                     output_type="np", **kwargs).frames
    ours_noised = pipe(PROMPTS, negative_prompt=NEGATIVES, latents=x, decode_noise_scale=0.025, seed=3,
                       progress=False, **kwargs)
    assert pixels_off(ours_noised, noised) <= 2 and pixels_off(ours_noised, ours / 255) > 2

    with torch.no_grad():
        embeds, mask, negative, negative_mask = ref.encode_prompt(PROMPTS, NEGATIVES, max_sequence_length=16)
    given = pipe(prompt_embeds=embeds.numpy(), prompt_attention_mask=mask.numpy(),
                 negative_prompt_embeds=negative.numpy(), negative_prompt_attention_mask=negative_mask.numpy(),
                 latents=x, decode_noise_scale=0.0, progress=False, **kwargs)
    assert pixels_off(given, expected) <= 2
    assert_close(pipe.encode_prompt(PROMPTS, max_sequence_length=16).embeds, embeds.numpy(), 1e-4, "T5 embeddings (unmasked)")


def test_image_to_video_matches_diffusers(i2v):
    """The image's latents (the VAE's posterior sampled with eqxdiff's draw, normalised) on the first latent frame,
    timestep 0 on its tokens, the frames after it stepped. diffusers takes those start latents as given; the image's
    encoding is compared through them."""
    ref, pipe = i2v
    image, x, key = picture(1), noise(seed=2), jax.random.key(4)
    eps = ncthw(noise_draws(key, SHAPE).image[:, :1])
    with torch.no_grad():
        pixels = torch.from_numpy(image).permute(2, 0, 1)[None, :, None].float() / 127.5 - 1
        posterior = ref.vae.encode(pixels).latent_dist
        first = ref._normalize_latents(posterior.mean + posterior.std * eps, ref.vae.latents_mean,
                                       ref.vae.latents_std)
    start = x.copy()
    start[:, :1] = np.moveaxis(first.numpy(), 1, -1)
    kwargs = dict(guidance_scale=3.0, decode_timestep=0.05, decode_noise_scale=0.0, **VIDEO)
    with torch.no_grad():
        expected = ref(image=Image.fromarray(image), prompt=PROMPTS, negative_prompt=NEGATIVES, latents=packed(start),
                       output_type="np", **kwargs).frames
    ours = pipe(image, PROMPTS, negative_prompt=NEGATIVES, latents=x, key=key, progress=False, **kwargs)
    assert ours.shape == (2, 9, 32, 32, 3) and pixels_off(ours, expected) <= 2

    # one image per prompt (diffusers encodes each; it broadcasts one): each prompt's video starts from its own
    images = np.stack([image, picture(5)])
    with torch.no_grad():
        posterior = ref.vae.encode(torch.from_numpy(images).permute(0, 3, 1, 2)[:, :, None].float() / 127.5 - 1)
        first = ref._normalize_latents(posterior.latent_dist.mean + posterior.latent_dist.std * eps,
                                       ref.vae.latents_mean, ref.vae.latents_std)
        start[:, :1] = np.moveaxis(first.numpy(), 1, -1)
        expected = ref(image=[Image.fromarray(i) for i in images], prompt=PROMPTS, negative_prompt=NEGATIVES,
                       latents=packed(start), output_type="np", **kwargs).frames
    each = pipe(images, PROMPTS, negative_prompt=NEGATIVES, latents=x, key=key, progress=False, **kwargs)
    assert pixels_off(each, expected) <= 2 and pixels_off(each[1:], ours[1:] / 255) > 2


def test_conditions_at_frame_indices_match_diffusers(ltx, monkeypatch):
    """LTXConditionPipeline with one image at frame 0 (strength 1: blended into the first latent frame, re-noised
    before every step by image_cond_noise_scale) and one at frame 8 (strength 0.8: extra tokens before the video's,
    positioned there, blended with noise); the linear-quadratic schedule, guidance_rescale, T5 with the mask, the
    decoder's noise. diffusers' draws (its randn_tensor: the start noise, each condition's posterior sample, the later
    image's blend noise, the re-noising per step, the decode noise) are replaced by eqxdiff's from the call's key,
    each in diffusers' order and checked for shape."""
    ref, pipe, _ = ltx
    ref = diffusers.LTXConditionPipeline(**ref.components)
    pipe = LTXConditionPipeline.from_pipe(pipe)
    key, steps, shape = jax.random.key(5), 3, (1, *SHAPE[1:])  # diffusers' extra tokens are one video's
    posterior, blend, renoise = condition_keys(key)
    latent = (1, 1, 2, 2, 8)  # one image's latents
    draws = [ncthw(noise_draws(key, shape).noise), ncthw(jax.random.normal(jax.random.fold_in(posterior, 0), latent)),
             ncthw(jax.random.normal(jax.random.fold_in(posterior, 1), latent)),
             ncthw(jax.random.normal(jax.random.fold_in(blend, 1), latent))]
    draws += [torch.from_numpy(np.asarray(jax.random.normal(jax.random.fold_in(renoise, j), (1, 4 + 8, 8))))
              for j in range(steps)]
    draws.append(ncthw(jax.random.normal(decode_keys(key)[0], shape)))

    _feed_draws(monkeypatch, draws)
    first, later = picture(6), picture(7)
    kwargs = dict(guidance_scale=3.0, guidance_rescale=0.3, decode_timestep=0.05, decode_noise_scale=0.025,
                  image_cond_noise_scale=0.15, **dict(VIDEO, num_inference_steps=steps))
    conditions = [RefCondition(image=Image.fromarray(first), frame_index=0),
                  RefCondition(image=Image.fromarray(later), frame_index=8, strength=0.8)]
    with torch.no_grad():
        expected = ref(conditions=conditions, prompt=PROMPTS[0], negative_prompt=NEGATIVES[0], output_type="np",
                       **kwargs).frames
    assert not draws, f"{len(draws)} draws left"
    ours = pipe(image=[first, later], frame_index=[0, 8], strength=[1.0, 0.8], prompt=PROMPTS[0],
                negative_prompt=NEGATIVES[0], key=key, progress=False, **kwargs)
    assert ours.shape == (1, 9, 32, 32, 3) and pixels_off(ours, expected) <= 2 and np.std(ours) > 1


def _feed_draws(monkeypatch, draws: list) -> None:
    """diffusers' condition pipeline and VAE draw ``draws`` in order (eqxdiff's), each checked for its shape; the
    list is emptied as they are drawn."""

    def randn_tensor(shape, **_):
        draw = draws.pop(0)
        assert tuple(draw.shape) == tuple(shape), (draw.shape, shape)
        return draw

    monkeypatch.setattr(pipeline_ltx_condition, "randn_tensor", randn_tensor)
    monkeypatch.setattr(autoencoder_vae, "randn_tensor", randn_tensor)


def test_video_clip_conditions_match_diffusers(ltx, monkeypatch):
    """Video clips as conditions of a 25-frame video (4 latent frames; diffusers' LTXVideoCondition(video=...)): one of
    19 frames at frame 0 (cut to 17 = 8k+1: its 3 latent frames blended into the video's first three at strength 1,
    re-noised before every step) and one of 20 frames at frame 8 (cut to the 17 that fit, strength 0.6: its first two
    latent frames extra tokens positioned from frame 8 and blended with noise, its third blended into the video's
    latent frame 3). The clips are the video's size (diffusers' resize is then the identity); diffusers' draws are
    eqxdiff's as in the image conditions' test (start noise, each clip's posterior sample, the later clip's blend
    noise, the re-noising per step, the decode noise)."""
    ref, pipe, _ = ltx
    ref = diffusers.LTXConditionPipeline(**ref.components)
    pipe = LTXConditionPipeline.from_pipe(pipe)
    key, steps, shape = jax.random.key(9), 3, (1, 4, 2, 2, 8)
    posterior, blend, renoise = condition_keys(key)
    clip_latents = (1, 3, 2, 2, 8)  # 17 frames
    draws = [ncthw(noise_draws(key, shape).noise),
             ncthw(jax.random.normal(jax.random.fold_in(posterior, 0), clip_latents)),
             ncthw(jax.random.normal(jax.random.fold_in(posterior, 1), clip_latents)),
             ncthw(jax.random.normal(jax.random.fold_in(blend, 1), (1, 2, 2, 2, 8)))]
    draws += [torch.from_numpy(np.array(jax.random.normal(jax.random.fold_in(renoise, j), (1, 8 + 16, 8))))
              for j in range(steps)]
    draws.append(ncthw(jax.random.normal(decode_keys(key)[0], shape)))

    _feed_draws(monkeypatch, draws)
    rng = np.random.default_rng(10)
    first, later = (rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8) for n in (19, 20))
    kwargs = dict(guidance_scale=3.0, decode_timestep=0.05, decode_noise_scale=0.025, image_cond_noise_scale=0.15,
                  **dict(VIDEO, num_frames=25, num_inference_steps=steps))
    as_pil = [Image.fromarray(f) for f in first]
    conditions = [RefCondition(video=as_pil, frame_index=0),
                  RefCondition(video=[Image.fromarray(f) for f in later], frame_index=8, strength=0.6)]
    with torch.no_grad():
        expected = ref(conditions=conditions, prompt=PROMPTS[0], negative_prompt=NEGATIVES[0], output_type="np",
                       **kwargs).frames
    assert not draws, f"{len(draws)} draws left"
    ours = pipe(conditions=[LTXVideoCondition(video=as_pil), LTXVideoCondition(video=later, frame_index=8,
                                                                                strength=0.6)],
                prompt=PROMPTS[0], negative_prompt=NEGATIVES[0], key=key, progress=False, **kwargs)
    assert ours.shape == (1, 25, 32, 32, 3) and pixels_off(ours, expected) <= 2 and np.std(ours) > 1


def test_two_stages_upsample_and_refine_match_diffusers(ltx, tmp_path, monkeypatch):
    """The two-stage recipe after its first stage (given latents): LTXLatentUpsamplePipeline (a folder of the VAE and
    the upsampler) doubles them with AdaIN to the input's statistics (latents within 1e-4, and decoded), then
    LTXConditionPipeline refines them (denoise_strength 0.5 of 4 steps: the last 2, from the latents noised to the
    schedule's sigma there; diffusers' start and decode noise replaced by eqxdiff's draws)."""
    ref, pipe, _ = ltx
    up_ref = tiny.build_upsampler(tmp_path, ref.vae)
    upsampler = eqxdiff.load_pipeline(tmp_path)
    assert type(upsampler) is LTXLatentUpsamplePipeline
    low, key = noise((1, 2, 2, 2, 8), seed=8), jax.random.key(6)
    with torch.no_grad():
        expected = up_ref(latents=ncthw(low), adain_factor=1.0, output_type="latent").frames
        expected_frames = up_ref(latents=ncthw(low), adain_factor=1.0, decode_timestep=0.05, decode_noise_scale=0.0,
                                 output_type="np").frames
    high = upsampler(latents=low, adain_factor=1.0, output_type="latent")
    assert high.shape == (1, 2, 4, 4, 8)
    assert_close(np.moveaxis(np.asarray(high), -1, 1), expected.numpy(), 1e-4, "upsampled latents")
    frames = upsampler(latents=low, adain_factor=1.0, decode_timestep=0.05, decode_noise_scale=0.0)
    assert frames.shape == (1, 9, 64, 64, 3) and pixels_off(frames, expected_frames) <= 2
    with pytest.raises(InputError, match=r"adain_factor=-1 must be a number in \[0, 10\]"):
        upsampler(latents=low, adain_factor=-1)
    with pytest.raises(InputError, match="pass video= .* or latents="):
        upsampler(video=np.zeros((9, 32, 32, 3), np.uint8), latents=low)
    with pytest.raises(InputError, match=r"latents must be \[n, T, h, w, 8\]"):
        upsampler(latents=low[..., :4])
    # diffusers' height / width (the size it resizes a video to): the input's size, or refused (they were unknown)
    assert np.array_equal(upsampler(latents=low, height=32, width=32, adain_factor=1.0, output_type="latent"), high)
    with pytest.raises(InputError, match=r"width 32, height 128 pixels asked, but latents 2x2 \(x16, the VAE's "
                                         r"factor\) are frames of width 32, height 32 pixels .*output is twice it"):
        upsampler(latents=low, height=128)
    with pytest.raises(InputError, match=r"width 64, height 32 pixels asked, but the video's frames have width 32, "
                                         r"height 32 pixels and eqxdiff does not resize"):
        upsampler(video=[np.zeros((32, 32, 3), np.uint8)] * 9, width=64)

    shape = (1, 2, 4, 4, 8)
    draws = [ncthw(noise_draws(key, shape).noise), ncthw(jax.random.normal(decode_keys(key)[0], shape))]
    monkeypatch.setattr(pipeline_ltx_condition, "randn_tensor", lambda size, **_: draws.pop(0))
    kwargs = dict(height=64, width=64, num_frames=9, num_inference_steps=4, denoise_strength=0.5, guidance_scale=1.0,
                  decode_timestep=0.05, decode_noise_scale=0.025, max_sequence_length=16)
    with torch.no_grad():
        refined_ref = diffusers.LTXConditionPipeline(**ref.components)(
            prompt=PROMPTS[0], latents=expected, output_type="np", **kwargs).frames
    assert not draws
    refined = LTXConditionPipeline.from_pipe(pipe)(prompt=PROMPTS[0], latents=high, key=key, progress=False, **kwargs)
    assert pixels_off(refined, refined_ref) <= 2 and pixels_off(refined, frames / 255) > 2


def test_each_video_reads_its_prompt_through_its_own_mask(ltx):
    """num_videos_per_prompt repeats the embeddings and their masks prompt by prompt alike. diffusers tiles the masks
    (m0, m1, m0, m1 beside p0, p0, p1, p1), a mask bug eqxdiff does not copy (the ltx module docstring says so; this
    fails once diffusers pairs them, and the docstring is then to change)."""
    ref, pipe, _ = ltx
    with torch.no_grad():
        _, ref_mask = ref._get_t5_prompt_embeds(prompt=["a", "two dogs"], num_videos_per_prompt=2,
                                                max_sequence_length=16)
    ours = pipe.encode_prompt(["a", "two dogs"], max_sequence_length=16).repeat(2)
    assert not np.array_equal(np.asarray(ours.mask)[0], np.asarray(ours.mask)[2])
    np.testing.assert_array_equal(np.asarray(ours.mask), np.asarray(ours.mask)[[0, 0, 2, 2]])
    np.testing.assert_array_equal(ref_mask.int().numpy(), np.asarray(ours.mask)[[0, 2, 0, 2]])


def test_vae_tiling_chunks_frames_as_diffusers_at_any_temporal_factor(ltx, tmp_path):
    """enable_vae_tiling()'s default frame windows are diffusers' framewise decoding's: 16 output frames every 8, in
    latent frames at the VAE's temporal factor (2 every 1 at the released 8; a fixed 2 decoded a VAE of factor 4 in
    other windows than diffusers' 4 every 2). A 0.9.0-style VAE of factor 4 (patches of 4: 16x spatial): the
    pipeline's decode equals diffusers' tiled, framewise decode."""
    _, pipe, _ = ltx
    reference = tiny.vae(dict(tiny.VAE_090, patch_size=4, spatio_temporal_scaling=(True, True, False, False),
                              decoder_spatio_temporal_scaling=(True, True, False, False), scaling_factor=0.8))
    reference.save_pretrained(tmp_path)
    tiled = LTXPipeline.from_pipe(pipe, vae=eqxdiff.load(tmp_path))
    assert pipe.default_frame_chunk == 2 and tiled.default_frame_chunk == 4
    tiled.enable_vae_tiling()
    assert tiled.vae_frame_chunk == 4
    z = noise((1, 6, 2, 2, 8), seed=12)  # 21 frames: windows of 4 + 1 latent frames at 0, 2, 4
    ours = tiled.decode(z, key=jax.random.key(0))
    reference.enable_tiling()
    reference.use_framewise_decoding = True
    with torch.no_grad():
        unscaled = diffusers.LTXPipeline._denormalize_latents(ncthw(z), reference.latents_mean, reference.latents_std,
                                                               0.8)
        expected = reference.decode(unscaled).sample.permute(0, 2, 3, 4, 1).numpy()
    assert ours.shape == expected.shape == (1, 21, 32, 32, 3)
    assert_close(ours, expected, 1e-4, "frame-chunked decode vs diffusers' framewise decode")


# -- files, flags, errors -------------------------------------------------------------------------------------------


def test_lightricks_single_file_loads_as_diffusers_from_single_file(ltx, tmp_path):
    """A Lightricks file (the transformer below ``model.diffusion_model.``, the VAE below ``vae.`` in the original
    names, the statistics' three unused entries beside) with config= a diffusers folder: eqxdiff.load_pipeline detects
    the layout and loads exactly the weights diffusers' LTXPipeline.from_single_file loads (the 0.9.1 VAE layout: the
    one diffusers' fixed single-file tables give for the tiny sizes); save_single_file writes every key of the file
    back (the models' tensors equal), and the written file loads in diffusers and in eqxdiff as the original."""
    ref, _, _ = ltx
    folder = tmp_path / "ltx091"
    ref = diffusers.LTXPipeline(**{**ref.components, "vae": tiny.vae(tiny.VAE_091)})
    ref.save_pretrained(folder, safe_serialization=True)
    tensors = {}
    for name, prefix, rules in (("transformer", formats.LTX_DIFFUSION_MODEL, formats.ltx_transformer()),
                                ("vae", formats.LTX_VAE, formats.ltx_vae(ref.vae.config))):
        state = {k: v.detach().numpy() for k, v in getattr(ref, name).state_dict().items()}
        tensors.update({prefix + k: v for k, v in convert_tensors(state, inverse(rules)).items()})
    stats = formats.LTX_VAE + formats.LTX_STATISTICS
    std, mean_of_stds = tensors[stats + "std-of-means"], np.random.default_rng(11).uniform(0.5, 2, 8).astype(np.float32)
    unused = {stats + "channel": np.arange(8, dtype=np.float32), stats + "mean-of-stds": mean_of_stds,
              stats + "mean-of-stds_over_std-of-means": mean_of_stds / std}
    assert set(unused) == {stats + n for n in formats.LTX_UNUSED_STATISTICS}
    tensors.update(unused)
    path = tmp_path / "ltx-video-tiny.safetensors"
    write_safetensors(tensors, path)

    def assert_same_models(ours, expected):
        for name in ("transformer", "vae"):
            theirs = {k: v.numpy() for k, v in getattr(expected, name).state_dict().items()}
            got = state_dict(getattr(ours, name))
            assert set(got) == set(theirs), name
            for key, value in theirs.items():
                np.testing.assert_array_equal(got[key], value, err_msg=f"{name}.{key}")

    def from_single_file(file):
        return diffusers.LTXPipeline.from_single_file(file, config=str(folder), text_encoder=ref.text_encoder,
                                                      tokenizer=ref.tokenizer)

    ours = eqxdiff.load_pipeline(path, config=folder, pipeline_class=LTXConditionPipeline)
    assert type(ours) is LTXConditionPipeline
    assert_same_models(ours, from_single_file(path))
    with pytest.raises(ValueError, match=r"no single-file layout holds exactly a LTXConditionPipeline's models "
                                         r"\['text_encoder', 'transformer', 'vae'\]; pass layout="):
        save_single_file(ours, tmp_path / "written.safetensors")  # Lightricks' files hold no T5
    # written back: every key of the original file, the models' tensors as they were, the entries no loader reads
    # derived (the channel indices as the file's; mean-of-stds, which nobody keeps, ones, and that over std-of-means)
    written_path = save_single_file(ours, tmp_path / "written.safetensors", layout="ltx_lightricks")
    written = SafetensorsFile(written_path)
    assert set(written.names()) == set(tensors)
    for name, value in tensors.items():
        if name not in unused:
            np.testing.assert_array_equal(written.get(name), value, err_msg=name)
    np.testing.assert_array_equal(written.get(stats + "channel"), unused[stats + "channel"])
    np.testing.assert_array_equal(written.get(stats + "mean-of-stds"), np.ones(8, np.float32))
    np.testing.assert_array_equal(written.get(stats + "mean-of-stds_over_std-of-means"), 1 / std)
    # and read again: diffusers' from_single_file of the written file, and eqxdiff's, hold the same weights
    again = eqxdiff.load_pipeline(written_path, config=folder, pipeline_class=LTXConditionPipeline)
    assert_same_models(ours, from_single_file(written_path))
    assert_same_models(again, from_single_file(written_path))
    # the transformer alone without its prefix, and the VAE alone below vae., are layouts too (diffusers' model
    # from_single_file reads both): load_pipeline takes the model from the file, the rest from config=
    bare = {k[len(formats.LTX_DIFFUSION_MODEL):]: v for k, v in tensors.items() if k.startswith("model.")}
    vae_only = {k: v for k, v in tensors.items() if k.startswith(formats.LTX_VAE)}
    for name, part in (("transformer", bare), ("vae", vae_only)):
        one = tmp_path / f"{name}-only.safetensors"
        write_safetensors(part, one)
        cls = getattr(diffusers, type(getattr(ref, name)).__name__)
        theirs = cls.from_single_file(str(one), config=str(folder / name)).state_dict()
        got = state_dict(getattr(eqxdiff.load_pipeline(one, config=folder), name))
        assert set(got) == set(theirs), name
        for key, value in theirs.items():
            np.testing.assert_array_equal(got[key], value.numpy(), err_msg=f"{name}-only file: {key}")


def test_generate_writes_an_mp4_with_its_parameters(ltx, tmp_path, capsys):
    """eqxdiff-generate on the folder: an MP4 of the pipeline's frames at the call's frame_rate, with its parameters; the video flags come from the signature."""
    _, pipe, folder = ltx
    argv = ["--model", str(folder), "--prompt", "a red cat", "--num-frames", "9", "--height", "32", "--width", "32",
            "--steps", "3", "--frame-rate", "24", "--decode-timestep", "0.05", "--seed", "3", "--no-progress",
            "--max-sequence-length", "16", "--num-videos-per-prompt", "2", "--output-dir", str(tmp_path / "out")]
    path, _ = generate.main(argv)  # two videos: the parity tests' compiled programs
    assert path.name == "video_0.mp4"
    frames = read_video(path)
    assert frames.shape == (9, 32, 32, 3)
    ours = pipe("a red cat", seed=3, frame_rate=24, decode_timestep=0.05, num_videos_per_prompt=2, progress=False,
                **VIDEO)[0]
    # the tiny random VAE's frames are pixel noise, which H.264 does not keep: the same frames through the same
    # encoder instead (deterministic), against the file's
    same = read_video(write_video(ours, tmp_path / "ours.mp4", fps=24))
    assert np.max(np.abs(frames.astype(int) - same)) <= 2
    params = read_parameters(path)
    assert params["num_frames"] == 9 and params["fps"] == 24 and params["pipeline"] == "LTXPipeline"
    assert params["decode_timestep"] == 0.05
    with pytest.raises(SystemExit):
        generate.main(["--model", str(folder), "--help"])
    flags = " ".join(capsys.readouterr().out.split())
    for flag in ("--num-frames", "--frame-rate", "--decode-timestep", "--decode-noise-scale", "--guidance-rescale"):
        assert flag in flags, flag


def test_num_frames_sizes_and_inputs_are_refused_in_one_line(ltx, i2v, tmp_path):
    """num_frames 8k+1 and sizes in multiples of the VAE's factor times the patch (32 for the real models, 16 for the
    tiny VAE), through the pipeline and through eqxdiff-generate before loading; the frame rate, the decode values,
    prompt embeddings without masks, an image of another size, the conditions' strengths, frame indices and
    denoise_strength."""
    _, pipe, folder = ltx
    limits = LTXPipeline.folder_limits(lambda name: {"vae": tiny.REAL_VAE_095, "transformer": tiny.LTX_2B}[name.split("/")[0]])
    assert limits.size_factor == 32 and limits.frame_factor == 8
    with pytest.raises(InputError, match=r"num_frames=80 must be 8k\+1 .*compresses time by 8.*; try 73 or 81"):
        pipe("a cat", num_frames=80, progress=False)
    with pytest.raises(InputError, match=r"height=40 must be a multiple of 16 \(the VAE downsamples by 16 and the "
                                         r"transformer takes 1x1 patches\); try height=32"):
        pipe("a cat", height=40, progress=False)
    with pytest.raises(InputError, match=r"--num-frames 10 must be 8k\+1 .*; try 9 or 17"):
        generate.validate(["--model", str(folder), "--prompt", "x", "--num-frames", "10"])
    with pytest.raises(InputError, match=r"frame_rate=0 must be a positive number"):
        pipe("a cat", frame_rate=0, progress=False, **VIDEO)
    with pytest.raises(InputError, match="decode_timestep has 3 values for 2 videos"):
        pipe(PROMPTS, decode_timestep=[0.1, 0.2, 0.3], progress=False, **VIDEO)
    with pytest.raises(InputError, match="prompt_embeds needs prompt_attention_mask"):
        pipe(prompt_embeds=np.zeros((1, 4, 16), np.float32), progress=False, **VIDEO)
    # the negative prompt is encoded at max_sequence_length (the tiny folder's 16) as diffusers does, not at 4
    four = dict(prompt_embeds=np.zeros((1, 4, 16), np.float32), prompt_attention_mask=np.ones((1, 4), np.int32))
    with pytest.raises(InputError, match=r"negative embeddings of shape \(1, 16, 16\) \(the negative prompt encoded at "
                                         r"max_sequence_length=16\) for prompt embeddings of shape \(1, 4, 16\) "
                                         r"\(prompt_embeds\).*pass max_sequence_length=4"):
        pipe(**four, guidance_scale=3.0, progress=False, **VIDEO)
    with pytest.raises(InputError, match=r"negative embeddings of shape \(1, 5, 16\) \(negative_prompt_embeds\) for "
                                         r"prompt embeddings of shape \(1, 4, 16\).*negative_prompt_attention_mask"):
        pipe(**four, negative_prompt_embeds=np.zeros((1, 5, 16), np.float32),
             negative_prompt_attention_mask=np.ones((1, 5), np.int32), guidance_scale=3.0, progress=False, **VIDEO)
    with pytest.raises(InputError, match="image has width 32, height 32 pixels but the video has width 64"):
        i2v[1](picture(0), "a cat", progress=False, **dict(VIDEO, width=64))
    with pytest.raises(InputError, match="pass image="):
        i2v[1](prompt="a cat", progress=False)
    with pytest.raises(InputError, match=r"image holds 3 images for 2 prompts; pass one picture \(it conditions every "
                                         r"video\) or one per prompt"):
        i2v[1](np.stack([picture(0)] * 3), PROMPTS, progress=False, **VIDEO)
    with pytest.raises(InputError, match=r"image holds 2 images; pass one picture"):
        i2v[1](np.stack([picture(0)] * 2), "a cat", num_videos_per_prompt=2, progress=False, **VIDEO)
    condition = LTXConditionPipeline.from_pipe(pipe)
    with pytest.raises(InputError, match=r"strength=\[1.0, 1.5\]: give numbers in \[0, 1\]"):
        condition(image=[picture(0)] * 2, strength=[1.0, 1.5], prompt="a cat", progress=False, **VIDEO)
    with pytest.raises(InputError, match="frame_index has 3 values for 2 conditions"):
        condition(image=[picture(0)] * 2, frame_index=[0, 4, 8], prompt="a cat", progress=False, **VIDEO)
    with pytest.raises(InputError, match="frame_index=9 lies outside the video's 9 frames"):
        condition(image=picture(0), frame_index=9, prompt="a cat", progress=False, **VIDEO)
    with pytest.raises(InputError, match=r"denoise_strength=0.1 of 3 steps leaves no step to run"):
        condition(prompt="a cat", latents=np.zeros(SHAPE[1:], np.float32)[None], denoise_strength=0.1,
                  progress=False, **VIDEO)
