"""Train the demo VLM: a tiny Qwen2.5-VL, from scratch, on the synthetic world (``python -m recap_cli.demo.train``).

Two stages, because a language model trained from scratch does not learn to read image tokens that carry
nothing yet, and a vision tower gets no signal from a language model that does not read it:
1. ``vision``: the vision tower + merger learn every scene fact through direct heads on the *mean* of the
   merged image tokens, so each image arrives with its facts in a form one attention head can pick up;
2. ``joint``: the language model learns captions and answers over the image tokens; the vision tower goes on at
   a lower rate with the heads kept at a small weight.
Data is drawn fresh for every step from ``Random((seed, step))``, so a resumed run sees exactly the same batches.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .. import tiny_models
from . import world

PATCH, MERGE, TEMPORAL = 14, 2, 2
GRID = world.SIZE // PATCH  # 8 x 8 patches -> 4 x 4 = 16 image tokens
IMAGE_TOKENS = (GRID // MERGE) ** 2
MEAN = (0.48145466, 0.4578275, 0.40821073)  # the CLIP normalisation Qwen2-VL's image processor uses
STD = (0.26862954, 0.26130258, 0.27577711)
SPECIALS = tiny_models.QWEN_SPECIALS
# Qwen2-VL's chat format without the default system prompt (short prompts suit a model this small).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# ---------------------------------------------------------------- model directory


def build_tokenizer(vocab_size: int = 640):
    """Byte-level BPE trained on the world's own text: every word of it is one or two tokens."""
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = []
    for _ in range(3000):
        scene = world.sample_scene(rng)
        corpus += [f"{qa.question} {qa.answer}" for qa in world.questions(scene, rng)]
    tok = tiny_models.build_tokenizer(SPECIALS, vocab_size, corpus)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)


@dataclass
class Size:
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    mlp: int = 640
    vision_hidden: int = 192
    vision_depth: int = 3
    vision_heads: int = 3


def build_model(tok, size: Size, seed: int):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    half = size.hidden // size.heads // 2
    section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]  # temporal, height, width
    cfg = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tok), hidden_size=size.hidden, intermediate_size=size.mlp,
            num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
            max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
            eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], bos_token_id=None,
            tie_word_embeddings=True,
        ),
        vision_config=dict(
            depth=size.vision_depth, hidden_size=size.vision_hidden, intermediate_size=size.vision_hidden * 2,
            num_heads=size.vision_heads, out_hidden_size=size.hidden, patch_size=PATCH, spatial_merge_size=MERGE,
            temporal_patch_size=TEMPORAL, window_size=world.SIZE, fullatt_block_indexes=[size.vision_depth - 1],
        ),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    return model


