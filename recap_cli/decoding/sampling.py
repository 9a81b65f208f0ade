"""The token-choice rule beyond plain greedy: the model's own generation settings, a repetition penalty, and seeded
sampling that gives the same tokens whatever the method, the batch or the tree.

**Settings** are what ``model.generate()`` would use: the checkpoint's ``generation_config`` resolved the way
transformers resolves it (unset fields take transformers' global defaults, such as top_k 50; temperature and the
filters act only with ``do_sample``), then recap's options on top. A setting recap cannot reproduce exactly (beam
search, n-gram bans, forced tokens, ...) is refused with one sentence naming it, never ignored.

**Per path.** Every tree node's logits are processed as ``generate()`` would process them had it reached that
node: the repetition penalty sees the node's *own* history (prompt + committed tokens + the node's ancestors, not
the tree's other branches). transformers' own processors do the work, in ``generate()``'s order (penalty,
temperature, top-k, top-p, min-p, typical, epsilon, eta); only the histories are ours. Nodes are batched by padding
each history with its root token, which it already holds: the penalty acts on the *set* of ids in the history, and
a repeated id does not change the set.

**The draw.** The token at output position t of turn ``turn`` of a request is the inverse CDF of the processed
distribution, tokens in id order, at one uniform u = U(seed, request key, turn, t) from a counter-based generator (a
keyed BLAKE2b hash of the counter). It depends on nothing else: not on the method, the batch, the tree or its
other nodes. A drafted child is accepted iff it equals the token drawn at its parent, exactly as in greedy mode, so
every method and batch size gives the same tokens for one seed; and since u at position t is independent of
everything before t, each token is drawn exactly from the model's processed distribution given what came before.
Inverse CDF rather than Gumbel-max: Gumbel-max needs one noise value per vocabulary entry per position (1.5e5
hashes per node for Qwen), the inverse CDF one uniform per position, shared by every node at that depth, plus a
cumulative sum the softmax already costs. With a top-k filter (transformers' default k is 50) the draw runs over
the k candidates only (ties at the k-th value kept, as ``TopKLogitsWarper`` keeps them), and with top-p alone over
the nucleus (``nucleus``: the same rule as ``TopPLogitsWarper``, without sorting the vocabulary).

Greedy settings (no sampling, or top_k 1, which leaves one token) pick the processed argmax, as ``generate()``
does (top_k 1 keeps every token tied at the top and samples among them; recap takes the lowest id). Scores are
processed in float32, as ``generate()`` processes them; the cumulative sum runs in float64. With nothing set there
is no processing at all: callers pass no ``Picker`` and plain greedy decoding runs as it always did.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import struct
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation import logits_process as lp

from ..options import GENERATION_CONFIGS as MODES  # noqa: F401 - re-exported
from ..options import check_settings as check  # noqa: F401 - re-exported
from . import compat
from .tree import Rows, Tree

CHUNK = 1 << 25  # scores processed at once (nodes x vocabulary): bounds the temporaries of a wide batched step


class SettingError(ValueError):
    """Settings recap cannot honour exactly; the message is one sentence for the user."""


@dataclass(frozen=True)
class Settings:
    """How each token is chosen. ``top_k`` 0 is off; filters and temperature act only when ``do_sample``."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float | None = None
    typical_p: float = 1.0
    epsilon_cutoff: float = 0.0
    eta_cutoff: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    @property
    def sampling(self) -> bool:
        """Whether tokens are drawn: ``do_sample``, unless top_k 1 leaves only the best token (then greedy)."""
        return self.do_sample and self.top_k != 1

    @property
    def plain(self) -> bool:
        """Plain greedy decoding: no processing at all."""
        return not self.sampling and self.repetition_penalty == 1.0

    def override(self, temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                 repetition_penalty: float | None = None, seed: int | None = None) -> "Settings":
        """These settings with the user's on top (recap's options, or a record's fields). Asking for a
        temperature, top-p or top-k asks to sample; temperature 0 asks for greedy decoding."""
        check(dict(temperature=temperature, top_p=top_p, top_k=top_k, repetition_penalty=repetition_penalty,
                   seed=seed))
        s = self
        if temperature is not None or top_p is not None or top_k is not None:
            s = replace(s, do_sample=True)
        if temperature is not None:
            s = replace(s, temperature=float(temperature)) if temperature > 0 else replace(s, do_sample=False)
        if top_p is not None:
            s = replace(s, top_p=float(top_p))
        if top_k is not None:
            s = replace(s, top_k=int(top_k))
        if repetition_penalty is not None:
            s = replace(s, repetition_penalty=float(repetition_penalty))
        if seed is not None:
            s = replace(s, seed=int(seed))
        if s.sampling and s.temperature <= 0:
            raise SettingError(f"sampling needs a temperature above 0, and the base settings have "
                               f"{s.temperature}: give a temperature")
        return s

    def seeded(self) -> "Settings":
        """With a seed: the given one, else a drawn one (written to every sampled record, so a run can be
        reproduced)."""
        return self if self.seed is not None else replace(self, seed=secrets.randbits(32))

    def describe(self) -> dict[str, Any]:
        """What the records and the summary say: the settings that take effect (a greedy run's temperature does
        nothing, so it is not reported), with the seed when tokens are drawn."""
        if not self.sampling:  # top_k 1 is said, so a record of a do_sample config explains itself
            return {"do_sample": False, **({"top_k": 1} if self.do_sample else {}),
                    "repetition_penalty": self.repetition_penalty}
        out = {k: v for k, v in asdict(self).items() if k not in ("min_p", "typical_p", "epsilon_cutoff",
                                                                  "eta_cutoff")}
        out["do_sample"] = True
        for key, off in (("min_p", None), ("typical_p", 1.0), ("epsilon_cutoff", 0.0), ("eta_cutoff", 0.0)):
            if getattr(self, key) != off:
                out[key] = getattr(self, key)
        return out

    def generate_kwargs(self) -> dict[str, Any]:
        """The same settings for transformers' ``generate()``: every one given explicitly, so nothing of the
        checkpoint's generation config that recap did not resolve can slip in."""
        defaults, blank = compat.generation_defaults(), GenerationConfig()
        kw: dict[str, Any] = {name: defaults.get(name) for name, _, _ in REFUSED if hasattr(blank, name)}
        kw.update(do_sample=self.sampling, repetition_penalty=self.repetition_penalty)
        if self.sampling:
            kw.update(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p or 0.0,
                      typical_p=self.typical_p, epsilon_cutoff=self.epsilon_cutoff, eta_cutoff=self.eta_cutoff)
        return kw


