"""Model registry and loading: short names or local directories -> a ready adapter.

Loading never hangs on a missing hub: a registry name is looked up in the local Hugging Face cache first, and
any failure becomes one ``ModelError`` sentence for the CLI to print.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .adapters import Adapter, Gemma3Adapter, LlavaNextAdapter, QwenVLAdapter, VisionAdapter
from .records import first_line

# The demo model ships inside the package (trained by recap_cli/demo/train.py on the synthetic world).
DEMO_MODEL = Path(__file__).resolve().parent / "demo" / "model"

REGISTRY: dict[str, str] = {
    "demo": str(DEMO_MODEL),
    "qwen3-vl-2b": "Qwen/Qwen3-VL-2B-Instruct",
    "qwen3-vl-4b": "Qwen/Qwen3-VL-4B-Instruct",
    "qwen3-vl-8b": "Qwen/Qwen3-VL-8B-Instruct",
    "qwen2.5-vl-7b": "Qwen/Qwen2.5-VL-7B-Instruct",
    "qwen2.5-vl-3b": "Qwen/Qwen2.5-VL-3B-Instruct",
    "qwen2.5-vl-32b": "Qwen/Qwen2.5-VL-32B-Instruct",
    "qwen2-vl-2b": "Qwen/Qwen2-VL-2B-Instruct",
    "qwen2-vl-7b": "Qwen/Qwen2-VL-7B-Instruct",
    "llava-1.6-7b": "llava-hf/llava-v1.6-vicuna-7b-hf",
    "llava-1.6-13b": "llava-hf/llava-v1.6-vicuna-13b-hf",
    "llava-onevision-0.5b": "llava-hf/llava-onevision-qwen2-0.5b-ov-hf",
    "llava-onevision-7b": "llava-hf/llava-onevision-qwen2-7b-ov-hf",
    "smolvlm-2b": "HuggingFaceTB/SmolVLM-Instruct",
    "smolvlm2-2.2b": "HuggingFaceTB/SmolVLM2-2.2B-Instruct",
    "internvl3-1b": "OpenGVLab/InternVL3-1B-hf",
    "internvl3-8b": "OpenGVLab/InternVL3-8B-hf",
    "gemma-3-4b": "google/gemma-3-4b-it",
    "gemma-3-12b": "google/gemma-3-12b-it",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
}

# alias -> (model_type, size), for `recap models`.
FAMILIES: dict[str, tuple[str, str]] = {
    "demo": ("qwen2_5_vl", "tiny"),
    "qwen3-vl-2b": ("qwen3_vl", "2B"), "qwen3-vl-4b": ("qwen3_vl", "4B"), "qwen3-vl-8b": ("qwen3_vl", "8B"),
    "qwen2.5-vl-7b": ("qwen2_5_vl", "7B"), "qwen2.5-vl-3b": ("qwen2_5_vl", "3B"),
    "qwen2.5-vl-32b": ("qwen2_5_vl", "32B"),
    "qwen2-vl-2b": ("qwen2_vl", "2B"), "qwen2-vl-7b": ("qwen2_vl", "7B"),
    "llava-1.6-7b": ("llava_next", "7B"), "llava-1.6-13b": ("llava_next", "13B"),
    "llava-onevision-0.5b": ("llava_onevision", "0.5B"), "llava-onevision-7b": ("llava_onevision", "7B"),
    "smolvlm-2b": ("idefics3", "2B"), "smolvlm2-2.2b": ("smolvlm", "2.2B"),
    "internvl3-1b": ("internvl", "1B"), "internvl3-8b": ("internvl", "8B"),
    "gemma-3-4b": ("gemma3", "4B"), "gemma-3-12b": ("gemma3", "12B"),
    "smollm2-135m": ("llama", "135M"),
}

# model_type -> adapter. Each family here has a tiny random-init twin in tiny_models.py that the exactness tests
# decode with every drafter against generate(do_sample=False).
ADAPTERS: dict[str, type[VisionAdapter]] = {
    "qwen2_vl": QwenVLAdapter,
    "qwen2_5_vl": QwenVLAdapter,
    "qwen3_vl": QwenVLAdapter,
    "llava_next": LlavaNextAdapter,
    "llava_onevision": LlavaNextAdapter,
    "idefics3": VisionAdapter,
    "smolvlm": VisionAdapter,
    "internvl": VisionAdapter,
    "gemma3": Gemma3Adapter,
}

# Families whose layers cannot verify a draft tree in one pass: the reason, in one clause.
REFUSED: dict[str, str] = {
    "qwen3_5": "three of every four layers are linear attention (Gated DeltaNet) whose recurrent state can "
               "neither attend by tree ancestry nor be rolled back to the accepted path",
    "qwen3_5_moe": "three of every four layers are linear attention (Gated DeltaNet) whose recurrent state can "
                   "neither attend by tree ancestry nor be rolled back to the accepted path",
    "qwen3_next": "three of every four layers are linear attention (Gated DeltaNet) whose recurrent state can "
                  "neither attend by tree ancestry nor be rolled back to the accepted path",
}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


class ModelError(Exception):
    """A model could not be found or loaded; the message is one sentence meant for the user."""


def resolve(name: str) -> str:
    """A local directory, a registry alias, or a hub repo id (owner/name) -> what from_pretrained takes."""
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    if name == "demo" and not DEMO_MODEL.is_dir():
        raise ModelError(f"the demo model is missing from this installation ({DEMO_MODEL}): reinstall recap")
    if name in REGISTRY:
        return REGISTRY[name]
    if name.count("/") == 1 and not Path(name).exists():
        return name
    known = ", ".join(sorted(REGISTRY))
    raise ModelError(f"unknown model '{name}': use one of {known}, a hub repo id, or a local model directory")


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError("--device cuda was asked for but no CUDA device is available")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype '{dtype}': use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load(name: str, device: str = "auto", dtype: str = "auto", attn: str = "sdpa") -> Adapter:
    """Load model + processor and wrap them in the adapter for their architecture."""
    source = resolve(name)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    if attn not in ("sdpa", "eager"):
        raise ModelError("attention must be sdpa or eager: tree masks cannot go through flash-attention kernels")
    try:
        return _load(source, dev, dt, attn)
    except ModelError:
        raise
    except (OSError, ValueError, ImportError) as exc:  # ImportError: a processor's optional package is missing
        raise ModelError(f"could not load model '{name}' ({source}): {first_line(exc)}") from exc


def _load(source: str, device: torch.device, dtype: torch.dtype, attn: str) -> Adapter:
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor,
                              AutoTokenizer)

    local = Path(source).is_dir()
    kw = {} if local else {"local_files_only": True}
    try:
        config = AutoConfig.from_pretrained(source, **kw)
    except OSError as exc:
        raise ModelError(f"model '{source}' is not in the local cache and the hub cannot be reached here: "
                         "download it once (huggingface-cli download) or pass a local directory") from exc
    load_kw = dict(dtype=dtype, attn_implementation=attn, **kw)
    if config.model_type in ADAPTERS:
        model = AutoModelForImageTextToText.from_pretrained(source, **load_kw).to(device).eval()
        processor = AutoProcessor.from_pretrained(source, **kw)
        return ADAPTERS[config.model_type](model, processor)
    if config.model_type in REFUSED:
        raise ModelError(f"model type '{config.model_type}' cannot be decoded exactly by recap: "
                         f"{REFUSED[config.model_type]}")
    if _is_vision_config(config):
        raise ModelError(f"model type '{config.model_type}' is not supported yet: recap knows "
                         f"{', '.join(ADAPTERS)} and text-only causal LMs")
    model = AutoModelForCausalLM.from_pretrained(source, **load_kw).to(device).eval()
    return Adapter(model, AutoTokenizer.from_pretrained(source, **kw))


def _is_vision_config(config) -> bool:
    return hasattr(config, "vision_config")
