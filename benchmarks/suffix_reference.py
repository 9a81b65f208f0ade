"""``--method suffix`` against the reference SuffixDecoding implementation, draft for draft.

    python benchmarks/suffix_reference.py --arctic DIR [--model demo] [--inputs ...] [--json runs/suffix_ref.json]

Runs recap's ``suffix`` drafter over the inputs (one session, as ``recap run`` at batch 1) and records every
step's context and draft; then replays the same token streams through the reference ``SuffixDecodingCache``
(arctic-inference's C++ suffix tree, driven as vLLM's ``suffix`` proposer drives it: start_request with the
prompt, add_active_response with each step's new tokens, speculate on the last 24 tokens) and compares the
drafts token for token. DIR must hold an importable ``arctic_inference.suffix_decoding`` (its ``_C`` extension
built) and numpy; docs/suffix-decoding.md says how to build just that part in two minutes without torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recap_cli.batch import answer_with_tokens  # noqa: E402
from recap_cli.models import load  # noqa: E402
from recap_cli.session import Session  # noqa: E402

from acceptance import read_requests  # noqa: E402


def record(model: str, inputs: list[Path], limit: int, max_new_tokens: int) -> tuple[list[dict], int | None]:
    """Every request turn: its prompt, and per step the context, the room and recap's draft."""
    adapter = load(model, device="cpu", dtype="fp32")
    session = Session(adapter, "suffix")
    drafter, turns = session.drafter, []
    start, propose = drafter.start, drafter.propose

    def logged_start(prompt, rows):
        turns.append({"prompt": list(prompt), "steps": []})
        return start(prompt, rows)

    def logged_propose(context, room):
        tree = propose(context, room)
        turns[-1]["steps"].append({"context": list(context), "room": room, "draft": tree.tokens[1:]})
        return tree

    drafter.start, drafter.propose = logged_start, logged_propose
    for req in read_requests(inputs, limit):
        rec, _ = answer_with_tokens(session, req, model, max_new_tokens)
        if rec["error"]:
            raise SystemExit(f"{req.id}: {rec['error']}")
    return turns, adapter.image_token_id


def replay(turns: list[dict], banned: int | None, depth: int = 24) -> dict:
    """The reference's drafts for the recorded streams, compared with recap's."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=10000)
    steps = same = drafted = 0
    first_diff = None
    for r, turn in enumerate(turns):
        cache.start_request(r, turn["prompt"])
        seen = len(turn["prompt"])
        for step in turn["steps"]:
            ctx = step["context"]
            cache.add_active_response(r, ctx[seen:])
            seen = len(ctx)
            draft = cache.speculate(r, ctx[-depth:], max_spec_tokens=min(depth, step["room"]), max_spec_factor=1.0,
                                    min_token_prob=0.1).token_ids
            draft = draft[: next((i for i, t in enumerate(draft) if t == banned), len(draft))]
            steps += 1
            drafted += len(draft)
            if list(draft) == step["draft"]:
                same += 1
            elif first_diff is None:
                first_diff = {"turn": r, "context_tail": ctx[-depth:], "reference": list(draft), "recap": step["draft"]}
        cache.stop_request(r)
    return {"turns": len(turns), "steps": steps, "same_drafts": same, "reference_tokens_drafted": drafted,
            "first_difference": first_diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--arctic", type=Path, required=True, help="folder with arctic_inference (built) and numpy")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--inputs", type=Path, nargs="+",
                    default=[Path(f"sample_inputs/bench/demo_{s}.jsonl") for s in ("caption", "vqa", "multiturn")])
    ap.add_argument("--limit", type=int, default=1000, help="requests per input file")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(args.arctic))
    if importlib.util.find_spec("arctic_inference") is None:  # before the recording pass, not after it
        raise SystemExit(f"--arctic {args.arctic}: no importable arctic_inference there")
    turns, banned = record(args.model, args.inputs, args.limit, args.max_new_tokens)
    out = replay(turns, banned)
    print(f"{out['steps']} steps over {out['turns']} turns: {out['same_drafts']} drafts identical to the reference "
          f"({out['same_drafts'] / max(out['steps'], 1):.2%}); first difference: {out['first_difference']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(orjson.dumps({"model": args.model, "inputs": [str(p) for p in args.inputs], **out},
                                           option=orjson.OPT_INDENT_2))
    if out["same_drafts"] != out["steps"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
