"""Engine arguments as `LLM(...)` and the CLI take them: sizes with units, and a wrong type or value is a
ValueError naming the argument before anything loads (never a TypeError from inside the engine)."""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from tokenmill import LLM
from tokenmill.core.config import EngineConfig, parse_size
from tokenmill.entrypoints.engine_args import add_engine_args, engine_kwargs


def all_engine_arguments() -> list[str]:
    config = EngineConfig()
    sections = [config.model, config.cache, config.scheduler, config.parallel, config.device, config.lora]
    return [f.name for section in sections for f in dataclasses.fields(section)] + ["speculative_config"]


@pytest.mark.parametrize("value, expected", [("64MiB", 64 << 20), ("2GiB", 2 << 30), ("1.5GB", 1_500_000_000),
                                             ("512M", 512_000_000), (4096, 4096), ("4096", 4096)])
def test_kv_cache_memory_takes_bytes_or_a_size_with_a_unit(value, expected):
    assert EngineConfig.from_kwargs(kv_cache_memory=value).cache.kv_cache_memory == expected
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--kv-cache-memory", str(value)])
    assert engine_kwargs(args)["kv_cache_memory"] == expected


@pytest.mark.parametrize("value", ["lots", "-1MiB", 0, -5, True, 1.5, [64], "64 parsecs"])
def test_kv_cache_memory_refuses_anything_else_naming_it(value):
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(kv_cache_memory=value)


def test_cli_refuses_a_bad_size_with_a_usage_error(capsys):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-memory", "lots"])
    assert "--kv-cache-memory" in capsys.readouterr().err


def test_llm_builds_with_a_size_string():
    llm = LLM(kv_cache_memory="64MiB", max_model_len=256)
    out = llm.generate(["Hello"], use_tqdm=False)
    assert out[0].outputs[0].token_ids


class Unexpected:
    def __repr__(self) -> str:
        return "<Unexpected>"


@pytest.mark.parametrize("name", all_engine_arguments())
def test_every_keyword_of_the_wrong_type_is_a_value_error_naming_it(name):
    with pytest.raises(ValueError, match=name):
        LLM(**{name: Unexpected()})


@pytest.mark.parametrize("kwargs, name", [
    ({"max_num_seqs": "4"}, "max_num_seqs"), ({"max_num_seqs": True}, "max_num_seqs"),
    ({"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization"), ({"enforce_eager": "yes"}, "enforce_eager"),
    ({"tensor_parallel_size": 2.0}, "tensor_parallel_size"), ({"block_size": None}, "block_size"),
    ({"num_threads": 0}, "num_threads"), ({"num_threads": -1}, "num_threads"),
    ({"num_gpu_blocks_override": 0}, "num_gpu_blocks_override"), ({"seed": 1.5}, "seed"),
    ({"generation_config": "no-such-folder"}, "generation_config"), ({"model": 5}, "model"),
    ({"model": "/no/such/model"}, "model"), ({"tokenizer": "/no/such/tokenizer"}, "tokenizer"),
    ({"lora_modules": "a=b"}, "lora_modules"), ({"dtype": 16}, "dtype"),
])
def test_bad_values_are_value_errors_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LLM(**kwargs)


def test_a_model_path_object_is_accepted(tmp_path: Path):
    from tokenmill.core.loaders.model_source import default_model_path
    config = EngineConfig.from_kwargs(model=Path(default_model_path()))
    assert config.model.model == default_model_path()


def test_generation_config_folder_gives_the_llm_its_defaults(tmp_path: Path):
    (tmp_path / "generation_config.json").write_text('{"max_new_tokens": 3}')
    llm = LLM(generation_config=str(tmp_path), max_model_len=256)
    from tokenmill import SamplingParams
    out = llm.generate(["Hello"], SamplingParams(temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_parse_size_names_what_it_parses():
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        parse_size("x", "--kv-cache-memory")
