"""Loading by directory, registry names and the one-sentence errors."""

from __future__ import annotations

import pytest

from recap_cli.adapters import Adapter, LlavaNextAdapter, QwenVLAdapter
from recap_cli.models import DTYPES, REGISTRY, ModelError, load, resolve
from recap_cli.options import DTYPE_NAMES

from .hub import fake_hub, hub_cache, http_error, put_in_cache  # noqa: F401 - fixtures


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


def test_directory_without_a_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelError, match="could not load|holds no model"):
        load(str(tmp_path), device="cpu")


def test_text_model_refuses_images(get_adapter):
    from .conftest import make_image

    with pytest.raises(ValueError, match="text only"):
        get_adapter("text").build([{"role": "user", "content": "hi"}], [make_image(0)])


# The hub, without a network: an empty cache in tmp_path and snapshot_download answering from a script.

REPO = "Qwen/Qwen2.5-VL-7B-Instruct"


def test_offline_flag_never_asks_the_hub(fake_hub):
    with pytest.raises(ModelError, match=r"not in the local Hugging Face cache and offline mode is on.*"
                                         r"`hf download Qwen/Qwen2.5-VL-7B-Instruct`"):
        load("qwen2.5-vl-7b", device="cpu", offline=True)
    assert fake_hub.calls == []


def test_hf_hub_offline_never_asks_the_hub(fake_hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="offline mode is on"):
        load(REPO, device="cpu")
    assert fake_hub.calls == []


def unreachable():
    import httpx2  # what huggingface_hub 2.x talks through

    from huggingface_hub.errors import LocalEntryNotFoundError

    return [LocalEntryNotFoundError("Got: ConnectError: [Errno -2] Name or service not known"),
            httpx2.ConnectError("[Errno -2] Name or service not known"), httpx2.ReadTimeout("timed out")]


@pytest.mark.parametrize("error", unreachable(), ids=lambda e: type(e).__name__)
def test_unreachable_hub_names_the_download_command(fake_hub, error):
    fake_hub.raises = error
    with pytest.raises(ModelError, match=r"^the Hugging Face hub cannot be reached to download "
                                         r"'Qwen/Qwen2.5-VL-7B-Instruct': "
                                         r"run `hf download Qwen/Qwen2.5-VL-7B-Instruct`"):
        load("qwen2.5-vl-7b", device="cpu")
    assert fake_hub.calls == [REPO]


def test_missing_repo_is_not_a_network_problem(fake_hub):
    from huggingface_hub.errors import RepositoryNotFoundError

    fake_hub.raises = http_error(RepositoryNotFoundError, 404, "someone/no-such-model")
    with pytest.raises(ModelError, match="there is no model 'someone/no-such-model' on the Hugging Face hub"):
        load("someone/no-such-model", device="cpu")


def test_gated_repo_says_log_in(fake_hub):
    from huggingface_hub.errors import GatedRepoError

    fake_hub.raises = http_error(GatedRepoError, 403, "meta-llama/Llama-3.2-11B-Vision")
    with pytest.raises(ModelError, match=r"is gated: accept its licence at "
                                         r"https://huggingface.co/meta-llama/Llama-3.2-11B-Vision.*`hf auth login`"):
        load("meta-llama/Llama-3.2-11B-Vision", device="cpu")


def test_other_hub_errors_are_one_sentence(fake_hub):
    from huggingface_hub.errors import HfHubHTTPError

    fake_hub.raises = http_error(HfHubHTTPError, 500, REPO, "500 Server Error: Internal Server Error\nmore")
    with pytest.raises(ModelError, match=r"^downloading 'Qwen/Qwen2.5-VL-7B-Instruct' failed: 500 Server Error: "
                                         r"Internal Server Error$"):
        load(REPO, device="cpu")


def test_a_missing_model_is_downloaded_then_loaded(fake_hub, model_dirs):
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    fake_hub.serves = model_dirs["text"]
    heard = []
    disable_progress_bars()
    try:
        adapter = load("someone/tiny-llama", device="cpu", progress=True, notify=heard.append)
        assert are_progress_bars_disabled()  # as they were before ...
    finally:
        enable_progress_bars()
    assert fake_hub.bars_during_download == [True]  # ... and on for the download
    assert type(adapter) is Adapter and fake_hub.calls == ["someone/tiny-llama"]
    assert heard and "downloading someone/tiny-llama" in heard[0]


