"""Textual inversion against diffusers' ``load_textual_inversion``: the same embedding files (a diffusers folder's
multi-vector ``learned_embeds.safetensors``, an A1111 ``emb_params`` file with its token, an array with a token per
row) loaded into the tiny SD pipeline give the same converted prompts and the same text embeddings (the call's
path); SDXL's two encoders take a file's ``clip_l`` / ``clip_g`` as diffusers' documented calls do; unloading gives
back the pipeline's own embeddings; bad files and tokens are refused naming the fix."""

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

import eqxdiff
from eqxdiff.loading import CheckpointError
from eqxdiff.pipelines._denoise import Guidance

from . import _lora_files as lora_files
from . import _tiny_sdxl
from ._tiny_sd import build_pipeline

PROMPTS = ["a <cat> b", "<style> and <cat>", "cd <row1> <row0>", "plain"]


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sd")
    return build_pipeline(folder), folder


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("ti")
    rng = np.random.default_rng(0)
    (root / "cat").mkdir()
    save_file({"<cat>": rng.normal(size=(3, 32)).astype(np.float32)}, root / "cat" / "learned_embeds.safetensors")
    save_file({"emb_params": rng.normal(size=(1, 32)).astype(np.float32)}, root / "style.safetensors")
    rows = rng.normal(size=(2, 32)).astype(np.float32)
    return root, rows


def _ours(pipe, prompts):
    return np.asarray(pipe.embed(prompts, [], guidance=Guidance(1.0)))


def _theirs(ref, prompts):
    with torch.no_grad():
        return ref.encode_prompt(prompts, "cpu", 1, False)[0].numpy()


def _load_all(pipe, root, rows):
    pipe.load_textual_inversion(str(root / "cat"))
    pipe.load_textual_inversion(str(root / "style.safetensors"), token="<style>")
    pipe.load_textual_inversion(rows if isinstance(pipe, eqxdiff.pipelines.DiffusionPipeline)
                                else torch.from_numpy(rows), token=["<row0>", "<row1>"])


def test_embeddings_load_save_and_unload_as_diffusers(sd, files, tmp_path):
    ref, folder = sd
    root, rows = files
    pipe = eqxdiff.load_pipeline(folder)
    plain = _ours(pipe, PROMPTS[3:])
    _load_all(ref, root, rows)
    _load_all(pipe, root, rows)
    assert pipe.maybe_convert_prompt(PROMPTS, pipe.tokenizer) == ref.maybe_convert_prompt(PROMPTS, ref.tokenizer)
    assert pipe.maybe_convert_prompt("a <cat>", pipe.tokenizer) == "a <cat> <cat>_1 <cat>_2"
    assert pipe.text_encoder.config.vocab_size == len(ref.tokenizer) == len(pipe.tokenizer)
    theirs = _theirs(ref, PROMPTS)
    np.testing.assert_allclose(_ours(pipe, PROMPTS), theirs, rtol=1e-4, atol=1e-5)
    saved = pipe.save_pretrained(tmp_path / "saved")  # the tokens and rows travel with the folder
    back = type(ref).from_pretrained(saved, safety_checker=None)
    np.testing.assert_allclose(_theirs(back, PROMPTS), theirs, rtol=1e-4, atol=1e-5)

    pipe.unload_textual_inversion("<cat>")  # its followers go too; the others keep their rows (ids move up)
    ref.unload_textual_inversion(["<cat>", "<cat>_1", "<cat>_2"])
    assert "<cat>_1" not in pipe.tokenizer.get_vocab() and "<style>" in pipe.tokenizer.get_vocab()
    np.testing.assert_allclose(_ours(pipe, PROMPTS[1:3]), _theirs(ref, PROMPTS[1:3]), rtol=1e-4, atol=1e-5)
    pipe.unload_textual_inversion()
    assert len(pipe.tokenizer) == pipe.text_encoder.config.vocab_size
    np.testing.assert_array_equal(_ours(pipe, PROMPTS[3:]), plain)
    with pytest.raises(ValueError, match="no textual inversion is loaded into tokenizer"):
        type(pipe).from_pipe(pipe).unload_textual_inversion()


