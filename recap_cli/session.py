"""A session: one model, one drafter, a stream of requests that share the drafter's persistent memory."""

from __future__ import annotations

import copy
import glob
import logging
import os
import pickle
import re
import threading
import time
from collections.abc import Callable, Hashable
from pathlib import Path

import torch
from PIL import Image

from .adapters import Adapter, Message, Prompt
from .decoding.batched import Batch, BatchEngine
from .decoding.batched_static import StaticBatchEngine
from .drafters import Drafter, make_drafter
from .decoding.engine import Engine, Generation, generate
from .decoding.sampling import GREEDY, Picker, Settings
from .prefix_cache import PrefixCache, auto_megabytes
from .records import as_parts, first_line, user_message

MEMORY_FORMAT, MEMORY_VERSION = "recap-memory", 8  # 3: RECAP keeps the stream memory; 4: its chances per
# class; 5: the placed calibration has a lane for openings; 6: how the stream's openings kept their promises;
# 7: the stream's chances have a class for skips; 8: and a match-length bucket for 20 tokens and more
log = logging.getLogger(__name__)


class MemoryFileError(ValueError):
    """A --memory file that cannot be used; the message is one sentence for the user."""


class Session:
    """Loaded once per ``recap run``; per-request memories reset inside the drafter, order 1 carries over.

    ``sampling`` is how the run picks tokens (decoding/sampling.py; records may override it); plain greedy by
    default. A sampling run without a seed draws one here, so every record can say which it used."""

    def __init__(self, adapter: Adapter, method: str = "recap", static: bool = False, compile: bool = False,
                 batch: int = 1, sampling: Settings = GREEDY, prefix_cache: float | str = 0, **knobs):
        """``prefix_cache``: megabytes of prefill results kept for reuse across requests; ``auto`` (what
        ``recap run`` uses): a tenth of the model's weights, at least 64 MB; 0 (the default here): off."""
        if batch < 1:
            raise ValueError("batch is at least 1")
        if prefix_cache != "auto" and not (isinstance(prefix_cache, (int, float)) and prefix_cache >= 0):
            raise ValueError("--prefix-cache is a size in MB, 0 or more")
        self.adapter = adapter
        self.method = method
        self.batch = batch
        self.sampling = sampling.seeded()
        banned = [adapter.image_token_id] if adapter.image_token_id is not None else []
        self.drafter = make_drafter(method, adapter.vocab_size, banned=banned, stops=adapter.eos_token_ids, **knobs)
        top_k = getattr(self.drafter, "top_k", 8)
        self.engine = Engine(adapter, top_k=top_k, static=static, compile=compile,
                             min_capacity=4096 if compile else 0)
        self.batch_engine: BatchEngine | None = None
        if batch > 1:
            self.batch_engine = (StaticBatchEngine(adapter, top_k=top_k, max_batch=batch, compile=compile)
                                 if static or compile else BatchEngine(adapter, top_k=top_k, max_batch=batch))
        self.steps = self.rows_stepped = 0  # batched steps and the rows they verified (occupancy)
        self._building = threading.Lock()
        self.prefix_refusal = adapter.reuse_refusal() if prefix_cache != 0 else None  # why reuse is off, if so
        megabytes = auto_megabytes(adapter.model) if prefix_cache == "auto" else prefix_cache
        self.prefixes = PrefixCache(megabytes) if megabytes > 0 and self.prefix_refusal is None else None
        self.engine.prefixes = self.prefixes
        if self.batch_engine is not None:
            self.batch_engine.prefixes = self.prefixes

    def warm_up(self, messages: list[Message], images: list[Image.Image]) -> float:
        """Compile / capture every step shape before timed work; seconds spent."""
        prompt = self.adapter.build(messages, images)
        try:
            if self.batch_engine is not None:  # every (slots x bucket) shape, timed for the cost model on the way
                return self.batch_engine.measure_costs(prompt)
            return self.engine.warm_up(prompt)
        finally:
            self.clear_prefixes()  # the warm-up prompt is no request's prefix

    def answer(self, messages: list[Message], images: list[Image.Image], max_new_tokens: int,
               picker: Picker | None = None) -> Generation:
        """One turn; ``picker`` is its token-choice rule (None: plain greedy)."""
        prompt, limit = self.prepare(messages, images, max_new_tokens)
        return self.decode(prompt, limit, picker)

    def decode(self, prompt: Prompt, limit: int, picker: Picker | None = None) -> Generation:
        """Decode one prepared turn at batch 1; what it leaves in the cache is kept for reuse (``Engine.hold``)."""
        gen = generate(self.engine, prompt, self.drafter, limit, picker)
        gen.prompt_tokens, gen.prefix_hit = prompt.length, self.engine.hit
        self.engine.hold(prompt, gen.tokens)
        return gen

    def prepare(self, messages: list[Message], images: list[Image.Image], max_new_tokens: int) -> tuple[Prompt, int]:
        """The prompt of one turn and the new tokens it may have. Preparation threads call this together: the
        processor runs one call at a time (a fast tokenizer reconfigured by one call while another encodes raises
        "Already borrowed"); image decoding, before it, runs in parallel."""
        with self._building:
            prompt = self.adapter.build(messages, images)
        return prompt, fit_context(self.adapter, prompt, max_new_tokens)

    def new_batch(self, keeps: Callable[[Hashable], bool] | None = None) -> Batch:
        """Rows for ``batch`` turns in flight, drafting from this session's drafter (its persistent memory);
        ``keeps(tag)``: that turn's conversation goes on, so its cache is offered for reuse when it leaves."""
        if self.batch_engine is None:
            raise ValueError("this session decodes one request at a time (batch=1)")
        return Batch(self.batch_engine, self.drafter, self.batch, on_step=self._count, keeps=keeps)

    def _count(self, rows: int) -> None:
        self.steps += 1
        self.rows_stepped += rows

    @property
    def occupancy(self) -> float | None:
        """Mean rows per batched step (None before any)."""
        return self.rows_stepped / self.steps if self.steps else None

    def reset_memory(self) -> None:
        """Forget everything learned from earlier requests: the drafter's memory and the prefix cache."""
        self.drafter.reset()
        self.clear_prefixes()

    def clear_prefixes(self) -> None:
        if self.prefixes is not None:
            self.prefixes.clear()

    def mark(self) -> tuple:
        """What each repeated run of the next request starts from (``recap compare --repeats``): the drafter's
        memories and the prefix cache as they are now, so a repeat cannot draft from, or reuse, its own earlier
        run. The last turn's cache, held for reuse in place, is let go: the first run overwrites it."""
        self.engine.held = None
        return copy.deepcopy(self.drafter), self.prefixes.mark() if self.prefixes is not None else None

    def rewind(self, mark: tuple) -> None:
        drafter, prefixes = mark
        self.drafter = copy.deepcopy(drafter)  # the mark stays as it was, for the next repeat
        self.engine.held = None
        if prefixes is not None:
            self.prefixes.rewind(prefixes)

    def save_memory(self, path: Path) -> bool:
        """Write everything that makes a later run warm (the drafter's ``state()``), atomically: a fixed temp
        name + rename, so a kill mid-save leaves at most one temp file, which the next save replaces. False when
        the method keeps nothing across requests. Through a symlink the file it points to is replaced (a rename
        onto the link would replace the link)."""
        state = self.drafter.state()
        if state is None:
            return False
        path = Path(path).resolve()
        tmp = path.with_name(f".{path.name}.tmp")
        _remove_stale_temps(path)
        try:
            torch.save({"format": MEMORY_FORMAT, "version": MEMORY_VERSION, "method": self.method,
                        "model": self._fingerprint(), "state": state}, tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return True

    def load_memory(self, path: Path, saved: dict | None = None) -> None:
        """Bring back a saved state, or raise MemoryFileError saying what is wrong; nothing changes on failure.
        ``saved``: what ``read_memory`` already read from ``path`` (the command line checks the file before the
        model loads); only the model's fingerprint and the drafter's own payload are left to check."""
        if type(self.drafter).state is Drafter.state:  # a method that keeps nothing across requests
            return
        saved = read_memory(path, self.method) if saved is None else saved
        check_model(saved, path, self._fingerprint())
        try:
            self.drafter.load_state(saved.get("state"))
        except ValueError as exc:
            raise MemoryFileError(f"{path} is damaged: {exc}") from exc

    def _fingerprint(self) -> str:
        return fingerprint(self.adapter.model.config.model_type, self.adapter.vocab_size)


def fingerprint(model_type: str, vocab_size: int) -> str:
    """The model a memory is saved for: it holds token ids, which only mean something to a model with the same
    architecture and vocabulary."""
    return f"{model_type}/{vocab_size}"


def check_model(saved: dict, path: Path, model: str) -> None:
    """MemoryFileError unless ``saved`` (``read_memory``'s) was saved for ``model`` (its ``fingerprint``): the same
    sentence whether the loaded model or its config (before it loads) tells."""
    if saved.get("model") != model:
        raise MemoryFileError(f"{path} was saved for model {saved.get('model')}, not {model}")


def read_memory(path: Path, method: str) -> dict:
    """A --memory file's contents, checked as far as no model is needed (readable, a recap memory, this version,
    saved by ``method``), or MemoryFileError: a damaged file stops a run before the model loads."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # torch's message advises weights_only=False: never for a memory file
        raise MemoryFileError(f"{path} is not a recap memory file (it holds Python objects other than tensors and "
                              "plain data)") from exc
    except Exception as exc:  # noqa: BLE001 - empty, truncated, random bytes, a folder, ...
        raise MemoryFileError(f"{path} is not a recap memory file ({type(exc).__name__}: "
                              f"{first_line(exc)})") from exc
    if not isinstance(saved, dict) or saved.get("format") != MEMORY_FORMAT:
        old = isinstance(saved, dict) and {"ids", "probs"} <= set(saved)
        raise MemoryFileError(f"{path} was written by an older recap (order-1 table only, no format version)"
                              if old else f"{path} is not a recap memory file")
    if saved.get("version") != MEMORY_VERSION:
        raise MemoryFileError(f"{path} has memory format version {saved.get('version')!r}; this recap reads "
                              f"version {MEMORY_VERSION}")
    if saved.get("method") != method:
        raise MemoryFileError(f"{path} was saved by --method {saved.get('method')}, not {method}")
    return saved


def keeps_memory(method: str) -> bool:
    """Whether ``method``'s drafter has anything for --memory to save (``ar`` keeps nothing across requests)."""
    return type(make_drafter(method, vocab_size=2)).state is not Drafter.state


def start_session(adapter: Adapter, method: str, knobs: dict, compiled: bool, batch: int = 1,
                  settings: Settings | None = None, warn: Callable[[str], None] = log.warning,
                  info: Callable[[str], None] = log.info) -> Session:
    """The session of a run (the command line's and every Ray worker's); with ``compiled``, every step shape is
    compiled up front, and a failure to compile falls back to eager decoding (the fast path must never cost a
    user the run). ``settings``: how tokens are picked (plain greedy when None). ``warn`` and ``info`` hear what
    people should know about it."""
    knobs = {**knobs, "sampling": settings or GREEDY}
    if not compiled:
        return Session(adapter, method, batch=batch, **knobs)
    try:
        session = Session(adapter, method, static=True, compile=True, batch=batch, **knobs)
        seconds = session.warm_up([as_parts(user_message("Hello.", False))], [])
    except Exception as exc:  # noqa: BLE001 - see the docstring
        warn(f"compiling the decoding steps failed ({type(exc).__name__}: {first_line(exc)}); decoding eagerly")
        return Session(adapter, method, batch=batch, **knobs)
    info(f"compiled the decoding steps in {seconds:.1f} s (once per run)")
    return session


def max_positions(adapter: Adapter) -> int | None:
    """How many positions the language model was built for (None when its config does not say): in the text
    config of Qwen2.5-VL and LLaVA-NeXT, at the top of a text model's."""
    return getattr(adapter.model.config.get_text_config(), "max_position_embeddings", None)


def fit_context(adapter: Adapter, prompt: Prompt, max_new_tokens: int) -> int:
    """The new tokens a request may have: prompt + new tokens fit the model's positions (past them a model
    answers garbage, and a huge limit never ends). A prompt that fits alone is a ValueError: that record fails."""
    limit = max_positions(adapter)
    if limit is None:
        return max_new_tokens
    if prompt.length >= limit:
        raise ValueError(f"the prompt is {prompt.length} tokens and the model reads at most {limit} "
                         "(prompt + new tokens): shorten it")
    return min(max_new_tokens, limit - prompt.length)


def _remove_stale_temps(path: Path) -> None:
    """Temp files of saves that were killed: ours (``.NAME.tmp``) and those of older recaps (``.NAME.`` + 8
    random characters, from tempfile.mkstemp)."""
    stale = re.compile(re.escape(f".{path.name}.") + r"(tmp|[a-z0-9_]{8})")
    for p in path.parent.glob(f".{glob.escape(path.name)}.*"):
        if stale.fullmatch(p.name) and p.is_file():
            p.unlink(missing_ok=True)


class GenerateSession:
    """transformers' own ``generate()``: what a user would run instead (``hf``), optionally with its prompt lookup
    (``hf-pld``). Same interface as ``Session`` so the same request code drives both. It takes the same settings;
    greedy ones (a penalty included) give recap's tokens, sampled ones draw from torch's generator (seeded from the
    same key, so reproducible), not recap's: the same distribution, other tokens."""

    def __init__(self, adapter: Adapter, method: str = "hf", sampling: Settings = GREEDY):
        if method not in ("hf", "hf-pld"):
            raise ValueError(f"unknown generate() method '{method}'")
        self.adapter = adapter
        self.method = method
        self.sampling = sampling.seeded()
        self._building = threading.Lock()

    def answer(self, messages: list[Message], images: list[Image.Image], max_new_tokens: int,
               picker: Picker | None = None) -> Generation:
        return self.decode(*self.prepare(messages, images, max_new_tokens), picker)

    def prepare(self, messages: list[Message], images: list[Image.Image], max_new_tokens: int) -> tuple[Prompt, int]:
        with self._building:  # see Session.prepare
            prompt = self.adapter.build(messages, images)
        return prompt, fit_context(self.adapter, prompt, max_new_tokens)

    def decode(self, prompt: Prompt, max_new_tokens: int, picker: Picker | None = None) -> Generation:
        # Every setting explicit: checkpoints such as Qwen2.5-VL ship a repetition penalty in their generation
        # config, which applies only when the run's settings say so (picker None is plain greedy).
        kw = dict(max_new_tokens=max_new_tokens, **(picker.settings if picker else GREEDY).generate_kwargs())
        if picker is not None and picker.settings.sampling:
            torch.manual_seed(picker.generator_seed())
        if self.method == "hf-pld":
            kw["prompt_lookup_num_tokens"] = 10
        model = self.adapter.model
        _sync(self.adapter.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=prompt.input_ids, attention_mask=torch.ones_like(prompt.input_ids),
                                 **prompt.model_inputs, **kw)
        _sync(self.adapter.device)
        # generate() does not split prefill from decoding: its whole time is booked as decoding.
        return Generation(tokens=out[0, prompt.length:].tolist(), verify_s=time.perf_counter() - t0,
                          prompt_tokens=prompt.length)

    def reset_memory(self) -> None:
        """generate() keeps nothing between requests."""

    def mark(self) -> None:
        """Nothing to return to (see ``Session.mark``)."""

    def rewind(self, mark: None) -> None:
        pass

    def save_memory(self, path: Path) -> bool:
        return False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
