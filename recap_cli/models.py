"""Model registry, download and loading: short names, hub repo ids or local directories -> a ready adapter.

A hub model is looked up in the standard Hugging Face cache first and downloaded there with huggingface_hub when
it is missing (resumable, like ``hf download``), unless offline mode is on. Every failure becomes one
``ModelError`` sentence for the CLI to print: no network, no such repo and a gated repo each say what to do.
"""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch

from .adapters import Adapter, Gemma3Adapter, LlavaNextAdapter, QwenVLAdapter, VisionAdapter
from .decoding import compat
from .decoding.compat import hub_network_errors
from .options import check_loading
from .records import first_line
from .registry import DEMO_MODEL, FAMILIES, REGISTRY, SKIP_FILES, cached, on_disk  # noqa: F401 - re-exported

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
    if name.count("/") == 1 and not Path(name).exists() and _valid_repo_id(name):
        return name
    known = ", ".join(sorted(REGISTRY))
    raise ModelError(f"unknown model '{name}': use one of {known}, a hub repo id, or a local model directory")


def offline_mode() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub saw it at import, or as the environment says now."""
    from huggingface_hub import is_offline_mode

    now = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")
    return is_offline_mode() or now


def locate(name: str, offline: bool = False, progress: bool = True,
           notify: Callable[[str], None] | None = None) -> str:
    """A model name -> a local directory, downloading a hub model the cache lacks (``notify`` hears about it).

    ``progress`` shows huggingface_hub's download bars on stderr; ``offline`` (or HF_HUB_OFFLINE) never asks the hub.
    """
    source = resolve(name)
    if Path(source).is_dir():
        return source
    if (path := cached(source)) is not None:
        return path
    if offline or offline_mode():
        raise ModelError(f"model '{source}' is not in the local Hugging Face cache and offline mode is on "
                         f"(--offline or HF_HUB_OFFLINE): run `hf download {source}` where the hub can be reached, "
                         "or pass a local model directory")
    if notify is not None:
        notify(f"downloading {source} into the Hugging Face cache (an interrupted download resumes on the next run)")
    with _hub_progress(progress):
        return download(source)


def architecture(name: str) -> tuple[str, int] | None:
    """``name``'s model type and vocabulary size (what a --memory file is saved for, ``session.fingerprint``) from
    its config.json alone, where this machine has it (a local directory, a hub model in the cache): a memory of
    another model then stops a run before any weights load or a Ray cluster starts. None where it has not (a hub
    model not downloaded here: the loaded model, or each Ray worker's, is checked then) or the config cannot be read
    (loading says why). A model built from the config has as many output rows as its text config's vocabulary."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(locate(name, offline=True))  # never downloads: raises where not here
        return config.model_type, int(config.get_text_config().vocab_size)
    except Exception:  # noqa: BLE001 - a model that cannot be found or read is the load's to report
        return None


def download(repo: str) -> str:
    """Fetch ``repo`` into the standard cache (resuming any partial files) and return its snapshot directory."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError)

    unreachable = (f"the Hugging Face hub cannot be reached to download '{repo}': run `hf download {repo}` where "
                   "it can, or pass a local model directory")
    try:
        return snapshot_download(repo, ignore_patterns=SKIP_FILES)
    except GatedRepoError as exc:  # before RepositoryNotFoundError, its base class
        raise ModelError(f"model '{repo}' is gated: accept its licence at https://huggingface.co/{repo}, then log "
                         "in with `hf auth login` (or set HF_TOKEN)") from exc
    except RepositoryNotFoundError as exc:
        raise ModelError(f"there is no model '{repo}' on the Hugging Face hub (if it is private, log in with "
                         "`hf auth login` or set HF_TOKEN)") from exc
    except LocalEntryNotFoundError as exc:  # how snapshot_download reports a hub it could not reach
        raise ModelError(unreachable) from exc
    except hub_network_errors() as exc:
        raise ModelError(unreachable) from exc
    except HfHubHTTPError as exc:
        raise ModelError(f"downloading '{repo}' failed: {first_line(exc)}") from exc
    except OSError as exc:  # a full disk or an unwritable cache folder
        raise ModelError(f"downloading '{repo}' failed: {first_line(exc)}") from exc


@contextmanager
def _hub_progress(show: bool) -> Iterator[None]:
    """huggingface_hub's download bars on or off for one download, then as they were (HF_HUB_DISABLE_PROGRESS_BARS
    keeps them off)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    (enable_progress_bars if show and not constants.HF_HUB_DISABLE_PROGRESS_BARS else disable_progress_bars)()
    try:
        yield
    finally:
        (disable_progress_bars if was_disabled else enable_progress_bars)()