GREEDY = Settings()


# What recap cannot reproduce exactly: generation config fields (with transformers' defaults filled in) whose
# value would change the tokens generate() picks, and what they do. Lengths (max_new_tokens, max_length) are not
# here: recap's own --max-new-tokens sets those.
def _on(value: Any, off: Any = None) -> bool:
    return value is not None and value != off and value != [] and value != {}


REFUSED: list[tuple[str, Any, str]] = [
    ("num_beams", lambda v, c: (v or 1) > 1, "beam search"),
    ("num_beam_groups", lambda v, c: (v or 1) > 1, "group beam search"),
    ("num_return_sequences", lambda v, c: (v or 1) > 1, "several answers per request"),
    ("penalty_alpha", lambda v, c: _on(v, 0.0) and not c("do_sample") and (c("top_k") or 0) > 1,
     "contrastive search"),
    ("dola_layers", lambda v, c: _on(v), "DoLa decoding"),
    ("guidance_scale", lambda v, c: _on(v, 1.0), "classifier-free guidance"),
    ("sequence_bias", lambda v, c: _on(v), "a per-sequence bias"),
    ("encoder_repetition_penalty", lambda v, c: _on(v, 1.0), "a penalty on the prompt's tokens"),
    ("no_repeat_ngram_size", lambda v, c: _on(v, 0), "an n-gram ban"),
    ("encoder_no_repeat_ngram_size", lambda v, c: _on(v, 0), "an n-gram ban"),
    ("bad_words_ids", lambda v, c: _on(v), "banned token sequences"),
    ("force_words_ids", lambda v, c: _on(v), "forced words"),
    ("constraints", lambda v, c: _on(v), "constrained beam search"),
    ("min_length", lambda v, c: _on(v, 0), "a minimum length"),
    ("min_new_tokens", lambda v, c: _on(v, 0), "a minimum length"),
    ("forced_bos_token_id", lambda v, c: _on(v), "a forced first token"),
    ("forced_eos_token_id", lambda v, c: _on(v), "a forced last token"),
    ("remove_invalid_values", lambda v, c: bool(v), "replacing invalid logits"),
    ("exponential_decay_length_penalty", lambda v, c: _on(v), "a length penalty on the end token"),
    ("suppress_tokens", lambda v, c: _on(v), "suppressed tokens"),
    ("begin_suppress_tokens", lambda v, c: _on(v), "tokens suppressed at the start"),
    ("watermarking_config", lambda v, c: _on(v), "watermarking"),
    ("stop_strings", lambda v, c: _on(v), "stop strings"),
    ("top_h", lambda v, c: _on(v) and c("do_sample"), "top-H sampling"),
]