def test_bad_embeddings_are_refused_naming_the_fix(sd, files, tmp_path):
    _, folder = sd
    root, rows = files
    pipe = eqxdiff.load_pipeline(folder)
    pipe.load_textual_inversion(str(root / "cat"))
    with pytest.raises(ValueError, match=r"token '<cat>' is in tokenizer's vocabulary already; pass another token="):
        pipe.load_textual_inversion(str(root / "cat"))
    with pytest.raises(ValueError, match="is 48 wide, text_encoder's tokens are 32: it was trained for another"):
        pipe.load_textual_inversion(np.zeros((48,), np.float32), token="<wide>")
    with pytest.raises(ValueError, match="an embedding given as an array needs its token: pass token="):
        pipe.load_textual_inversion(rows[0])
    with pytest.raises(ValueError, match="2 embeddings but 3 tokens"):
        pipe.load_textual_inversion(rows, token=["<a>", "<b>", "<c>"])
    save_file({"clip_l": rows[:1], "clip_g": rows}, tmp_path / "xl.safetensors")
    with pytest.raises(ValueError, match=r"holds \['clip_g', 'clip_l'\], not one embedding.*tensors\[key\], "
                                         r"token=\.\.\., tokenizer=pipe.tokenizer_2"):
        pipe.load_textual_inversion(str(tmp_path / "xl.safetensors"), token="<xl>")
    (tmp_path / "old.pt").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="pickle"):
        pipe.load_textual_inversion(str(tmp_path / "old.pt"))
    with pytest.raises(CheckpointError, match="textual inversion file .* not found"):
        pipe.load_textual_inversion(str(tmp_path / "missing.safetensors"))
    assert "<a>" not in pipe.tokenizer.get_vocab()  # a refused call changes nothing
    pipe.load_textual_inversion(rows, token=["<p>", "<p>_x"])  # "<p>_x" is a token of its own, not a follower
    pipe.unload_textual_inversion("<p>")
    assert "<p>" not in pipe.tokenizer.get_vocab() and "<p>_x" in pipe.tokenizer.get_vocab()


def test_sdxl_takes_each_encoders_embedding_as_diffusers(tmp_path):
    ref = _tiny_sdxl.build_base(tmp_path / "xl")
    pipe = eqxdiff.load_pipeline(tmp_path / "xl")
    rng = np.random.default_rng(1)
    tensors = {"clip_l": rng.normal(size=(2, 32)).astype(np.float32),
               "clip_g": rng.normal(size=(2, 48)).astype(np.float32)}
    for p in (ref, pipe):
        p.load_textual_inversion(tensors["clip_l"] if p is pipe else torch.from_numpy(tensors["clip_l"]), token="<x>")
        p.load_textual_inversion(tensors["clip_g"] if p is pipe else torch.from_numpy(tensors["clip_g"]),
                                 token="<x>", tokenizer=p.tokenizer_2, text_encoder=p.text_encoder_2)
    prompts = ["a <x> b", "plain"]
    with torch.no_grad():
        embeds, _, pooled, _ = ref.encode_prompt(prompts, do_classifier_free_guidance=False)
    ours, ours_pooled = pipe.encode(prompts, prompts)
    np.testing.assert_allclose(np.asarray(ours), embeds.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ours_pooled), pooled.numpy(), rtol=1e-4, atol=1e-5)
    pipe.unload_textual_inversion()  # the file in one call: each embedding into its encoder (diffusers needs two)
    pipe.unload_textual_inversion(tokenizer=pipe.tokenizer_2, text_encoder=pipe.text_encoder_2)
    save_file(tensors, tmp_path / "xl.safetensors")
    pipe.load_textual_inversion(str(tmp_path / "xl.safetensors"), token="<x>")
    again, again_pooled = pipe.encode(prompts, prompts)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(ours))
    np.testing.assert_array_equal(np.asarray(again_pooled), np.asarray(ours_pooled))
    with pytest.raises(ValueError, match="tokenizer does not go with text_encoder_2"):
        pipe.load_textual_inversion(tensors["clip_g"], token="<y>", tokenizer=pipe.tokenizer,
                                    text_encoder=pipe.text_encoder_2)


