"""Tiny random-init models of the real architectures, built from configs.

Tests and CPU benchmarks need the real loading path (``from_pretrained`` on a directory with a tokenizer,
processor and chat template) without the hub, so these builders write complete model directories.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

QWEN_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>",
]
LLAVA_SPECIALS = ["<unk>", "<s>", "</s>", "<image>"]

# Qwen2-VL's template, cut down to what recap sends: text and image parts, system prompt by default.
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# llava-hf/llava-v1.6-vicuna-7b-hf's template (Vicuna v1): "USER: <image>\n... ASSISTANT:".
VICUNA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'][0]['text'] if message['content'] is not string "
    "else message['content'] }}{{ ' ' }}"
    "{% elif message['role'] == 'user' %}USER: "
    "{% else %}ASSISTANT: {% endif %}"
    "{% if message['role'] != 'system' %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'user' %} {% else %}</s>{% endif %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

CORPUS = [
    "The image shows a red circle above a blue square on a white background.",
    "What colour is the triangle? The triangle is green. How many stars are there? There are three stars.",
    "A bar chart with four labelled bars; the tallest bar is labelled B and reaches 42.",
    "The sign reads STOP in white letters. Describe the picture in one sentence, please.",
    "Summarise the passage: the quick brown fox jumps over the lazy dog, then runs into the forest.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 left right top bottom middle small large yellow purple orange",
]


def build_tokenizer(specials: list[str], vocab_size: int = 400, corpus: list[str] | None = None) -> Tokenizer:
    """A byte-level BPE over a small corpus: encodes any text, with the model's special tokens kept whole."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4 if corpus is None else corpus, trainer)
    return tok


def _scale_init(model: torch.nn.Module, std: float) -> None:
    """Wider random weights than the default 0.02 so tiny models have clear top-2 logit gaps (no near-ties)."""
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * std)


def build_tiny_qwen2_5_vl(out: Path, seed: int = 0, attn: str = "sdpa", dtype=torch.float32,
                          init_std: float = 0.2) -> Path:
    """A 2-layer Qwen2.5-VL with a 2-block vision tower; images of 56-112 px give 4-16 image tokens."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                              Qwen2VLImageProcessor, Qwen2VLVideoProcessor)

    torch.manual_seed(seed)
    tok = build_tokenizer(QWEN_SPECIALS)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=QWEN_CHAT_TEMPLATE,
    )
    ids = {t: tok.token_to_id(t) for t in QWEN_SPECIALS}
    cfg = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], bos_token_id=None,
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
            spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
        ),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False,
    )
    model = Qwen2_5_VLForConditionalGeneration._from_config(cfg, attn_implementation=attn, dtype=dtype)
    _scale_init(model, init_std)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(out)
    image_proc = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112)
    proc = Qwen2_5_VLProcessor(image_processor=image_proc, tokenizer=hf_tok, video_processor=Qwen2VLVideoProcessor(),
                               chat_template=QWEN_CHAT_TEMPLATE)
    proc.save_pretrained(out)
    return out


def build_tiny_llava_next(out: Path, seed: int = 0, attn: str = "sdpa", dtype=torch.float32,
                          init_std: float = 0.2) -> Path:
    """A 2-layer Vicuna-style LLaVA-NeXT with a 2-layer CLIP tower over 28 px tiles (anyres grid up to 56 px)."""
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration,
                              LlavaNextImageProcessor, LlavaNextProcessor)

    torch.manual_seed(seed)
    tok = build_tokenizer(LLAVA_SPECIALS)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<unk>",
        chat_template=VICUNA_CHAT_TEMPLATE,
    )
    ids = {t: tok.token_to_id(t) for t in LLAVA_SPECIALS}
    pinpoints = [[28, 28], [28, 56], [56, 28], [56, 56]]
    cfg = LlavaNextConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32),
        text_config=LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=4096, bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
                                pad_token_id=ids["<unk>"]),
        image_token_index=ids["<image>"], image_grid_pinpoints=pinpoints, vision_feature_layer=-1,
        vision_feature_select_strategy="default", tie_word_embeddings=False,
    )
    model = LlavaNextForConditionalGeneration._from_config(cfg, attn_implementation=attn, dtype=dtype)
    _scale_init(model, init_std)
    model.generation_config.eos_token_id = ids["</s>"]
    model.generation_config.bos_token_id = ids["<s>"]
    model.generation_config.pad_token_id = ids["<unk>"]
    model.save_pretrained(out)
    image_proc = LlavaNextImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                         image_grid_pinpoints=pinpoints)
    proc = LlavaNextProcessor(image_processor=image_proc, tokenizer=hf_tok, patch_size=14,
                              vision_feature_select_strategy="default", num_additional_image_tokens=1,
                              chat_template=VICUNA_CHAT_TEMPLATE)
    proc.save_pretrained(out)
    return out


def build_tiny_llama(out: Path, seed: int = 0, attn: str = "sdpa", dtype=torch.float32,
                     init_std: float = 0.2) -> Path:
    """A 2-layer text-only Llama with a ChatML template, standing in for SmolLM2-style causal LMs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = build_tokenizer(specials)
    template = (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                     chat_template=template)
    eos = tok.token_to_id("<|im_end|>")
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      eos_token_id=eos, pad_token_id=tok.token_to_id("<|endoftext|>"), bos_token_id=None)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation=attn, dtype=dtype)
    _scale_init(model, init_std)
    model.generation_config.eos_token_id = eos
    model.save_pretrained(out)
    hf_tok.save_pretrained(out)
    return out