def test_a_cached_model_loads_without_the_hub(fake_hub, hub_cache, model_dirs):
    put_in_cache(hub_cache, "someone/tiny-llama", model_dirs["text"])
    assert type(load("someone/tiny-llama", device="cpu", offline=True)) is Adapter
    assert type(load("someone/tiny-llama", device="cpu")) is Adapter
    assert fake_hub.calls == []


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


# --- a torch/torchvision pair that does not match ---------------------------------------------------------------

class BrokenTorchvision:
    """An import hook standing in for a torchvision built against another torch: importing it fails the way such a
    pair does (no real mismatched install needed)."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            raise RuntimeError("operator torchvision::nms does not exist")
        return None


def processor_that_needs_torchvision(*args, **kwargs):
    """transformers' AutoProcessor for Qwen2.5-VL imports its video processor, which imports torchvision; when
    that fails, all transformers says is that it could not import AutoProcessor."""
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        raise ModuleNotFoundError("Could not import module 'AutoProcessor'. Are this object's requirements defined "
                                  "correctly?") from exc
    raise ModuleNotFoundError("No module named 'num2words'")  # torchvision fine: another missing package


def test_a_torchvision_that_does_not_match_torch_is_named_with_the_fix(model_dirs, monkeypatch):
    import sys

    import transformers

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", processor_that_needs_torchvision)
    with pytest.raises(ModelError) as other:  # torchvision imports: the real cause is passed on, not blamed on it
        load(str(model_dirs["qwen"]), device="cpu")
    assert "num2words" in str(other.value) and "torchvision" not in str(other.value)
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [BrokenTorchvision(), *sys.meta_path])
    with pytest.raises(ModelError) as broken:
        load(str(model_dirs["qwen"]), device="cpu")
    message = str(broken.value)
    assert "torchvision" in message and "does not work with torch" in message
    assert "operator torchvision::nms does not exist" in message and "install a matching pair" in message
    assert "download.pytorch.org/whl/cpu" in message and "AutoProcessor" not in message
    assert len(message.splitlines()) == 1


def test_load_refuses_what_the_command_line_refuses_before_looking_for_the_model():
    """One check for both: the command line's (torch-free, before a download) is the library's too."""
    assert DTYPE_NAMES == ("auto", *DTYPES)
    for how, said in ((dict(attn="flash_attention_2"), "--attn takes"), (dict(dtype="fp8"), "--dtype takes"),
                      (dict(device="tpu"), "--device takes")):
        with pytest.raises(ModelError, match=said):
            load("no-such-model", **how)


def test_no_eos_in_the_generation_config_stops_nowhere_as_generate_does(model_dirs, tmp_path):
    """A checkpoint whose generation config names no EOS: generate() never stops early, even at the tokenizer's
    EOS, so neither does recap (it stopped at the tokenizer's)."""
    import json
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from recap_cli.session import GenerateSession, Session

    d = tmp_path / "model"
    shutil.copytree(model_dirs["text"], d)
    model = AutoModelForCausalLM.from_pretrained(d)
    adapter = load(str(model_dirs["text"]), device="cpu", dtype="fp32")
    eos = next(iter(adapter.eos_token_ids))
    msgs = [{"role": "user", "content": "What colour is the triangle?"}]
    common = Session(adapter, "ar").answer(msgs, [], 30).tokens[4]
    with torch.no_grad():  # the tokenizer's EOS scores like a token the answer holds: it comes early
        model.lm_head.weight[eos] = model.lm_head.weight[common] * 1.05
    model.save_pretrained(d)
    config = json.loads((d / "generation_config.json").read_text())
    del config["eos_token_id"]
    (d / "generation_config.json").write_text(json.dumps(config))
    adapter = load(str(d), device="cpu", dtype="fp64")
    want = GenerateSession(adapter, "hf").answer(msgs, [], 30).tokens
    assert eos in want[:-1] and len(want) == 30
    assert Session(adapter, "ar").answer(msgs, [], 30).tokens == want
    assert Session(adapter, "recap").answer(msgs, [], 30).tokens == want