def save_model_dir(model, tok, out: Path, dtype: torch.dtype = torch.float16) -> None:
    """A normal transformers model directory: what ``recap run --model DIR`` and ``from_pretrained`` load."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    area = world.SIZE * world.SIZE
    image_proc = Qwen2VLImageProcessor(min_pixels=area, max_pixels=area)
    proc = Qwen2_5_VLProcessor(image_processor=image_proc, tokenizer=tok, video_processor=Qwen2VLVideoProcessor(),
                               chat_template=CHAT_TEMPLATE)
    model.to(dtype).save_pretrained(out)
    model.to(torch.float32)
    proc.save_pretrained(out)


# ---------------------------------------------------------------- batches


def patchify(images: list) -> tuple[torch.Tensor, torch.Tensor]:
    """What Qwen2VLImageProcessor does to a 112 px image, vectorised (a test checks they agree)."""
    import numpy as np

    x = torch.from_numpy(np.stack([np.asarray(im, dtype=np.float32) for im in images])) / 255.0  # B H W C
    x = (x - torch.tensor(MEAN)) / torch.tensor(STD)
    b = x.shape[0]
    x = x.permute(0, 3, 1, 2).unsqueeze(1).expand(b, TEMPORAL, 3, world.SIZE, world.SIZE)
    g = GRID // MERGE
    x = x.reshape(b, TEMPORAL, 3, g, MERGE, PATCH, g, MERGE, PATCH)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(b * GRID * GRID, 3 * TEMPORAL * PATCH * PATCH)
    thw = torch.tensor([[1, GRID, GRID]] * b)
    return x.contiguous(), thw


GLYPHS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
# The facts the vision heads predict, one classification per slot (-100 where a slot does not apply).
# Global facts are read from the mean of an image's tokens; local facts from each token: what object has its
# centre inside the token's 28 px square, and in which of the 3 x 3 cells that object lies.
GLOBAL_SLOTS = ([("kind", 3)] + [(f"count_{s}", 5) for s in world.SHAPES] + [("count", 5)]
                + [("sign_text", len(world.WORDS) + len(world.NUMBERS)), ("colour_of_sign", len(world.COLOURS))]
                + [(f"sign_char{i}", 1 + len(GLYPHS)) for i in range(4)]
                + [(f"bar{i}", 10) for i in range(4)] + [("colour_of_bars", len(world.COLOURS)), ("tallest", 4),
                                                         ("shortest", 4)])
LOCAL_SLOTS = [("shape", 1 + len(world.SHAPES)), ("colour", 1 + len(world.COLOURS)), ("cell", 9)]
COLOUR_IDS = {c: i for i, c in enumerate(world.COLOURS)}
TOKEN_PX = PATCH * MERGE


def fact_targets(scene: world.Scene) -> tuple[list[int], list[list[int]]]:
    """(global slot targets, local slot targets for each of the image's tokens in raster order)."""
    t = {name: -100 for name, _ in GLOBAL_SLOTS}
    t["kind"] = world.KINDS.index(scene.kind)
    local = [[-100] * len(LOCAL_SLOTS) for _ in range(IMAGE_TOKENS)]
    if scene.kind == "shapes":
        for shape in world.SHAPES:
            t[f"count_{shape}"] = sum(th.shape == shape for th in scene.things)
        t["count"] = len(scene.things)
        local = [[0, 0, -100] for _ in range(IMAGE_TOKENS)]
        side = GRID // MERGE
        for th in scene.things:
            x, y = th.centre
            k = min(int(y // TOKEN_PX), side - 1) * side + min(int(x // TOKEN_PX), side - 1)
            local[k] = [1 + world.SHAPES.index(th.shape), 1 + COLOUR_IDS[th.colour], th.cell]
    elif scene.kind == "sign":
        texts = world.WORDS + world.NUMBERS
        t["sign_text"], t["colour_of_sign"] = texts.index(scene.sign_text), COLOUR_IDS[scene.sign_colour]
        for i in range(4):  # letter by letter too: glyphs are shared between words, digits between numbers
            t[f"sign_char{i}"] = 1 + GLYPHS.index(scene.sign_text[i]) if i < len(scene.sign_text) else 0
    else:
        for i in range(4):
            t[f"bar{i}"] = scene.bars[i] if i < len(scene.bars) else 0
        t["colour_of_bars"] = COLOUR_IDS[scene.bar_colour]
        t["tallest"], t["shortest"] = scene.bars.index(max(scene.bars)), scene.bars.index(min(scene.bars))
    return [t[name] for name, _ in GLOBAL_SLOTS], local


LOG_GROUPS = {"count": "count", "text": "sign_text", "chars": "sign_char", "bars": "bar", "shape": "shape",
              "colour": "colour", "cell": "cell"}


def _slot_losses(logits: torch.Tensor, targets: torch.Tensor, slots) -> tuple[list, list]:
    losses, hits = [], []
    for i, lg in enumerate(logits.split([n for _, n in slots], dim=-1)):
        y = targets[..., i]
        if (y >= 0).any():
            losses.append(F.cross_entropy(lg.flatten(0, -2), y.flatten(), ignore_index=-100))
        hits.append(torch.where(y >= 0, (lg.argmax(-1) == y).float(), torch.nan).flatten())
    return losses, hits


class FactHeads(nn.Module):
    """Stage 1's teacher for the tower: global facts from the mean of an image's tokens, local ones per token."""

    def __init__(self, hidden: int):
        super().__init__()
        self.pooled = nn.Sequential(nn.Linear(hidden, 512), nn.GELU(),
                                    nn.Linear(512, sum(n for _, n in GLOBAL_SLOTS)))
        self.token = nn.Sequential(nn.Linear(hidden, 256), nn.GELU(), nn.Linear(256, sum(n for _, n in LOCAL_SLOTS)))

    def forward(self, tokens: torch.Tensor, facts: torch.Tensor, local: torch.Tensor):
        """tokens (B, 16, H) -> (mean loss, {slot name: hit rate})."""
        g_loss, g_hits = _slot_losses(self.pooled(tokens.mean(1)), facts, GLOBAL_SLOTS)
        l_loss, l_hits = _slot_losses(self.token(tokens), local, LOCAL_SLOTS)
        names = [n for n, _ in GLOBAL_SLOTS] + [n for n, _ in LOCAL_SLOTS]
        return torch.stack(g_loss + l_loss).mean(), dict(zip(names, g_hits + l_hits))


@dataclass
class Batch:
    ids: torch.Tensor
    mask: torch.Tensor
    labels: torch.Tensor
    pixels: torch.Tensor
    thw: torch.Tensor
    facts: torch.Tensor
    local: torch.Tensor
    spans: list[list[tuple[int, int, str]]]  # per row: answer token spans [start, end) and question kind


def encode(tok, qas: list[world.QA]) -> tuple[list[int], list[tuple[int, int, str]]]:
    """Token ids of a conversation about one image (image in the first turn) and its answer spans."""
    messages = []
    for i, qa in enumerate(qas):
        content = [{"type": "image"}, {"type": "text", "text": qa.question}] if i == 0 else qa.question
        messages += [{"role": "user", "content": content}, {"role": "assistant", "content": qa.answer}]
    text = tok.apply_chat_template(messages, tokenize=False)
    text = text.replace("<|image_pad|>", "<|image_pad|>" * IMAGE_TOKENS)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    spans, k, turn = [], 0, 0
    while k < len(ids):
        if ids[k:k + len(header)] == header:
            start = k + len(header)
            stop = ids.index(end, start) + 1  # the answer and its <|im_end|>
            spans.append((start, stop, qas[turn].kind))
            turn, k = turn + 1, stop
        else:
            k += 1
    return ids, spans


def make_batch(tok, rng: random.Random, size: int, turns: int, scene_mix: dict[str, float] | None = None,
               question_mix: dict[str, float] | None = None) -> Batch:
    """The mixes weight scene kinds and question kinds (1 where not named); None draws uniformly."""
    kinds = [scene_mix.get(k, 1.0) for k in world.KINDS] if scene_mix else None
    scenes = [world.sample_scene(rng, rng.choices(world.KINDS, kinds)[0] if kinds else None) for _ in range(size)]
    images = [world.render(s, rng) for s in scenes]
    rows = [encode(tok, world.conversation(s, rng, rng.randint(1, turns), question_mix)) for s in scenes]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((size, width), tok.pad_token_id)
    labels = torch.full((size, width), -100)
    mask = torch.zeros((size, width), dtype=torch.long)
    for r, (row, spans) in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row)
        mask[r, :len(row)] = 1
        for a, b, _ in spans:
            labels[r, a:b] = ids[r, a:b]
    pixels, thw = patchify(images)
    targets = [fact_targets(s) for s in scenes]
    facts, local = torch.tensor([g for g, _ in targets]), torch.tensor([lo for _, lo in targets])
    return Batch(ids, mask, labels, pixels, thw, facts, local, [s for _, s in rows])


# ---------------------------------------------------------------- steps


def image_features(model, batch: Batch) -> torch.Tensor:
    return model.model.visual(batch.pixels, grid_thw=batch.thw).pooler_output


def lm_logits(model, batch: Batch, feats: torch.Tensor) -> torch.Tensor:
    """The language model over the conversation, image features scattered into the image-pad slots."""
    image_id = model.config.image_token_id
    is_image = batch.ids == image_id
    embeds = model.get_input_embeddings()(batch.ids)
    embeds = embeds.masked_scatter(is_image[..., None], feats.to(embeds.dtype))
    positions, _ = model.model.get_rope_index(batch.ids, mm_token_type_ids=is_image.int(),
                                              image_grid_thw=batch.thw, attention_mask=batch.mask)
    return model(inputs_embeds=embeds, attention_mask=batch.mask, position_ids=positions).logits


def losses(model, heads: FactHeads, batch: Batch, stage: str) -> dict[str, torch.Tensor]:
    feats = image_features(model, batch)
    fact_loss, hits = heads(feats.view(batch.ids.shape[0], IMAGE_TOKENS, -1), batch.facts, batch.local)
    out = {"facts": fact_loss}
    for label, prefix in LOG_GROUPS.items():  # fact accuracy per group, for the log
        out[label] = torch.nanmean(torch.cat([h for name, h in hits.items() if name.startswith(prefix)]))
    if stage == "joint":
        logits = lm_logits(model, batch, feats)
        out["lm"] = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch.labels[:, 1:].flatten(), ignore_index=-100)
    return out


@torch.no_grad()
def answer_accuracy(model, batch: Batch) -> dict[str, tuple[int, int]]:
    """Per question kind: answers whose every token is the argmax under teacher forcing, which is exactly
    when greedy decoding would reproduce the answer."""
    logits = lm_logits(model, batch, image_features(model, batch))
    pred = logits.argmax(-1)
    out: dict[str, list[int]] = {}
    for r, spans in enumerate(batch.spans):
        for a, b, kind in spans:
            ok = bool((pred[r, a - 1:b - 1] == batch.ids[r, a:b]).all())
            hit = out.setdefault(kind, [0, 0])
            hit[0] += ok
            hit[1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


# ---------------------------------------------------------------- loop


def lr_at(step: int, total: int, peak: float, warmup: int = 50, decay_from: float = 0.75) -> float:
    """Warm up, hold the peak (decaying early stalls the plateau), then cosine down to 10% over the last quarter."""
    if step < warmup:
        return peak * (step + 1) / warmup
    start = int(total * decay_from)
    if step < start:
        return peak
    frac = (step - start) / max(1, total - start)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def make_optimizer(model, heads, stage: str, args) -> torch.optim.Optimizer:
    vision = [p for n, p in model.named_parameters() if n.startswith("model.visual")]
    text = [p for n, p in model.named_parameters() if not n.startswith("model.visual")]
    if stage == "vision":
        groups = [{"params": vision + list(heads.parameters()), "lr": args.vision_lr, "peak": args.vision_lr}]
    else:
        groups = [{"params": text, "lr": args.lr, "peak": args.lr},
                  {"params": vision, "lr": args.joint_vision_lr, "peak": args.joint_vision_lr},
                  {"params": list(heads.parameters()), "lr": args.lr, "peak": args.lr}]
    return torch.optim.AdamW(groups, betas=(0.9, 0.95), weight_decay=0.01)


def stage_of(step: int, args) -> tuple[str, int, int]:
    """(stage, step within it, stage length)."""
    if step < args.vision_steps:
        return "vision", step, args.vision_steps
    return "joint", step - args.vision_steps, args.steps


def save_checkpoint(path: Path, model, heads, opt, step: int, stage: str) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "heads": heads.state_dict(), "opt": opt.state_dict(),
                "step": step, "stage": stage}, tmp)
    tmp.replace(path)


