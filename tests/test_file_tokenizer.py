"""eqxdiff.loading.file_tokenizer: a tokenizer folder transformers saved with ``tokenizer.json`` is read with
``tokenizers`` alone, and gives transformers' ids, masks, decoded text and special ids for the same folder (CLIP's BPE
and T5's Unigram); folders transformers would read otherwise are left to it."""

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer, CLIPTokenizer, T5Tokenizer

from eqxdiff.data import character_tokenizer
from eqxdiff.data._tokenizer import LETTERS
from eqxdiff.loading import file_tokenizer, token_ids
from eqxdiff.loading._fast_tokenizer import FileTokenizer
from eqxdiff.pipelines._components import load_tokenizer
from eqxdiff.pipelines._text import tokens

DIGITS = Path(__file__).resolve().parents[1] / "eqxdiff" / "assets" / "digits" / "tokenizer"
PROMPTS = ["a cat", "", "A  Cat,\tsitting on the MAT!", "the cat's hat isn't red", "naïve café 42 <|endoftext|> x",
           "a cat " * 40, "   ", "what? what... no.", "</s> <pad> unknown"]


def _clip_bpe():
    """A CLIP tokenizer with real merges (``c a`` -> ``ca``, ``ca t</w>`` -> ``cat</w>``)."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in LETTERS + "0123456789.,!?'":
        vocab[c], vocab[c + "</w>"] = len(vocab), len(vocab) + 1
    vocab["ca"], vocab["cat</w>"] = len(vocab), len(vocab) + 1
    return CLIPTokenizer(vocab=vocab, merges=[("c", "a"), ("ca", "t</w>")], model_max_length=12)


def _t5():
    """A T5 (Unigram) tokenizer over letters and a few words, with extra ids."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(w, -1.0) for w in ("▁a", "▁cat", "▁the", "▁on", "'s", "▁hat", ".", "!", ",", "?")]
    pieces += [(c, -5.0) for c in LETTERS] + [("▁" + c, -6.0) for c in LETTERS]
    return T5Tokenizer(vocab=pieces, extra_ids=3, model_max_length=10)


TOKENIZERS = {"clip-characters": lambda: character_tokenizer(16), "clip-bpe": _clip_bpe, "t5": _t5}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def saved(request, tmp_path_factory):
    """(transformers' tokenizer read back from the folder, the FileTokenizer of the folder, the folder)."""
    folder = tmp_path_factory.mktemp(request.param)
    TOKENIZERS[request.param]().save_pretrained(folder)
    ours = file_tokenizer(folder)
    assert isinstance(ours, FileTokenizer), f"{request.param}: the folder was left to transformers"
    return AutoTokenizer.from_pretrained(folder), ours, folder


def test_same_ids_and_masks_as_transformers(saved):
    theirs, ours, _ = saved
    for length in (None, 4, 10, 40):
        ids, mask = token_ids(ours, PROMPTS, length, mask=True)
        want_ids, want_mask = token_ids(theirs, PROMPTS, length, mask=True)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(mask, want_mask)
    assert 0 in mask and ids.shape == (len(PROMPTS), 40)  # padding was exercised
    for prompt in PROMPTS:
        for kwargs in ({"truncation": False}, {"add_special_tokens": False}, {}):
            assert ours(prompt, verbose=False, **kwargs).input_ids == theirs(prompt, verbose=False,
                                                                             **kwargs).input_ids, (prompt, kwargs)
    longest = ours(PROMPTS[:3], padding=True, return_tensors="np")
    np.testing.assert_array_equal(longest.input_ids, theirs(PROMPTS[:3], padding=True, return_tensors="np").input_ids)


def test_same_special_tokens_lengths_and_decoding(saved):
    theirs, ours, _ = saved
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, name) == getattr(theirs, name), name
        assert getattr(ours, name + "_id") == getattr(theirs, name + "_id"), name
    assert ours.transformers_class == type(theirs).__name__  # what a saved pipeline's model_index.json names
    assert (ours.model_max_length, len(ours), ours.vocab_size) == (theirs.model_max_length, len(theirs),
                                                                   theirs.vocab_size)
    for prompt in PROMPTS:
        full = theirs(prompt, truncation=False, verbose=False).input_ids
        for skip in (True, False):
            for part in (full, full[2:7], full[:1]):
                assert ours.decode(part, skip_special_tokens=skip) == theirs.decode(part, skip_special_tokens=skip)


def test_prompt_warnings_are_the_same(saved):
    """The cut-prompt warning (which decodes the part cut off) and the unknown-words one."""
    theirs, ours, _ = saved
    for prompt in ("the cat sat on the hat " * 5, "a café for the cat ç"):
        with pytest.warns(Warning) as with_ours:
            tokens(ours, [prompt], max_length=8)
        with pytest.warns(Warning) as with_theirs:
            tokens(theirs, [prompt], max_length=8)
        assert [str(w.message) for w in with_ours] == [str(w.message) for w in with_theirs]


def test_save_pretrained_round_trips_through_transformers(saved, tmp_path):
    theirs, ours, _ = saved
    ours.save_pretrained(tmp_path / "again")
    again = AutoTokenizer.from_pretrained(tmp_path / "again")
    np.testing.assert_array_equal(token_ids(again, PROMPTS, 12), token_ids(theirs, PROMPTS, 12))
    assert isinstance(file_tokenizer(tmp_path / "again"), FileTokenizer)


def test_the_shipped_digits_tokenizer_matches_transformers():
    theirs, ours = AutoTokenizer.from_pretrained(DIGITS), load_tokenizer(DIGITS)
    assert isinstance(ours, FileTokenizer)
    np.testing.assert_array_equal(token_ids(ours, PROMPTS, mask=True)[1], token_ids(theirs, PROMPTS, mask=True)[1])
    np.testing.assert_array_equal(token_ids(ours, PROMPTS), token_ids(theirs, PROMPTS))


def test_folders_transformers_reads_otherwise_are_left_to_it(saved, tmp_path):
    _, _, folder = saved
    without_json = shutil.copytree(folder, tmp_path / "slow")
    (without_json / "tokenizer.json").unlink()
    assert file_tokenizer(without_json) is None
    config = (folder / "tokenizer_config.json").read_text()
    for edit in ('"add_eos_token": true,', '"split_special_tokens": true,', '"auto_map": {},'):
        changed = shutil.copytree(folder, tmp_path / edit.split('"')[1])
        (changed / "tokenizer_config.json").write_text(config.replace("{", "{" + edit, 1))
        assert file_tokenizer(changed) is None, edit
    unnamed = shutil.copytree(folder, tmp_path / "unnamed")
    (unnamed / "tokenizer_config.json").write_text(config.replace('"tokenizer_class"', '"was_tokenizer_class"'))
    assert file_tokenizer(unnamed) is None
    assert file_tokenizer(tmp_path / "missing") is None


def test_loading_the_digits_pipeline_imports_neither_transformers_torch_nor_the_hub_client():
    code = ("import sys, eqxdiff; p = eqxdiff.load_pipeline('digits'); "
            "print(sorted(m for m in ('transformers', 'torch', 'diffusers', 'huggingface_hub') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
