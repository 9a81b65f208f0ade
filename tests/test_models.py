"""Loading by directory, registry names and the one-sentence errors."""

from __future__ import annotations

import pytest

from recap_cli.adapters import Adapter, LlavaNextAdapter, QwenVLAdapter
from recap_cli.models import REGISTRY, ModelError, load, resolve


def test_local_directories_load_the_right_adapter(get_adapter):
    assert isinstance(get_adapter("qwen"), QwenVLAdapter)
    assert isinstance(get_adapter("llava"), LlavaNextAdapter)
    text = get_adapter("text")
    assert type(text) is Adapter and text.image_token_id is None


def test_registry_names_map_to_repo_ids():
    assert resolve("qwen2.5-vl-7b") == "Qwen/Qwen2.5-VL-7B-Instruct"
    assert resolve("llava-1.6-7b") == "llava-hf/llava-v1.6-vicuna-7b-hf"
    assert set(REGISTRY) >= {"qwen2.5-vl-3b", "smollm2-135m"}


def test_unknown_name_is_one_sentence():
    with pytest.raises(ModelError, match="unknown model 'gpt-9'"):
        load("gpt-9")


def test_uncached_hub_model_fails_fast_and_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelError, match="not in the local cache"):
        load("qwen2.5-vl-7b", device="cpu")


def test_directory_without_a_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelError, match="could not load|not in the local cache"):
        load(str(tmp_path), device="cpu")


def test_text_model_refuses_images(get_adapter):
    from .conftest import make_image

    with pytest.raises(ValueError, match="text only"):
        get_adapter("text").build([{"role": "user", "content": "hi"}], [make_image(0)])


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next"])
def test_linear_attention_families_are_refused_with_the_reason(tmp_path, model_type):
    from transformers import AutoConfig

    AutoConfig.for_model(model_type).save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="cannot be decoded exactly.*linear attention"):
        load(str(tmp_path), device="cpu")


def test_unknown_vision_family_is_refused(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("paligemma").save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="not supported yet: recap knows qwen2_vl"):
        load(str(tmp_path), device="cpu")


def test_every_registry_name_has_a_supported_family():
    from recap_cli.models import ADAPTERS, FAMILIES

    assert set(FAMILIES) == set(REGISTRY)
    assert {family for family, _ in FAMILIES.values()} - {"llama"} <= set(ADAPTERS)
    assert resolve("qwen3-vl-8b") == "Qwen/Qwen3-VL-8B-Instruct"
    assert resolve("gemma-3-4b") == "google/gemma-3-4b-it"
