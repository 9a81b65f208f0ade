"""Answer a stream of requests with one session and turn each into one output record."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Generator, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

from PIL import Image

from .adapters import Adapter, Message, Prompt
from .decoding.engine import Generation
from .decoding.sampling import GREEDY, Picker, Settings, request_key
from .prepare import Preparer
from .records import Request, TransientError, as_parts, first_line, load_image, user_message
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
    prompt_tokens: int = 0
    prefix_hit: int = 0

    def add(self, record: dict) -> None:
        """A failed conversation's record is an error, yet the turns it answered before failing were decoded: their
        tokens, time and steps count (a rate over the work done), though not as an answered request."""
        self.items += 1
        if record["error"] is not None:
            self.errors += 1
        if "new_tokens" not in record:  # failed before any turn was answered: no work to count
            return
        self.new_tokens += record["new_tokens"]
        self.seconds += (record["prefill_ms"] + record["decode_ms"]) / 1000
        self.steps += record["steps"]
        # The prefills' tokens (each turn's first, and drafts a prefill verified) came from no step.
        self.emitted_in_steps += record["new_tokens"] - record.get("prefill_tokens", record["turns"])
        self.by_source.update(record["tokens_by_source"])
        self.prompt_tokens += record.get("prompt_tokens", 0)
        self.prefix_hit += record.get("prefix_hit", 0)

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
            # Prompt tokens taken from the prefix cache instead of prefilled, over all prompt tokens.
            "prefix_reuse": self.prefix_hit / self.prompt_tokens if self.prompt_tokens else 0.0,
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
        return error_record(req, session.method, model, req.error, req.retry), []
    turns = _turns(session.adapter, req, session.method, model, req.max_new_tokens or max_new_tokens,
                   getattr(session, "sampling", GREEDY))
    try:
        ask = next(turns)
        while True:
            messages, images, limit, picker = ask
            ask = turns.send(session.answer(messages, images, limit, **({"picker": picker} if picker else {})))
    except StopIteration as done:
        return done.value
    except Exception as exc:  # noqa: BLE001 - bad image, out of memory, a bug: its record's, as in a batch
        return _failed(turns, req, session.method, model, exc)


def _failed(turns: Generator[Ask, Generation, Answered], req: Request, method: str, model: str,
            exc: Exception) -> Answered:
    """A request's record after ``exc``. It is thrown into the conversation where it waits for a turn (being
    prepared or decoded), so that the record keeps the turns answered before it (``_turns``); a failure before any
    turn was asked (its image) was raised by the conversation itself and gives the plain error record."""
    try:
        turns.throw(exc)
    except StopIteration as done:
        return done.value
    except Exception:  # noqa: BLE001 - not waiting for a turn (never started, or ended): exc came straight back
        pass
    return error_record(req, method, model, failure(exc), retryable(exc)), []


def failure(exc: BaseException) -> str:
    """A per-request failure as its record's ``error``: the message of a bad input (ValueError), else the
    exception's type and first line (out of memory on one huge input, ...)."""
    return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {first_line(exc)}"


def retryable(exc: BaseException) -> bool:
    """Whether a rerun may answer what ``exc`` failed (its record's ``retry``, what ``--resume`` goes by). A
    ValueError is the request's own fault (a bad record, an unreadable image, a prompt longer than the model
    reads): the same line fails the same way again. Anything else lies outside it: out of memory (the CUDA
    allocator's, or a batch's shared step that one large row overran, failing every row in it), a file system that
    timed out (``TransientError``), a bug in recap; a rerun, alone or in another batch, may succeed."""
    return isinstance(exc, TransientError) or not isinstance(exc, ValueError)


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
        try:
            gen = yield messages, images, max_new_tokens, picker
        except Exception as exc:  # noqa: BLE001 - this turn's failure, thrown in by ``_failed``
            record = turn_error_record(req, method, model, failure(exc), answers, gens, settings,
                                       retry=retryable(exc))
            return record, []
        text = adapter.decode(gen.tokens)
        answers.append(text)
        gens.append(gen)
        conversation.append({"role": "assistant", "content": text})
    record = result_record(req, method, model, answers[-1], gens, settings)
    if len(req.turns) > 1:
        record["answers"] = answers
    return record, [g.tokens for g in gens]


