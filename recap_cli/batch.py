"""Answer a stream of requests with one session and turn each into one output record."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .engine import Generation
from .records import Request, as_parts, first_line, load_image, user_message
from .session import GenerateSession, Session
from .tree import Source

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

    def summary(self) -> dict:
        return {
            "items": self.items, "errors": self.errors, "new_tokens": self.new_tokens,
            "tokens_per_s": self.new_tokens / self.seconds if self.seconds else 0.0,
            "mean_accepted": self.emitted_in_steps / self.steps if self.steps else 0.0,
            "tokens_by_source": dict(self.by_source),
        }


def answer(session: Session | GenerateSession, req: Request, model: str, max_new_tokens: int) -> dict:
    """The output record for one request; any per-request failure becomes its ``error``."""
    return answer_with_tokens(session, req, model, max_new_tokens)[0]


def answer_with_tokens(session: Session | GenerateSession, req: Request, model: str,
                       max_new_tokens: int) -> tuple[dict, list[list[int]]]:
    """The record and each turn's token ids (empty on error), for callers that check exactness."""
    if req.error is not None:
        return error_record(req, session.method, model, req.error), []
    try:
        return _answer(session, req, model, req.max_new_tokens or max_new_tokens)
    except ValueError as exc:  # bad image, image given to a text model, ...
        return error_record(req, session.method, model, str(exc)), []
    except RuntimeError as exc:  # e.g. out of memory on one huge input: that record fails, the run goes on
        return error_record(req, session.method, model, f"{type(exc).__name__}: {first_line(exc)}"), []


def _answer(session: Session | GenerateSession, req: Request, model: str,
            max_new_tokens: int) -> tuple[dict, list[list[int]]]:
    adapter = session.adapter
    images = [load_image(req.image, root=req.root)] if req.image is not None else []
    conversation = list(req.history)
    # The image belongs to the first user turn: a given one, else the first turn to answer.
    first_user = next((i for i, m in enumerate(conversation) if m["role"] == "user"), None)
    if images and first_user is not None:
        conversation[first_user] = user_message(conversation[first_user]["content"], True)
    image_pending = bool(images) and first_user is None
    answers, gens = [], []
    for turn in req.turns:
        conversation.append(user_message(turn, image_pending))
        image_pending = False
        messages = [as_parts(m) for m in conversation] if adapter.supports_images else conversation
        gen = session.answer(messages, images, max_new_tokens)
        text = adapter.decode(gen.tokens)
        answers.append(text)
        gens.append(gen)
        conversation.append({"role": "assistant", "content": text})
    record = result_record(req, session.method, model, answers[-1], gens)
    if len(req.turns) > 1:
        record["answers"] = answers
    return record, [g.tokens for g in gens]


def result_record(req: Request, method: str, model: str, answer: str, gens: list[Generation]) -> dict:
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
