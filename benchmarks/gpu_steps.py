"""Step costs on a GPU: eager vs static-cache + CUDA graphs, per tree size, at real 7B shapes (random weights).

    python benchmarks/gpu_steps.py --json runs/gpu_steps.json          # on a CUDA machine, a few minutes
    python benchmarks/gpu_steps.py --tiny --no-compile                 # CPU smoke test of the script itself

Measures ms per verification step for T = 1 and each bucket, ar ms/token (eager and compiled), transformers
generate() ms/token, RECAP's drafting overhead per step, and batched eager steps (``--batches``: B rows of T-node
trees, each row with its own prefix, what ``recap run --batch B`` verifies per step). Prints tables, writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import orjson
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recap_cli.adapters import Adapter, Prompt  # noqa: E402
from recap_cli.decoding.batched import BatchEngine  # noqa: E402
from recap_cli.drafters import Drafter, RecapDrafter  # noqa: E402
from recap_cli.decoding.engine import BUCKETS, Engine, generate  # noqa: E402
from recap_cli.decoding.tree import Tree  # noqa: E402

VICUNA_7B = dict(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=8192)
QWEN2_5_7B_TEXT = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                       rope_theta=1000000.0)
TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096)


class _Tokenizer:
    eos_token_id = None


def build(shape: str, tiny: bool, device: torch.device, dtype: torch.dtype) -> Adapter:
    """A random-init causal LM with the language-model shape of the named 7B model (decode steps only)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if shape == "vicuna-7b":
        cfg, cls = LlamaConfig(**(TINY if tiny else VICUNA_7B)), LlamaForCausalLM
    else:
        cfg, cls = Qwen2Config(**(TINY if tiny else QWEN2_5_7B_TEXT)), Qwen2ForCausalLM
    with torch.device(device):
        model = cls._from_config(cfg, attn_implementation="sdpa", dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    adapter = Adapter(model, _Tokenizer())
    adapter.eos_token_ids = set()  # random weights: run every request to its full length
    return adapter


def timed(fn, reps: int, device: torch.device) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs (after one untimed run)."""
    fn()
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append(1000 * (time.perf_counter() - t0))
    return statistics.median(samples)


def warm(engine: Engine, prompt: Prompt, seconds: float) -> None:
    """Run one-node steps for ``seconds`` before anything is timed. On an H200 the first timings of a run came out
    ~1.5x the later ones (a one-node step 31.6 ms first, 18.5-22.7 ms later in the same process): the GPU warming
    up, which is not what a step costs."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        step_costs(engine, prompt, [1], reps=10)


def step_costs(engine: Engine, prompt: Prompt, sizes: list[int], reps: int) -> dict[int, float]:
    """ms per verify step of a T-node tree whose drafts are all rejected (the cache grows one token a step)."""
    out = {}
    for size in sizes:
        engine.prefill(prompt, reserve=reps * 4 + 8)
        tree = Tree(tokens=[1] + [2] * (size - 1), parents=[-1] + list(range(size - 1)))
        out[size] = timed(lambda: engine.verify(tree), reps, engine.device)
    return out


def ar_ms_per_token(engine: Engine, prompt: Prompt, tokens: int) -> float:
    gen = generate(engine, prompt, Drafter(), tokens)
    return 1000 * gen.decode_s / max(1, len(gen.tokens) - 1)


def hf_ms_per_token(adapter: Adapter, prompt: Prompt, tokens: int, static: bool) -> float:
    kw = {"do_sample": False, "cache_implementation": "static"} if static else {"do_sample": False}

    def run(n: int):
        return adapter.model.generate(prompt.input_ids, max_new_tokens=n, min_new_tokens=n, **kw)

    one = timed(lambda: run(1), 2, adapter.device)  # prefill + first token
    full = timed(lambda: run(tokens), 2, adapter.device)
    return (full - one) / (tokens - 1)


def drafting_ms(vocab: int, budget: int, steps: int = 200) -> float:
    """RECAP's host-side work per step (propose + observe) with a warm memory and a 64-node tree."""
    g = torch.Generator().manual_seed(0)
    d = RecapDrafter(vocab, budget=budget)
    d.start(list(range(100)), None)
    context = torch.randint(0, vocab, (400,), generator=g).tolist()
    from recap_cli.decoding.tree import Rows, Verified

    def rows(n: int) -> Rows:
        return Rows(ids=torch.randint(0, 200, (n, 8), generator=g),
                    probs=torch.softmax(torch.randn(n, 8, generator=g), -1))

    for t in range(1000):  # warm the memories with transitions among the first 200 tokens
        d.order1.put(t % 200, (tuple(rows(1).ids[0].tolist()), tuple(rows(1).probs[0].tolist())))
    t0 = time.perf_counter()
    for i in range(steps):
        tree = d.propose(context[: 300 + i % 100], room=100)
        d.observe(tree, Verified(path=[0], bonus=0, argmax=[0] * len(tree), rows=rows(len(tree))))
    return 1000 * (time.perf_counter() - t0) / steps


def batched_costs(adapter: Adapter, prompt: Prompt, max_batch: int) -> dict[str, dict[int, float]]:
    """ms per batched eager step, by rows (the cost grid up to ``max_batch``) and width: the grid recap's
    BatchEngine measures at start-up, here with its timings reported."""
    engine = BatchEngine(adapter, max_batch=max_batch)
    engine.measure_costs(prompt, reps=5)
    return {f"rows={rows}": {w: 1000 * s for w, s in zip(curve.sizes, curve.seconds)}
            for rows, curve in engine.cost.by_rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--shapes", default="vicuna-7b,qwen2.5-vl-7b")
    ap.add_argument("--prefix", type=int, default=0, help="prompt length (default: 2200 vicuna, 477 qwen)")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens for the ms/token measurements")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warm-s", type=float, default=3.0, help="seconds of untimed steps before the first timing")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: checks the script, not speed")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--batches", default="1,4,8,16,32", help="rows of the batched step grid (max = its batch)")
    ap.add_argument("--json", type=Path, default=Path("runs/gpu_steps.json"))
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sizes = list(BUCKETS)
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": str(dtype), "shapes": {}}
    for shape in args.shapes.split(","):
        adapter = build(shape, args.tiny, device, dtype)
        prefix = args.prefix or (2200 if shape == "vicuna-7b" else 477)
        g = torch.Generator().manual_seed(0)
        prompt = Prompt(input_ids=torch.randint(3, 1000, (1, prefix), generator=g).to(device))
        row: dict = {"prefix": prefix}
        eager = Engine(adapter)
        warm(eager, prompt, args.warm_s)
        row["eager_step_ms"] = step_costs(eager, prompt, sizes, args.reps)
        eager.measure_costs(prompt)  # what recap's cost model measures at start-up, for comparison
        row["eager_cost_model_ms"] = dict(zip(eager.cost.sizes, [1000 * s for s in eager.cost.seconds]))
        row["ar_eager_ms_per_token"] = ar_ms_per_token(eager, prompt, args.tokens)
        if args.compile:
            compiled = Engine(adapter, static=True, compile=True, min_capacity=prefix + 512)
            row["compile_warmup_s"] = compiled.warm_up(prompt)
            row["compiled_step_ms"] = step_costs(compiled, prompt, sizes, args.reps)
            compiled.measure_costs(prompt)
            row["compiled_cost_model_ms"] = dict(zip(compiled.cost.sizes, [1000 * s for s in compiled.cost.seconds]))
            row["ar_compiled_ms_per_token"] = ar_ms_per_token(compiled, prompt, args.tokens)
        row["hf_generate_ms_per_token"] = hf_ms_per_token(adapter, prompt, args.tokens, static=False)
        if args.compile and device.type == "cuda":
            row["hf_static_compiled_ms_per_token"] = hf_ms_per_token(adapter, prompt, args.tokens, static=True)
        row["recap_draft_ms_per_step_64"] = drafting_ms(adapter.vocab_size, 64)
        row["batched_step_ms"] = batched_costs(adapter, prompt, max(int(b) for b in args.batches.split(",")))
        report["shapes"][shape] = row
        print_row(shape, row)
        del adapter, eager
        if device.type == "cuda":
            torch.cuda.empty_cache()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    print(f"wrote {args.json}")


def print_row(shape: str, row: dict) -> None:
    print(f"\n{shape} (prefix {row['prefix']})")
    print(f"{'T':>5} {'eager ms':>10} {'compiled ms':>12}")
    for size, ms in row["eager_step_ms"].items():
        compiled = row.get("compiled_step_ms", {}).get(size)
        print(f"{size:>5} {ms:>10.2f} {'-' if compiled is None else f'{compiled:.2f}':>12}")
    for rows, widths in row.get("batched_step_ms", {}).items():
        print(f"batched eager {rows}: " + ", ".join(f"T={w}: {ms:.2f}" for w, ms in widths.items()))
    for key in ("eager_cost_model_ms", "compiled_cost_model_ms"):
        if key in row:
            print(f"{key}: " + ", ".join(f"{n}: {ms:.2f}" for n, ms in row[key].items()))
    for key in ("ar_eager_ms_per_token", "ar_compiled_ms_per_token", "hf_generate_ms_per_token",
                "hf_static_compiled_ms_per_token", "recap_draft_ms_per_step_64", "compile_warmup_s"):
        if key in row:
            print(f"{key:34s} {row[key]:.3f}")


if __name__ == "__main__":
    main()