def from_model(config: Any) -> Settings:
    """What ``model.generate()`` would use from this generation config (None: transformers' defaults alone); a
    SettingError names the first setting recap cannot reproduce exactly."""
    defaults = compat.generation_defaults()

    def value(name: str) -> Any:
        v = getattr(config, name, None) if config is not None else None
        return defaults.get(name) if v is None else v

    for name, applies, what in REFUSED:
        if applies(value(name), value):
            raise SettingError(f"the model's generation config sets {name} {value(name)!r} ({what}), which recap "
                               "cannot reproduce exactly: use --generation-config greedy (recap's own options "
                               "still apply), or remove it from generation_config.json")
    temperature = float(value("temperature"))
    if value("do_sample") and temperature <= 0:
        raise SettingError(f"the model's generation config samples at temperature {temperature}, which "
                           "transformers refuses: use --generation-config greedy or --temperature")
    # Sampling fields are kept when do_sample is off: they are what a later --temperature samples with, as
    # generate(temperature=...) would.
    return Settings(do_sample=bool(value("do_sample")), temperature=temperature, top_k=int(value("top_k") or 0),
                    top_p=float(value("top_p")), min_p=value("min_p"), typical_p=float(value("typical_p")),
                    epsilon_cutoff=float(value("epsilon_cutoff")), eta_cutoff=float(value("eta_cutoff")),
                    repetition_penalty=float(value("repetition_penalty")))


def resolve(config: Any, mode: str = "model", **given: Any) -> Settings:
    """The run's settings: the model's (``mode="model"``) or plain greedy, with the user's options on top."""
    if mode not in MODES:
        raise SettingError(f"--generation-config takes {' or '.join(MODES)}, not '{mode}'")
    base = from_model(config if mode == "model" else None)  # greedy: transformers' defaults alone (top_k 50, ...)
    return base.override(**given)


def sentence(settings: Settings) -> str:
    """The settings in words, for people (stderr, report headers)."""
    penalty = f", repetition penalty {settings.repetition_penalty:g}" if settings.repetition_penalty != 1.0 else ""
    if not settings.sampling:
        why = " (top-k 1 leaves one token)" if settings.do_sample else ""
        return f"greedy{why}{penalty}"
    parts = [f"temperature {settings.temperature:g}", f"top-k {settings.top_k}" if settings.top_k else "no top-k",
             f"top-p {settings.top_p:g}"]
    parts += [f"{key.replace('_', '-')} {getattr(settings, key):g}" for key, off in
              (("min_p", None), ("typical_p", 1.0), ("epsilon_cutoff", 0.0), ("eta_cutoff", 0.0))
              if getattr(settings, key) != off]
    return f"sampling at {', '.join(parts)}{penalty}, seed {settings.seed}"


# --- the draw -------------------------------------------------------------------------------------------------

def uniform(seed: int, key: bytes, turn: int, t: int) -> float:
    """U(seed, request key, turn, position) in [0, 1): a counter-based generator (BLAKE2b of the counter, keyed by
    the seed), 53 random bits, the same on every machine and in every process."""
    counter = struct.pack("<QQ", turn, t) + key
    digest = hashlib.blake2b(counter, digest_size=8, key=seed.to_bytes(8, "little")).digest()
    return (int.from_bytes(digest, "little") >> 11) * 2.0 ** -53


class Picker:
    """One turn's token choice: its settings, the key its draws hang on, and its history so far (prompt +
    committed tokens, for the penalty). ``start`` at the prompt, ``extend`` with every committed token."""

    def __init__(self, settings: Settings, key: bytes, turn: int = 0):
        if settings.sampling and settings.seed is None:
            raise ValueError("sampling needs a seed (Settings.seeded() draws one)")
        self.settings, self.key, self.turn = settings, key, turn
        self.history: torch.Tensor | None = None
        self.t = 0  # output position of the next token

    def start(self, prompt_ids: torch.Tensor) -> None:
        """A new turn: its prompt is the whole history (1-D ids on the model's device)."""
        self.history = prompt_ids if self.settings.repetition_penalty != 1.0 else None
        self.t = 0

    def extend(self, tokens: list[int]) -> None:
        if self.history is not None:
            self.history = torch.cat([self.history, torch.tensor(tokens, device=self.history.device)])
        self.t += len(tokens)

    def uniforms(self, depths: list[int]) -> list[float]:
        """The uniform of each node: a node at depth d draws the token at output position t + d."""
        seen: dict[int, float] = {}
        for d in set(depths):
            seen[d] = uniform(self.settings.seed, self.key, self.turn, self.t + d)
        return [seen[d] for d in depths]

    def generator_seed(self) -> int:
        """A seed for torch's generator, for ``generate()`` (hf), derived from the same key: reproducible, but its
        draws are torch's, not recap's."""
        return int(uniform(self.settings.seed, self.key, self.turn, 1 << 62) * 2 ** 53)


