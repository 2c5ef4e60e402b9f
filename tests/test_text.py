"""The shared prompt tokenization (``eqxdiff.pipelines._text``): the ids and mask transformers' own padded call gives,
the warnings (a prompt cut, with the part cut off; unknown words), the vocabulary check, and Wan's trim / zero pad of
UMT5 embeddings against diffusers' code for it. Nothing here compiles a model."""

import warnings

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from eqxdiff.data import character_tokenizer
from eqxdiff.loading import CheckpointError
from eqxdiff.pipelines import InputError, InputWarning
from eqxdiff.pipelines._text import check_vocabulary, prompt_pair, tokenize, tokens, zero_padding

PROMPTS = ["a red cat", "two dogs"]


@pytest.mark.parametrize("max_length", [None, 12])
def test_ids_and_mask_are_the_tokenizers_padded_call(max_length):
    tokenizer = character_tokenizer(16)
    length = max_length or 16
    expected = tokenizer(PROMPTS, padding="max_length", max_length=length, truncation=True, return_tensors="np")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # short, known prompts: nothing to warn about
        out = tokens(tokenizer, PROMPTS, max_length=max_length, vocab_size=54)
    assert out.ids.dtype == np.int32 and out.ids.shape == (2, length)
    np.testing.assert_array_equal(out.ids, expected.input_ids)
    np.testing.assert_array_equal(out.mask, expected.attention_mask)
    # a BOS, one token per character, an EOS: "a red cat" is 7 characters without spaces
    np.testing.assert_array_equal(out.lengths, [9, 9])
    np.testing.assert_array_equal(tokenize(tokenizer, PROMPTS, max_length=max_length), out.ids)


def test_a_cut_prompt_warns_once_naming_the_part_cut_off():
    tokenizer = character_tokenizer(8)
    long = "a dog and a cat"
    with pytest.warns(InputWarning) as record:
        ids = tokenize(tokenizer, [long, long, "a cat"], encoder_name="text_encoder_2",
                       fix="Shorten the prompt or raise max_sequence_length")
    messages = [str(w.message) for w in record]
    assert messages == [("the prompt 'a dog and a cat' has 13 tokens but text_encoder_2 reads 8: 5 token(s) were cut "
                         "off, starting 'd a cat'. Shorten the prompt or raise max_sequence_length")]
    # what is kept ends with the end token, as the tokenizer truncates
    assert ids[0, -1] == tokenizer.eos_token_id and tokenizer.decode(ids[0, 1:-1]) == "a dog an"


def test_unknown_words_are_named():
    with pytest.warns(InputWarning, match=r"^tokenizer_2 does not know '7', 'b4' in 'a 7 b4 c' and reads them as "
                                          r"'<\|endoftext\|>'; reword the prompt"):
        tokenize(character_tokenizer(16), ["a 7 b4 c"], tokenizer_name="tokenizer_2")


def test_ids_outside_the_encoders_vocabulary_name_both_and_the_fix():
    tokenizer = character_tokenizer(16)
    with pytest.raises(CheckpointError, match=r"^the tokenizer gave token id 47, outside the text encoder's vocabulary "
                                              r"of 20 \(vocab_size in its config.json\).*use the tokenizer saved"):
        tokenize(tokenizer, ["a cat"], vocab_size=20)
    with pytest.raises(CheckpointError, match="tokenizer_2 gave token id -1, outside text_encoder_2's vocabulary"):
        check_vocabulary(np.array([[0, -1]]), 20, tokenizer_name="tokenizer_2", encoder_name="text_encoder_2")
    check_vocabulary(np.array([[0, 19]]), 20)