def test_flux_converts_the_prompts_of_both_encoders_as_diffusers(tmp_path):
    from . import _tiny_flux_pipeline

    ref = _tiny_flux_pipeline.build(tmp_path / "flux", "schnell")
    pipe = eqxdiff.load_pipeline(tmp_path / "flux")
    rng = np.random.default_rng(2)
    clip, t5 = rng.normal(size=(2, 32)).astype(np.float32), rng.normal(size=(3, 32)).astype(np.float32)
    for p in (ref, pipe):
        wrap = np.asarray if p is pipe else torch.from_numpy
        p.load_textual_inversion(wrap(clip), token="<v>")
        p.load_textual_inversion(wrap(t5), token="<v>", tokenizer=p.tokenizer_2, text_encoder=p.text_encoder_2)
    prompts = ["a <v> b", "cd"]
    with torch.no_grad():
        embeds, pooled, _ = ref.encode_prompt(prompts, None, max_sequence_length=16)
    ours = pipe.encode_prompt(prompts, max_sequence_length=16)
    np.testing.assert_allclose(np.asarray(ours.embeds), embeds.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ours.pooled), pooled.numpy(), rtol=1e-4, atol=1e-5)


def test_generate_takes_embeddings_and_freeu(sd, files, tmp_path):
    """eqxdiff-generate's --textual-inversion SOURCE[=TOKEN] and --freeu S1 S2 B1 B2: the Python API's image,
    recorded in the PNG; bad values are refused before loading."""
    from PIL import Image

    from eqxdiff.cli import generate
    from eqxdiff.pipelines import InputError, read_parameters

    _, folder = sd
    root, _ = files
    style = f"{root / 'style.safetensors'}=<style>"
    argv = ["--model", str(folder), "--prompt", "a <cat> and <style>", "--num-inference-steps", "2", "--seed", "0",
            "--textual-inversion", str(root / "cat"), "--textual-inversion", style]
    paths = generate.main([*argv, "--freeu", "0.9", "0.2", "1.2", "1.4", "--output-dir", str(tmp_path)])
    params = read_parameters(paths[0])
    assert params["textual_inversion"] == [str(root / "cat"), style] and params["freeu"] == [0.9, 0.2, 1.2, 1.4]
    pipe = eqxdiff.load_pipeline(folder)
    pipe.load_textual_inversion(root / "cat")
    pipe.load_textual_inversion(root / "style.safetensors", token="<style>")
    pipe.enable_freeu(0.9, 0.2, 1.2, 1.4)
    expected = pipe("a <cat> and <style>", num_inference_steps=2, seed=0, progress=False)
    np.testing.assert_array_equal(np.asarray(Image.open(paths[0]).convert("RGB")), expected[0])
    for extra, error, match in [
        (["--freeu", "nan", "0.2", "1.2", "1.4"], InputError, "give four finite numbers"),
        (["--textual-inversion", "=<x>"], InputError, "give SOURCE or SOURCE=TOKEN"),
        (["--textual-inversion", str(tmp_path / "none.safetensors")], CheckpointError, "not found"),
        (["--textual-inversion", str(tmp_path / "old.pt")], CheckpointError, "pickle"),
    ]:
        with pytest.raises(error, match=match):
            generate.validate([*argv[:2], *extra])


def test_lora_unfuse_and_unload_keep_the_embeddings(sd, files, tmp_path):
    """Textual inversion loaded over a text-encoder LoRA: unfuse_lora and unload_lora_weights give back the text
    encoder with the new tokens' rows (the LoRA keeps copies of the models it gives back; the rows are written
    into them too, pipelines/_lora.py rewrite_lora_copies). Without that the tokenizer knows ``<cat>`` and the
    encoder's table has no row for it (refused: a token id outside the vocabulary)."""
    ref, folder = sd
    root, _ = files
    pattern = r"self_attn\.(q|v)_proj$"
    lora = lora_files.save(lora_files.peft(lora_files.modules(lora_files.checkpoint_named(ref.text_encoder), pattern),
                                           "text_encoder.", lora_files.Rand(4), rank=2), tmp_path / "te.safetensors")
    plain = eqxdiff.load_pipeline(folder)
    plain.load_textual_inversion(str(root / "cat"))
    expected = _ours(plain, PROMPTS[:1])
    pipe = eqxdiff.load_pipeline(folder)
    pipe.load_lora_weights(lora)
    pipe.fuse_lora()
    pipe.load_textual_inversion(str(root / "cat"))
    assert np.abs(_ours(pipe, PROMPTS[:1]) - expected).max() > 1e-3, "the LoRA did not move the embeddings"
    pipe.unfuse_lora()
    pipe.unload_lora_weights()
    np.testing.assert_allclose(_ours(pipe, PROMPTS[:1]), expected, rtol=1e-5, atol=1e-5)