def request_key(line: int, rid: Any) -> bytes:
    """What a request's draws hang on: its input line and id, never its batch row or the method."""
    return repr((line, rid)).encode()


def choose(logits: torch.Tensor, trees: list[Tree], pickers: list[Picker | None], k: int) -> tuple[list[int], Rows]:
    """Each node's token and top-k rows (renormalised over k), ``logits`` holding the trees' nodes in order;
    a tree without a picker is decoded greedily from its raw logits. One host copy, like ``greedy_and_rows``.

    Rows come from the *processed* scores: they are what the drafters learn the next choice from, and under a
    penalty or sampling the processed distribution is what the choice follows (its probability of a child is the
    child's chance of acceptance), where the raw one would keep proposing what the penalty or filters push away."""
    packed = torch.empty((logits.shape[0], 1 + 2 * k), dtype=torch.float32, device=logits.device)
    groups: dict[Settings | None, list[int]] = {}
    for r, picker in enumerate(pickers):
        groups.setdefault(picker.settings if picker is not None else None, []).append(r)
    starts = [0]
    for tree in trees:
        starts.append(starts[-1] + len(tree))
    for settings, rows in groups.items():
        nodes = [i for r in rows for i in range(starts[r], starts[r + 1])]
        at: slice | torch.Tensor = slice(None) if len(groups) == 1 else torch.tensor(nodes, device=logits.device)
        part = logits[at]
        if settings is None:
            packed[at] = _pack(part, part.argmax(-1), None, k)
            continue
        done = 0
        for chunk in _chunks(rows, trees, max(1, CHUNK // logits.shape[-1])):
            n = sum(len(trees[r]) for r in chunk)
            packed_part = _process(part[done:done + n], [trees[r] for r in chunk], [pickers[r] for r in chunk],
                                   settings, k)
            if isinstance(at, slice):
                packed[done:done + n] = packed_part
            else:
                packed[at[done:done + n]] = packed_part
            done += n
    packed = packed.cpu()
    return packed[:, 0].long().tolist(), Rows(ids=packed[:, 1:k + 1].long(), probs=packed[:, k + 1:])


def _chunks(rows: list[int], trees: list[Tree], most: int) -> list[list[int]]:
    """Whole trees, as many as fit ``most`` nodes (at least one tree) at a time."""
    out: list[list[int]] = [[]]
    size = 0
    for r in rows:
        if out[-1] and size + len(trees[r]) > most:
            out.append([])
            size = 0
        out[-1].append(r)
        size += len(trees[r])
    return out


def _pack(scores: torch.Tensor, chosen: torch.Tensor, ids: torch.Tensor | None, k: int) -> torch.Tensor:
    """(chosen, top-k ids, top-k probabilities renormalised over k) per node, as float32 (ids exact below 2**24).
    ``ids`` maps columns of ``scores`` to token ids when scores hold candidates only."""
    top = scores.topk(k, dim=-1)
    top_ids = top.indices if ids is None else ids.gather(-1, top.indices)
    return torch.cat([chosen.float()[:, None], top_ids.float(), torch.softmax(top.values.float(), -1)], dim=1)


def _process(logits: torch.Tensor, trees: list[Tree], pickers: list[Picker], settings: Settings,
             k: int) -> torch.Tensor:
    """The processed scores of these trees' nodes (all under ``settings``), each node's choice, packed."""
    scores = logits.float()  # generate() processes float32 scores
    if settings.repetition_penalty != 1.0:
        penalty = lp.RepetitionPenaltyLogitsProcessor(settings.repetition_penalty)
        scores = penalty(histories(trees, pickers), scores)
    if not settings.sampling:
        return _pack(scores, scores.argmax(-1), None, k)
    if settings.temperature != 1.0:
        scores = lp.TemperatureLogitsWarper(settings.temperature)(None, scores)
    ids = None  # the vocabulary, or (top-k, top-p) the candidates' token ids, in id order
    if settings.top_k:
        scores, ids = top_k(scores, settings.top_k, k)
        if settings.top_p < 1.0:
            scores = lp.TopPLogitsWarper(settings.top_p)(None, scores)
    elif settings.top_p < 1.0:
        scores, ids = nucleus(scores, settings.top_p, k)
    for warper in warpers(settings, scores.device):
        scores = warper(None, scores)
    u = torch.tensor([x for tree, p in zip(trees, pickers) for x in p.uniforms(tree.depths())],
                     dtype=torch.float64, device=scores.device)
    chosen = draw(scores, u)
    return _pack(scores, chosen if ids is None else ids.gather(-1, chosen[:, None])[:, 0], ids, k)


def draw(scores: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: the first column whose cumulative probability exceeds u (columns in token-id order). The sum
    runs in float64; x is held below the total, so a zero-probability column can never be chosen."""
    cdf = torch.softmax(scores, -1).double().cumsum(-1)
    total = cdf[:, -1:]
    x = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True)[:, 0]


def top_k(scores: torch.Tensor, k_top: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TopKLogitsWarper over the candidates alone: the scores at or above the k-th (ties kept, as it keeps them),
    at least ``k`` columns (the rest -inf), in token-id order, and their ids."""
    k_top = min(k_top, scores.shape[-1])
    values, ids = scores.topk(min(scores.shape[-1], max(k, k_top)), dim=-1)
    kth = values[:, k_top - 1:k_top]
    tied = int((scores >= kth).sum(-1).max())  # more than k_top where scores tie at the k-th
    if tied > values.shape[-1]:
        values, ids = scores.topk(tied, dim=-1)
    return _in_id_order(values, ids, kth)


def nucleus(scores: torch.Tensor, top_p: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TopPLogitsWarper without sorting the vocabulary: a token is kept iff the probability of the tokens ranked
    above it is below ``top_p`` (transformers removes a token iff the ascending cumulative probability up to it is
    at most 1 - top_p: the same rule, summed here in float64 from the top where transformers sums float32 from the
    bottom, so a token within that rounding of the boundary may be judged otherwise). Candidates grow from the top
    until they hold ``top_p`` in every row, so every kept token is among them."""
    lse = scores.logsumexp(-1, keepdim=True)
    width = min(scores.shape[-1], max(k, 64))
    while True:
        values, ids = scores.topk(width, dim=-1)
        probs = (values - lse).double().exp()
        if width == scores.shape[-1] or bool((probs.sum(-1) >= top_p).all()):
            break
        width = min(scores.shape[-1], 4 * width)
    removed = probs.cumsum(-1) - probs >= top_p
    removed[:, 0] = False  # the best token always stays (min_tokens_to_keep 1), top_p 0 included: greedy
    return _in_id_order(values.masked_fill(removed, -math.inf), ids, None)


def _in_id_order(values: torch.Tensor, ids: torch.Tensor, floor: torch.Tensor | None):
    """Candidates sorted by token id (the draw must not depend on how topk orders ties), those below ``floor``
    -inf."""
    if floor is not None:
        values = values.masked_fill(values < floor, -math.inf)
    ids, order = ids.sort(-1)
    return values.gather(-1, order), ids


def warpers(settings: Settings, device: torch.device) -> list:
    """transformers' warpers after top-p, in generate()'s order (history-free: they act on the candidates)."""
    out: list = []
    if settings.min_p is not None:
        out.append(lp.MinPLogitsWarper(settings.min_p))
    if settings.typical_p < 1.0:
        out.append(lp.TypicalLogitsWarper(settings.typical_p))
    if 0.0 < settings.epsilon_cutoff < 1.0:
        out.append(lp.EpsilonLogitsWarper(settings.epsilon_cutoff))
    if 0.0 < settings.eta_cutoff < 1.0:
        out.append(lp.EtaLogitsWarper(settings.eta_cutoff, device=device))
    return out


def histories(trees: list[Tree], pickers: list[Picker]) -> torch.Tensor:
    """(nodes, L) token ids: each node's own history (its picker's prompt + committed tokens, then the node's
    path below the root), padded with the root token, which every history already holds."""
    longest = max(p.history.numel() for p in pickers)
    deepest = max(max(tree.depths()) for tree in trees)
    contexts, paths, owner = [], [], []
    for r, (tree, p) in enumerate(zip(trees, pickers)):
        root = tree.tokens[0]
        contexts.append(torch.nn.functional.pad(p.history, (0, longest - p.history.numel()), value=root))
        lines: list[list[int]] = []
        for i, parent in enumerate(tree.parents):
            line = lines[parent] + [tree.tokens[i]] if parent >= 0 else []
            lines.append(line)
            paths.append(line + [root] * (deepest - len(line)))
        owner.extend([r] * len(tree))
    device = pickers[0].history.device
    context = torch.stack(contexts)[torch.tensor(owner, device=device)]
    return torch.cat([context, torch.tensor(paths, dtype=context.dtype, device=device).view(len(owner), deepest)], 1)
