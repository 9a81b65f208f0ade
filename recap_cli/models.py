"""Model registry and loading: short names or local directories -> a ready adapter.

Loading never hangs on a missing hub: a registry name is looked up in the local Hugging Face cache first, and
any failure becomes one ``ModelError`` sentence for the CLI to print.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .adapters import Adapter, LlavaNextAdapter, QwenVLAdapter
from .records import first_line

# The demo model ships inside the package (trained by recap_cli/demo/train.py on the synthetic world).
DEMO_MODEL = Path(__file__).resolve().parent / "demo" / "model"

REGISTRY: dict[str, str] = {
    "demo": str(DEMO_MODEL),
    "qwen2.5-vl-7b": "Qwen/Qwen2.5-VL-7B-Instruct",
    "qwen2.5-vl-3b": "Qwen/Qwen2.5-VL-3B-Instruct",
    "qwen2.5-vl-32b": "Qwen/Qwen2.5-VL-32B-Instruct",
    "llava-1.6-7b": "llava-hf/llava-v1.6-vicuna-7b-hf",
    "llava-1.6-13b": "llava-hf/llava-v1.6-vicuna-13b-hf",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
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
    except (OSError, ValueError) as exc:
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
    if config.model_type in ("qwen2_5_vl", "llava_next"):
        model = AutoModelForImageTextToText.from_pretrained(source, **load_kw).to(device).eval()
        processor = AutoProcessor.from_pretrained(source, **kw)
        cls = QwenVLAdapter if config.model_type == "qwen2_5_vl" else LlavaNextAdapter
        return cls(model, processor)
    if _is_vision_config(config):
        raise ModelError(f"model type '{config.model_type}' is not supported yet: recap knows qwen2_5_vl, "
                         "llava_next and text-only causal LMs")
    model = AutoModelForCausalLM.from_pretrained(source, **load_kw).to(device).eval()
    return Adapter(model, AutoTokenizer.from_pretrained(source, **kw))


def _is_vision_config(config) -> bool:
    return hasattr(config, "vision_config")