@dataclass
class Turn:
    """One turn prepared to decode, and whether its conversation goes on after it (its cache is then kept)."""

    prompt: Prompt
    limit: int
    more: bool
    picker: Picker | None = None  # its token-choice rule (None: plain greedy)


class Conversation:
    """One request's turns, advanced one at a time, on the decoding thread or a preparation thread (never two at
    once: the next turn is asked for only when the last one's answer is in)."""

    def __init__(self, session: Session | GenerateSession, req: Request, model: str, max_new_tokens: int):
        self.session, self.req, self.model = session, req, model
        self.turns = _turns(session.adapter, req, session.method, model, req.max_new_tokens or max_new_tokens,
                            getattr(session, "sampling", GREEDY))
        self.asked = 0

    def advance(self, result: Generation | None) -> Turn | Answered:
        """The next turn, prepared (image loaded, processor run, tokens counted), or the request's record once it
        has no more; a failure (a bad image, a prompt too long, ...) is its record's error."""
        try:
            messages, images, limit, picker = next(self.turns) if result is None else self.turns.send(result)
            prompt, limit = self.session.prepare(messages, images, limit)
        except StopIteration as done:
            return done.value
        except Exception as exc:  # noqa: BLE001 - a request's failure is its record's, never the run's
            return self.failed(exc)
        self.asked += 1
        return Turn(prompt, limit, self.asked < len(self.req.turns), picker)

    def failed(self, exc: Exception) -> Answered:
        """The record of a turn that failed, keeping the turns answered before it (see ``_failed``)."""
        return _failed(self.turns, self.req, self.session.method, self.model, exc)


def answer_all(session: Session | GenerateSession, requests: Iterable[Request], model: str,
               max_new_tokens: int, workers: int | None = None,
               preparer: Preparer | None = None) -> Iterator[Answered]:
    """Every request's record (and tokens) in input order. The next requests' first turns are prepared on
    ``workers`` threads (default ``PREPARE_WORKERS``; 0: inline), or by ``preparer``, while earlier ones decode.
    With ``session.batch`` > 1 up to that many turns decode together: a finished record waits until those
    before it are out, and is yielded as soon as they are."""
    own = preparer is None
    preparer = Preparer(PREPARE_WORKERS if workers is None else workers) if own else preparer
    try:
        if getattr(session, "batch", 1) <= 1:
            yield from _one_at_a_time(session, requests, model, max_new_tokens, preparer)
        else:
            yield from InFlight(session, model, max_new_tokens, preparer).run(requests)
    finally:
        if own:
            preparer.close()


PREPARE_WORKERS = 2  # preparation threads: one can decode a slow image while the other runs the processor
LOOK_AHEAD = 2  # requests prepared ahead, per row of the batch


def _one_at_a_time(session: Session | GenerateSession, requests: Iterable[Request], model: str,
                   max_new_tokens: int, preparer: Preparer) -> Iterator[Answered]:
    """Batch 1: the next requests' first turns are prepared while one decodes; a later turn depends on the
    answer before it, so it is prepared when that answer is in."""
    ahead: deque[tuple[Conversation | None, Future]] = deque()
    pending = iter(requests)
    while True:
        while len(ahead) < LOOK_AHEAD and (req := next(pending, None)) is not None:
            if req.error is not None:
                record = error_record(req, session.method, model, req.error, req.retry)
                ahead.append((None, preparer.done((record, []))))
            else:
                chat = Conversation(session, req, model, max_new_tokens)
                ahead.append((chat, preparer.submit(chat.advance, None)))
        if not ahead:
            return
        chat, step = ahead.popleft()
        step = preparer.result(step)
        while isinstance(step, Turn):
            try:
                gen = session.decode(step.prompt, step.limit, step.picker)
            except Exception as exc:  # noqa: BLE001 - out of memory on one huge input, a bug: as in a batch,
                step = chat.failed(exc)  # the record's failure, never the run's
                break
            step = preparer.call(chat.advance, gen)
        yield step