def evaluate(model, tok, args, n: int = 96) -> dict[str, float]:
    model.eval()
    rng = random.Random(f"eval-{args.seed}")  # a stream training never draws from
    totals: dict[str, list[int]] = {}
    for _ in range(n // 32):
        for kind, (hit, count) in answer_accuracy(model, make_batch(tok, rng, 32, args.turns)).items():
            t = totals.setdefault(kind, [0, 0])
            t[0] += hit
            t[1] += count
    model.train()
    return {k: round(h / c, 3) for k, (h, c) in sorted(totals.items())}


def restore(args):
    """Tokenizer, model, heads and the checkpoint's state (None for a fresh run) of the run in ``args.out``."""
    tok = build_tokenizer()
    model = build_model(tok, Size(), args.seed)
    heads = FactHeads(model.config.text_config.hidden_size)
    ckpt = Path(args.out) / "checkpoint.pt"
    state = torch.load(ckpt, weights_only=False) if ckpt.exists() else None
    start = state or (torch.load(args.init, weights_only=False) if args.init else None)
    if start:  # a run resumes from its own checkpoint; a new run may start from another run's weights
        model.load_state_dict(start["model"])
        heads.load_state_dict(start["heads"])
    return tok, model, heads, state


def train(args) -> Path:
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok, model, heads, state = restore(args)
    ckpt = out / "checkpoint.pt"
    step, stage = (state["step"], state["stage"]) if state else (0, "vision")
    opt = make_optimizer(model, heads, stage, args)
    if state and stage_of(step, args)[0] == state["stage"]:
        opt.load_state_dict(state["opt"])
    log = (out / "train.log").open("a")
    total = args.vision_steps + args.steps
    t0 = time.time()
    while step < total:
        name, local, length = stage_of(step, args)
        if name != stage:
            stage, opt = name, make_optimizer(model, heads, name, args)
        for g in opt.param_groups:
            g["lr"] = lr_at(local, length, g["peak"], decay_from=args.decay_from)
        rng = random.Random(f"{args.seed}-{step}")
        batch = make_batch(tok, rng, args.batch if stage == "joint" else args.vision_batch, args.turns,
                           args.scene_mix, args.question_mix)
        parts = losses(model, heads, batch, stage)
        loss = parts["facts"] if stage == "vision" else parts["lm"] + args.fact_weight * parts["facts"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
        opt.step()
        step += 1
        if step % 10 == 0:
            msg = (f"step {step} {stage} " + " ".join(f"{k} {v.item():.3f}" for k, v in parts.items())
                   + f" {time.time() - t0:.0f}s")
            print(msg, file=sys.stderr, flush=True)
            print(msg, file=log, flush=True)
        if step % args.save_every == 0 or step == total:
            save_checkpoint(ckpt, model, heads, opt, step, stage)
        if stage == "joint" and (step % args.eval_every == 0 or step == total):
            msg = f"eval step {step}: {evaluate(model, tok, args)}"
            print(msg, file=sys.stderr, flush=True)
            print(msg, file=log, flush=True)
    save_model_dir(model, tok, out / "model")
    return out / "model"


def mix_parser(known: list[str]):
    """``name=weight,...`` over the known kinds (argparse reports the ArgumentTypeError as a usage error)."""
    def parse(text: str) -> dict[str, float]:
        mix = {}
        for part in text.split(","):
            name, _, weight = part.partition("=")
            if name not in known:
                raise argparse.ArgumentTypeError(f"unknown kind {name!r}; known: {', '.join(known)}")
            mix[name] = float(weight)
            if not mix[name] > 0:
                raise argparse.ArgumentTypeError(f"the weight of {name} must be positive")
        return mix
    return parse


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/demo-train")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vision-steps", type=int, default=400)
    p.add_argument("--steps", type=int, default=2000, help="joint steps after the vision stage")
    p.add_argument("--vision-batch", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--vision-lr", type=float, default=2e-3)
    p.add_argument("--joint-vision-lr", type=float, default=3e-4)
    p.add_argument("--fact-weight", type=float, default=0.1)
    p.add_argument("--decay-from", type=float, default=0.75, help="fraction of a stage before the lr decays")
    p.add_argument("--scene-mix", type=mix_parser(world.KINDS), help="weights of scene kinds, e.g. shapes=2")
    p.add_argument("--question-mix", type=mix_parser(world.QUESTION_KINDS), help="weights, e.g. position=4,place=2")
    p.add_argument("--init", type=Path, help="start a new run from the weights in this checkpoint.pt")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--export", type=Path, help="only write the run's latest checkpoint as a model directory here")
    args = p.parse_args(argv)
    if args.export:
        tok, model, _, state = restore(args)
        if state is None:
            raise SystemExit(f"no checkpoint in {args.out}")
        save_model_dir(model, tok, args.export)
        print(f"step {state['step']} written to {args.export}", file=sys.stderr)
        return
    print(f"model directory: {train(args)}", file=sys.stderr)


if __name__ == "__main__":
    main()
