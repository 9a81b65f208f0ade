"""Answer a stream of requests with one session and turn each into one output record."""

from __future__ import annotations

from collections import Counter
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass, field

from PIL import Image

from .adapters import Adapter, Message, Prompt
from .decoding.engine import Generation
from .decoding.sampling import GREEDY, Picker, Settings, request_key
from .records import Request, as_parts, first_line, load_image, user_message
from .session import GenerateSession, Session
from .decoding.tree import Source

SOURCE_KEYS = {s.name: s.name.lower() for s in Source if s not in (Source.ROOT, Source.OTHER)}


@dataclass
class Totals:
    """What the end-of-run summary reports."""

    items: int = 0
    errors: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    emitted_in_steps: int = 0
    by_source: Counter = field(default_factory=Counter)

    def add(self, record: dict) -> None:
        self.items += 1
        if record["error"] is not None:
            self.errors += 1
            return
        self.new_tokens += record["new_tokens"]
        self.seconds += (record["prefill_ms"] + record["decode_ms"]) / 1000
        self.steps += record["steps"]
        self.emitted_in_steps += record["new_tokens"] - record["turns"]  # each turn's first token is prefill's
        self.by_source.update(record["tokens_by_source"])

    @property
    def answered(self) -> int:
        """Items that got an answer (error records are items too, but no work a rate should count)."""
        return self.items - self.errors

    def summary(self) -> dict:
        return {
            "items": self.items, "errors": self.errors, "answered": self.answered, "new_tokens": self.new_tokens,
            "tokens_per_s": self.new_tokens / self.seconds if self.seconds else 0.0,
            "mean_accepted": self.emitted_in_steps / self.steps if self.steps else 0.0,
            "tokens_by_source": dict(self.by_source),
        }


def run_figures(totals: Totals, wall_s: float, batch: int, occupancy: float | None) -> dict:
    """What people captioning a folder measure: answered requests per hour (a failed line costs next to nothing and
    is no answer) and tokens per second of wall time, and how full the batch was (mean rows per step; None at
    batch 1)."""
    return {"batch": batch, "wall_s": wall_s, "mean_occupancy": occupancy,
            "requests_per_hour": 3600 * totals.answered / wall_s if wall_s else 0.0,
            "wall_tokens_per_s": totals.new_tokens / wall_s if wall_s else 0.0}


def answer(session: Session | GenerateSession, req: Request, model: str, max_new_tokens: int) -> dict:
    """The output record for one request; any per-request failure becomes its ``error``."""
    return answer_with_tokens(session, req, model, max_new_tokens)[0]


def answer_with_tokens(session: Session | GenerateSession, req: Request, model: str,
                       max_new_tokens: int) -> tuple[dict, list[list[int]]]:
    """The record and each turn's token ids (empty on error), for callers that check exactness."""
    if req.error is not None:
        return error_record(req, session.method, model, req.error), []
    turns = _turns(session.adapter, req, session.method, model, req.max_new_tokens or max_new_tokens,
                   getattr(session, "sampling", GREEDY))
    try:
        ask = next(turns)
        while True:
            messages, images, limit, picker = ask
            ask = turns.send(session.answer(messages, images, limit, **({"picker": picker} if picker else {})))
    except StopIteration as done:
        return done.value
    except (ValueError, RuntimeError) as exc:  # bad image, image given to a text model, out of memory, ...
        return error_record(req, session.method, model, failure(exc)), []


def failure(exc: BaseException) -> str:
    """A per-request failure as its record's ``error``: the message of a bad input (ValueError), else the
    exception's type and first line (out of memory on one huge input, ...)."""
    return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {first_line(exc)}"


REFILL_SHARE = 4  # free rows are refilled once a quarter of the batch is free (see InFlight.run)
# One turn to decode: messages, images, max new tokens, and its token-choice rule (None: plain greedy).
Ask = tuple[list[Message], list[Image.Image], int, "Picker | None"]
Answered = tuple[dict, list[list[int]]]  # a request's record and each turn's token ids


def _turns(adapter: Adapter, req: Request, method: str, model: str, max_new_tokens: int,
           sampling: Settings = GREEDY) -> Generator[Ask, Generation, Answered]:
    """A request as a conversation: yields each turn to decode and receives its generation, so one request's
    logic serves a batch-1 loop and a batch of requests in flight alike; returns the record. The request's own
    settings go over the run's (``sampling``); each turn's draws hang on the request's line and id."""
    settings = sampling.override(**req.settings)
    images = [load_image(req.image, root=req.root)] if req.image is not None else []
    conversation = list(req.history)
    # The image belongs to the first user turn: a given one, else the first turn to answer.
    first_user = next((i for i, m in enumerate(conversation) if m["role"] == "user"), None)
    if images and first_user is not None:
        conversation[first_user] = user_message(conversation[first_user]["content"], True)
    image_pending = bool(images) and first_user is None
    answers, gens = [], []
    for i, turn in enumerate(req.turns):
        conversation.append(user_message(turn, image_pending))
        image_pending = False
        messages = [as_parts(m) for m in conversation] if adapter.supports_images else conversation
        picker = None if settings.plain else Picker(settings, request_key(req.line, req.id), i)
        gen = yield messages, images, max_new_tokens, picker
        text = adapter.decode(gen.tokens)
        answers.append(text)
        gens.append(gen)
        conversation.append({"role": "assistant", "content": text})
    record = result_record(req, method, model, answers[-1], gens, settings)
    if len(req.turns) > 1:
        record["answers"] = answers
    return record, [g.tokens for g in gens]


