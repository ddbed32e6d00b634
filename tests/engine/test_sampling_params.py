"""SamplingParams validation and generation-config defaults."""
import math

import pytest

from tokenmill.core.sampling_params import SamplingParams

INVALID = [
    ("n", 0), ("n", 1.5), ("n", True),
    ("temperature", -0.1), ("temperature", "hot"), ("temperature", math.nan), ("temperature", math.inf),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", math.nan),
    ("top_k", -2), ("top_k", 2.5),
    ("min_p", -0.01), ("min_p", 1.5),
    ("seed", 1.5), ("seed", "x"),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01),
    ("frequency_penalty", 3), ("frequency_penalty", -3),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0),
    ("max_tokens", 0), ("max_tokens", 1.5),
    ("min_tokens", -1),
    ("logprobs", -1), ("logprobs", 1.0),
    ("prompt_logprobs", -1),
    ("stop", 5), ("stop", ["ok", 3]), ("stop", [""]),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("stop_token_ids", 5),
    ("logit_bias", [1, 2]), ("logit_bias", {"x": 1.0}), ("logit_bias", {1: 101.0}),
    ("logit_bias", {1: -100.5}), ("logit_bias", {-1: 1.0}), ("logit_bias", {1: math.nan}),
    ("ignore_eos", "yes"), ("skip_special_tokens", 1), ("detokenize", "no"),
]


@pytest.mark.parametrize("name,value", INVALID)
def test_invalid_value_names_parameter(name, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{name: value})
    assert name in str(info.value)
    assert getattr(info.value, "param", name) == name


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)


def test_unknown_parameter():
    with pytest.raises(ValueError, match="bogus"):
        SamplingParams(bogus=1)


def test_normalization():
    p = SamplingParams(top_k=-1, stop="END", logit_bias={"5": 2})
    assert p.top_k == 0
    assert p.stop == ["END"]
    assert p.stop_token_ids == []
    assert p.logit_bias == {5: 2.0}
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams().greedy
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_defaults_do_not_alias():
    a, b = SamplingParams(), SamplingParams()
    a.stop.append("x")
    assert b.stop == []


def test_generation_defaults_apply_only_to_unset_fields():
    gen = {"temperature": 0.6, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1, "max_new_tokens": 64,
           "do_sample": True}
    p = SamplingParams(temperature=0.2, max_tokens=8)
    q = p.with_generation_defaults(gen)
    assert q.temperature == 0.2 and q.max_tokens == 8          # explicit: kept
    assert q.top_p == 0.9 and q.top_k == 50 and q.repetition_penalty == 1.1   # unset: defaulted
    assert p.top_p == 1.0                                       # the original is unchanged
    # An explicit value equal to the default still counts as explicit.
    r = SamplingParams(top_p=1.0).with_generation_defaults(gen)
    assert r.top_p == 1.0 and r.temperature == 0.6
    # None defaults and an empty config change nothing.
    s = SamplingParams()
    assert s.with_generation_defaults({}) is s
    assert s.with_generation_defaults({"temperature": None}).temperature == 1.0


def test_none_means_unset():
    p = SamplingParams(temperature=None, top_p=None, max_tokens=None)
    assert p.temperature == 1.0 and p.top_p == 1.0
    assert p.max_tokens is None                   # None is meaningful for max_tokens
    assert not p.is_explicit("temperature") and p.is_explicit("max_tokens")
    assert p.with_generation_defaults({"temperature": 0.3}).temperature == 0.3


def test_invalid_generation_default_raises():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams().with_generation_defaults({"top_p": 2.0})