class InFlight:
    """Continuous batching over a stream of requests: whenever rows are free the turns prepared by then (the
    next requests' first turns, the next turns of multi-turn ones) are prefilled together and join; records
    leave in input order. Preparation runs on ``preparer``'s threads, at most ``LOOK_AHEAD`` x batch requests
    ahead, and the decoding loop never waits for it while rows are decoding: a slow image holds up no one."""

    def __init__(self, session: Session, model: str, max_new_tokens: int, preparer: Preparer | None = None):
        self.session, self.model, self.max_new_tokens = session, model, max_new_tokens
        self.preparer = preparer or Preparer(0)
        self.more: set[int] = set()  # requests whose turn in the batch is followed by another
        self.batch = session.new_batch(keeps=self.more.__contains__)
        self.chats: dict[int, Conversation] = {}
        self.preparing: dict[int, Future] = {}  # request -> its next turn (or record), being prepared
        self.asking: dict[int, Turn] = {}  # turns prepared, waiting to join
        self.done: dict[int, Answered] = {}
        self.started = self.next_out = 0
        self.refill = max(1, self.batch.size // REFILL_SHARE)
        self.ahead = LOOK_AHEAD * self.batch.size

    def run(self, requests: Iterable[Request]) -> Iterator[Answered]:
        pending = iter(requests)
        exhausted = False
        while True:
            while not exhausted and len(self.preparing) + len(self.asking) < self.ahead:
                req = next(pending, None)
                if req is None:
                    exhausted = True
                else:
                    self._begin(req)
            # Preparation is waited for only when nothing decodes: then for a full batch (one joint prefill).
            self._collect(until=0 if self.batch else self.batch.size)
            # Rows are refilled once enough are free: prefilling several turns in one forward pass costs far
            # less per turn than one at a time (demo model, 2 cores: 14 ms for one, 7 ms each for four).
            free = self.batch.size - len(self.batch)
            if self.asking and (free >= self.refill or not self.batch or exhausted):
                joining = sorted(self.asking)[:free]
                turns = [self.asking.pop(seq) for seq in joining]
                outcomes = self.batch.add([(seq, t.prompt, t.limit, t.picker) for seq, t in zip(joining, turns)])
                for seq, result in outcomes:
                    self._resume(seq, result)
            yield from self._ready()
            if not self.batch:
                if exhausted and not self.preparing and not self.asking:
                    break
                continue
            # Nothing left to join (no request, no turn prepared or to come): the run waits for its slowest row.
            self.batch.draining = exhausted and not self.preparing and not self.asking and not self.more
            self.batch.busy = not all(job.done() for job in self.preparing.values())
            for seq, result in self.batch.step():
                self._resume(seq, result)
            yield from self._ready()

    def _begin(self, req: Request) -> None:
        seq, self.started = self.started, self.started + 1
        if req.error is not None:
            self.done[seq] = error_record(req, self.session.method, self.model, req.error, req.retry), []
            return
        self.chats[seq] = Conversation(self.session, req, self.model, self.max_new_tokens)
        self._resume(seq, None)

    def _resume(self, seq: int, result: Generation | Exception | None) -> None:
        """Hand a request its turn's result: its next turn is prepared off this thread; after its last turn its
        record is made here, so that nothing finished can be lost to an interrupt before the loop collects it."""
        last = result is not None and seq not in self.more
        self.more.discard(seq)
        if isinstance(result, Exception):  # a request's failure is its record's, never the batch's
            self.done[seq] = self.chats.pop(seq).failed(result)
            return
        if last:  # the record (text and counts, cheap) is made here: it is out before the next step can fail
            self.done[seq] = self.chats.pop(seq).advance(result)
            return
        self.preparing[seq] = self.preparer.submit(self.chats[seq].advance, result)

    def _collect(self, until: int) -> None:
        """Take the preparations that are done (turns to join, or records), waiting while fewer than ``until``
        turns are ready and more are on their way, but not for a slow one: once some turn is ready, a wait of a
        few jobs' usual time without any finishing ends it."""
        self._take()
        while len(self.asking) < until and self.preparing:
            patience = self.preparer.patience() if self.asking else None
            if not self.preparer.wait_any(self.preparing.values(), patience):
                return
            self._take()

    def _take(self) -> None:
        for seq in [s for s, f in self.preparing.items() if f.done()]:
            step = self.preparer.result(self.preparing.pop(seq))
            if isinstance(step, Turn):
                self.asking[seq] = step
                if step.more:
                    self.more.add(seq)
            else:
                self.done[seq] = step
                del self.chats[seq]

    def _ready(self) -> Iterator[Answered]:
        while self.next_out in self.done:
            yield self.done.pop(self.next_out)
            self.next_out += 1


def result_record(req: Request, method: str, model: str, answer: str, gens: list[Generation],
                  settings: Settings = GREEDY) -> dict:
    record = {"id": req.id, "line": req.line, "answer": answer, "method": method, "model": model,
              **turn_figures(gens, settings), "error": None}
    if req.dataset is not None:
        record["dataset"] = req.dataset
    return record


def turn_figures(gens: list[Generation], settings: Settings = GREEDY) -> dict:
    """What a request's answered turns cost and how they were drafted: a result record's, and a failed
    conversation's for the turns before its failure (the summary counts them both)."""
    tokens = sum(len(g.tokens) for g in gens)
    prefill = sum(g.prefill_s for g in gens)
    decode = sum(g.decode_s for g in gens)
    steps = sum(g.steps for g in gens)
    early = sum(g.prefill_tokens for g in gens)
    hist: Counter = sum((g.accepted_hist for g in gens), Counter())
    sources: Counter = sum((g.by_source for g in gens), Counter())
    return {
        "new_tokens": tokens, "prefill_ms": round(1000 * prefill, 3), "decode_ms": round(1000 * decode, 3),
        "tokens_per_s": round(tokens / (prefill + decode), 3) if prefill + decode else 0.0,
        "steps": steps, "turns": len(gens),
        "prefill_tokens": early,  # the prefills' tokens: each turn's first, and drafts its prefill verified
        # Tokens per verification step, the prefills' tokens left out.
        "mean_accepted": round((tokens - early) / steps, 4) if steps else 0.0,
        "mean_nodes": round(sum(g.tree_nodes for g in gens) / steps, 4) if steps else 0.0,  # root included
        "accepted_hist": {int(k): v for k, v in sorted(hist.items())},
        "tokens_by_source": {SOURCE_KEYS[k]: v for k, v in sources.items() if k in SOURCE_KEYS},
        "draft_ms": round(1000 * sum(g.draft_s for g in gens), 3),
        "decoding": settings.describe(),  # how its tokens were chosen (and the seed of sampled ones)
        "prompt_tokens": sum(g.prompt_tokens for g in gens),
        "prefix_hit": sum(g.prefix_hit for g in gens),  # of those, taken from the prefix cache
    }


def error_record(req: Request, method: str, model: str, error: str, retry: bool) -> dict:
    """The record of a request that failed. ``retry``: a rerun may succeed (``retryable``), so ``--resume``
    answers the line again; every error record says so either way, for a reader to tell the two apart."""
    record = {"id": req.id, "line": req.line, "answer": None, "method": method, "model": model, "error": error,
              "retry": retry}
    if req.dataset is not None:
        record["dataset"] = req.dataset
    return record


def turn_error_record(req: Request, method: str, model: str, error: str, answers: list[str],
                      gens: list[Generation], settings: Settings = GREEDY, *, retry: bool) -> dict:
    """The error record of a turn that failed. In a conversation the error names the turn, and the turns answered
    before it stay (their ``answers`` and ``turn_figures``: how many, their tokens, time and steps, how they were
    chosen): a later turn that outgrows the context must not cost the answers already decoded, nor the summary
    their work. ``answer`` stays None: the last turn has none."""
    if len(req.turns) == 1:
        return error_record(req, method, model, error, retry)
    record = error_record(req, method, model, f"turn {len(answers) + 1} of {len(req.turns)}: {error}", retry)
    if answers:
        record.update(answers=answers, **turn_figures(gens, settings))
    return record
