"""The models recap knows by short name, and which of them are on disk: what `recap models` lists.

Plain data and Hugging Face cache look-ups, no torch or transformers, so that `recap models` and `recap --help`
start at once; ``models`` re-exports all of it beside the downloading and loading.
"""

from __future__ import annotations

from pathlib import Path

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

# Weight formats that transformers' PyTorch loading never reads: a download skips them (some repos carry several).
SKIP_FILES = ["*.h5", "*.msgpack", "*.onnx", "*.onnx_data", "*.gguf", "*.ot", "*.tflite", "*.mlmodel",
              "flax_model*", "tf_model*", "onnx/*", "openvino/*", "coreml/*"]

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


def cached(repo: str) -> str | None:
    """The complete local snapshot of ``repo`` in the Hugging Face cache, or None (missing or partial)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo, local_files_only=True, ignore_patterns=SKIP_FILES)
    except (LocalEntryNotFoundError, ValueError):  # ValueError: not a valid repo id
        return None


def on_disk() -> list[tuple[str, str, str, int | None]]:
    """(name, source, state, bytes on disk) for every registry model; state is "on disk", "partial" (an
    interrupted download, which the next run resumes) or "not downloaded"."""
    from huggingface_hub import constants, scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        sizes = {r.repo_id: r.size_on_disk for r in scan_cache_dir(constants.HF_HUB_CACHE).repos
                 if r.repo_type == "model"}
    except CacheNotFound:
        sizes = {}
    rows = []
    for alias, source in REGISTRY.items():
        if Path(source).is_dir():
            rows.append((alias, source, "on disk", sum(f.stat().st_size for f in Path(source).rglob("*")
                                                        if f.is_file())))
        elif source in sizes:
            rows.append((alias, source, "on disk" if cached(source) else "partial", sizes[source]))
        else:
            rows.append((alias, source, "not downloaded", None))
    return rows