@contextmanager
def _no_loading_bars() -> Iterator[None]:
    """transformers draws its own "Loading weights" bar even into a log file; recap shows loading as a stage."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars
    from transformers.utils import logging as hf_logging

    was_on, hub_was_off = hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled()
    hf_logging.disable_progress_bar()  # (this switches huggingface_hub's bars too)
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
        if hub_was_off:
            disable_progress_bars()


def _valid_repo_id(name: str) -> bool:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError("--device cuda was asked for but no CUDA device is available")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


def freeze_loaded() -> None:
    """Take every object alive now (imported code, the model's modules, parameters and processor: some 400,000
    objects with the demo model) out of the cyclic garbage collector's scans for the rest of the process. They
    live as long as the run, and a full collection would walk all of them inside whichever drafting step set it
    off: in a demo `recap compare`, one full collection 10 s into the run stalled one request's drafting for
    0.35 s. What a frozen object holds is still freed when nothing refers to it; only cycles among them stay.
    A process-wide setting, so the commands call it after loading, not ``load`` (a library call)."""
    gc.collect()
    gc.freeze()


def load(name: str, device: str = "auto", dtype: str = "auto", attn: str = "sdpa", offline: bool = False,
         progress: bool = False, notify: Callable[[str], None] | None = None) -> Adapter:
    """Load model + processor (downloading them first if needed) and wrap them in their architecture's adapter."""
    try:
        check_loading(device, dtype, attn)  # the names the command line checks before it loads anything
    except ValueError as exc:
        raise ModelError(str(exc)) from None
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    source = locate(name, offline=offline, progress=progress, notify=notify)
    try:
        with _no_loading_bars():
            return _load(source, dev, dt, attn)
    except ModelError:
        raise
    except (OSError, ValueError, ImportError) as exc:  # ImportError: a processor's optional package is missing
        if isinstance(exc, ImportError) and (broken := broken_torchvision()) is not None:
            raise ModelError(broken) from exc
        raise ModelError(f"could not load model '{name}' ({source}): {first_line(exc)}") from exc


def broken_torchvision() -> str | None:
    """One sentence when torchvision is installed but cannot be imported, else None. A torch/torchvision pair
    built for each other is needed (a mismatch fails with "operator torchvision::nms does not exist"), and
    transformers reports it only as "Could not import module 'AutoProcessor'" (it checks that torchvision is
    installed, not that it imports)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("torchvision")
    except PackageNotFoundError:
        return None
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - RuntimeError (operators missing), ImportError, OSError (libraries)
        return (f"torchvision {installed} does not work with torch {torch.__version__} (import torchvision: "
                f"{first_line(exc)}): install a matching pair, e.g. on a CPU-only machine `pip install "
                "--force-reinstall torch torchvision --index-url https://download.pytorch.org/whl/cpu`, or both "
                "from the index that matches your CUDA")
    return None


def _load(source: str, device: torch.device, dtype: torch.dtype, attn: str) -> Adapter:
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor,
                              AutoTokenizer)

    kw: dict = {}  # source is a local directory by now (locate() resolved hub ids to their snapshots)
    try:
        config = AutoConfig.from_pretrained(source, **kw)
    except OSError as exc:
        raise ModelError(f"{source} holds no model (no readable config.json): pass a model directory, a hub repo id "
                         "or a short name from `recap models`") from exc
    load_kw = dict(dtype=dtype, attn_implementation=compat.attention_name(attn), **kw)
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