def answer_all(session: Session | GenerateSession, requests: Iterable[Request], model: str,
               max_new_tokens: int) -> Iterator[Answered]:
    """Every request's record (and tokens) in input order. With ``session.batch`` > 1 up to that many turns
    decode together: a finished record waits until those before it are out, and is yielded as soon as they
    are."""
    if getattr(session, "batch", 1) <= 1:
        for req in requests:
            yield answer_with_tokens(session, req, model, max_new_tokens)
        return
    yield from InFlight(session, model, max_new_tokens).run(requests)


class InFlight:
    """Continuous batching over a stream of requests: whenever rows are free the next requests (or the next
    turns of multi-turn ones) are prefilled together and join; records leave in input order."""

    def __init__(self, session: Session, model: str, max_new_tokens: int):
        self.session, self.model, self.max_new_tokens = session, model, max_new_tokens
        self.batch = session.new_batch()
        self.turns: dict[int, tuple[Request, Generator[Ask, Generation, Answered]]] = {}
        self.asking: list[tuple[int, Prompt, int]] = []  # turns waiting to join: (request, prompt, limit)
        self.done: dict[int, Answered] = {}
        self.started = self.next_out = 0
        self.refill = max(1, self.batch.size // REFILL_SHARE)

    def run(self, requests: Iterable[Request]) -> Iterator[Answered]:
        pending = iter(requests)
        exhausted = False
        while True:
            # Rows are refilled once enough are free: prefilling several turns in one forward pass costs far
            # less per turn than one at a time (demo model, 2 cores: 14 ms for one, 7 ms each for four).
            if self.batch.size - len(self.batch) >= self.refill or not self.batch or exhausted:
                while not exhausted and len(self.batch) + len(self.asking) < self.batch.size:
                    req = next(pending, None)
                    if req is None:
                        exhausted = True
                    else:
                        self._begin(req)
                while self.asking:  # joining may end turns at once (and start next turns): until all have joined
                    asking, self.asking = self.asking, []
                    for seq, result in self.batch.add(asking):
                        self._resume(seq, result)
            yield from self._ready()
            if not self.batch:
                if exhausted:
                    break
                continue
            for seq, result in self.batch.step():
                self._resume(seq, result)
            yield from self._ready()

    def _begin(self, req: Request) -> None:
        seq, self.started = self.started, self.started + 1
        if req.error is not None:
            self.done[seq] = error_record(req, self.session.method, self.model, req.error), []
            return
        limit = req.max_new_tokens or self.max_new_tokens
        self.turns[seq] = req, _turns(self.session.adapter, req, self.session.method, self.model, limit,
                                      self.session.sampling)
        self._resume(seq, None)

    def _resume(self, seq: int, result: Generation | Exception | None) -> None:
        """Hand a request its turn's result and prepare its next turn (which waits to join), or finish it."""
        req, turns = self.turns[seq]
        try:
            if isinstance(result, Exception):
                raise result
            messages, images, limit, picker = next(turns) if result is None else turns.send(result)
            self.asking.append((seq, *self.session.prepare(messages, images, limit), picker))
            return
        except StopIteration as stop:
            self.done[seq] = stop.value
        except Exception as exc:  # noqa: BLE001 - a request's failure is its record's, never the batch's
            self.done[seq] = error_record(req, self.session.method, self.model, failure(exc)), []
        del self.turns[seq]

    def _ready(self) -> Iterator[Answered]:
        while self.next_out in self.done:
            yield self.done.pop(self.next_out)
            self.next_out += 1


def result_record(req: Request, method: str, model: str, answer: str, gens: list[Generation],
                  settings: Settings = GREEDY) -> dict:
    tokens = sum(len(g.tokens) for g in gens)
    prefill = sum(g.prefill_s for g in gens)
    decode = sum(g.decode_s for g in gens)
    steps = sum(g.steps for g in gens)
    hist: Counter = sum((g.accepted_hist for g in gens), Counter())
    sources: Counter = sum((g.by_source for g in gens), Counter())
    record = {
        "id": req.id, "line": req.line, "answer": answer, "method": method, "model": model, "new_tokens": tokens,
        "prefill_ms": round(1000 * prefill, 3), "decode_ms": round(1000 * decode, 3),
        "tokens_per_s": round(tokens / (prefill + decode), 3) if prefill + decode else 0.0,
        "steps": steps, "turns": len(gens),
        # Tokens per verification step, the first token of each turn (from prefill) left out.
        "mean_accepted": round((tokens - len(gens)) / steps, 4) if steps else 0.0,
        "mean_nodes": round(sum(g.tree_nodes for g in gens) / steps, 4) if steps else 0.0,  # root included
        "accepted_hist": {int(k): v for k, v in sorted(hist.items())},
        "tokens_by_source": {SOURCE_KEYS[k]: v for k, v in sources.items() if k in SOURCE_KEYS},
        "draft_ms": round(1000 * sum(g.draft_s for g in gens), 3),
        "decoding": settings.describe(),  # how its tokens were chosen (and the seed of sampled ones)
        "error": None,
    }
    if req.dataset is not None:
        record["dataset"] = req.dataset
    return record


def error_record(req: Request, method: str, model: str, error: str) -> dict:
    record = {"id": req.id, "line": req.line, "answer": None, "method": method, "model": model, "error": error}
    if req.dataset is not None:
        record["dataset"] = req.dataset
    return record