def test_zero_padding_is_diffusers_trim_and_pad_of_umt5_prompts():
    """diffusers' WanPipeline._get_t5_prompt_embeds: each prompt's embeddings cut to its length, then zeros up to
    max_sequence_length."""
    out = tokens(character_tokenizer(16), ["a red cat", "a dog"], max_length=12)
    embeds = np.random.default_rng(0).standard_normal((2, 12, 5)).astype(np.float32)
    seq_lens = torch.from_numpy(out.mask).gt(0).sum(dim=1).long()
    trimmed = [u[:v] for u, v in zip(torch.from_numpy(embeds), seq_lens)]
    expected = torch.stack([torch.cat([u, u.new_zeros(12 - u.size(0), u.size(1))]) for u in trimmed], dim=0)
    ours = zero_padding(jnp.asarray(embeds), out.mask)
    np.testing.assert_array_equal(np.asarray(ours), expected.numpy())
    assert int(seq_lens[1]) < 12 and np.all(np.asarray(ours)[1, int(seq_lens[1]):] == 0)


def test_the_negative_prompt_is_encoded_at_max_sequence_length():
    """diffusers' encode_prompt encodes the negative prompt at max_sequence_length, whatever the length of given
    prompt_embeds (it was encoded at theirs: Wan's output was then up to 56/255 off diffusers'). A family that runs
    both halves of guidance in one batch refuses different lengths, naming both shapes and the fix."""
    lengths = []

    def encode(prompts, length):
        lengths.append(length)
        return np.zeros((len(prompts), length, 3), np.float32)

    pair = dict(prompt=None, negative_prompt="blurry", prompt_embeds=np.zeros((2, 5, 3), np.float32),
                negative_prompt_embeds=None, guided=True, max_sequence_length=8, shape=np.shape)
    positive, negative = prompt_pair(encode, lambda e, name: e, same_length=False, **pair)
    assert lengths == [8] and positive.shape == (2, 5, 3) and negative.shape == (2, 8, 3)
    with pytest.raises(InputError, match=r"negative embeddings of shape \(2, 8, 3\) \(the negative prompt encoded at "
                                         r"max_sequence_length=8\) for prompt embeddings of shape \(2, 5, 3\) "
                                         r"\(prompt_embeds\).*pass max_sequence_length=5"):
        prompt_pair(encode, lambda e, name: e, **pair)
    with pytest.raises(InputError, match=r"of shape \(1, 8, 3\).*of shape \(2, 5, 3\): pass one negative per prompt"):
        prompt_pair(encode, lambda e, name: e, same_length=False, **{**pair, "negative_prompt": None,
                                                                     "negative_prompt_embeds": np.zeros((1, 8, 3))})


def test_a_very_long_prompt_warns_once_in_one_short_line(caplog, capfd):
    """Issue 18: a 2000-character prompt's warning echoed ~1900 characters of the dropped text, and transformers'
    'Token indices sequence length ... will result in indexing errors' line (wrong: the prompt is cut) came too. The
    warning says how many tokens were cut and the first words; an emoji / CJK prompt over the limit gets it too,
    once, and its unknown-word warning names at most three words, shortened."""
    tokenizer = character_tokenizer(32)
    for prompt in ("a handwritten digit seven " * 80, "\U0001F600" * 100 + " \u6570\u5b57" * 60):
        with pytest.warns(InputWarning) as record:
            tokenize(tokenizer, [prompt, prompt])
        cut = [str(w.message) for w in record if "were cut off" in str(w.message)]
        assert len(cut) == 1 and len(cut[0]) < 200, cut
        assert all(len(str(w.message)) < 300 for w in record)
        assert cut[0].startswith("the prompt ") and "token(s) were cut off, starting" in cut[0]
    assert "indexing errors" not in caplog.text + "".join(capfd.readouterr())


def test_a_length_below_the_special_tokens_is_refused():
    """A CLIP-style tokenizer adds two special tokens to every text and truncation cannot cut below them: asked for
    one token it returned longer rows (a Flux T5 side with max_sequence_length=1 gave 9 tokens, not 1) or failed on
    a ragged batch with transformers' padding message. Two tokens are the least, bos and eos."""
    tokenizer = character_tokenizer(16)
    with pytest.raises(ValueError, match=r"token length of 1 is too short: the tokenizer adds 2 special token\(s\)"):
        tokens(tokenizer, ["a red cat", "a"], max_length=1)
    out = tokens(tokenizer, ["a red cat", ""], max_length=2)
    assert out.ids.tolist() == [[0, 1], [0, 1]] and out.mask.tolist() == [[1, 1], [1, 1]]
