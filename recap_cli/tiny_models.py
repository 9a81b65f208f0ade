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
    return build_tiny_qwen_vl(out, "qwen2_5_vl", seed, attn, dtype, init_std)


def build_tiny_qwen2_vl(out: Path, seed: int = 0, attn: str = "sdpa", dtype=torch.float32,
                        init_std: float = 0.2) -> Path:
    return build_tiny_qwen_vl(out, "qwen2_vl", seed, attn, dtype, init_std)


def build_tiny_qwen3_vl(out: Path, seed: int = 0, attn: str = "sdpa", dtype=torch.float32,
                        init_std: float = 0.2) -> Path:
    """Qwen3-VL: interleaved M-RoPE, 16 px patches, and deepstack features injected after text layer 0."""
    return build_tiny_qwen_vl(out, "qwen3_vl", seed, attn, dtype, init_std)


def build_tiny_qwen_vl(out: Path, family: str, seed: int = 0, attn: str = "sdpa", dtype=torch.float32,
                       init_std: float = 0.2) -> Path:
    """A 2-layer model of one Qwen VL family (qwen2_vl, qwen2_5_vl, qwen3_vl) with a 2-block vision tower."""
    import transformers as tf

    torch.manual_seed(seed)
    tok = build_tokenizer(QWEN_SPECIALS)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=QWEN_CHAT_TEMPLATE,
    )
    ids = {t: tok.token_to_id(t) for t in QWEN_SPECIALS}
    text = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], bos_token_id=None,
                tie_word_embeddings=False)
    patch = 14
    if family == "qwen2_5_vl":
        config_cls, model_cls, proc_cls = (tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration,
                                           tf.Qwen2_5_VLProcessor)
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=patch, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                      fullatt_block_indexes=[1])
        video_proc = tf.Qwen2VLVideoProcessor()
    elif family == "qwen2_vl":
        config_cls, model_cls, proc_cls = tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration, tf.Qwen2VLProcessor
        vision = dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=patch,
                      spatial_merge_size=2, temporal_patch_size=2)
        video_proc = tf.Qwen2VLVideoProcessor()
    elif family == "qwen3_vl":
        config_cls, model_cls, proc_cls = tf.Qwen3VLConfig, tf.Qwen3VLForConditionalGeneration, tf.Qwen3VLProcessor
        patch = 16
        text.update(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "mrope_section": [2, 3, 3], "mrope_interleaved": True})
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=patch, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                      deepstack_visual_indexes=[0])
        video_proc = tf.Qwen3VLVideoProcessor(patch_size=patch)
    else:
        raise ValueError(f"unknown Qwen VL family {family}")
    cfg = config_cls(
        text_config=text, vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False,
    )
    model = model_cls._from_config(cfg, attn_implementation=attn, dtype=dtype)
    _scale_init(model, init_std)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(out)
    side = 4 * patch  # min 4x4 patches (4 image tokens), max 8x8 (16 tokens)
    image_proc = tf.Qwen2VLImageProcessor(min_pixels=side * side, max_pixels=4 * side * side, patch_size=patch)
    proc = proc_cls(image_processor=image_proc, tokenizer=hf_tok, video_processor=video_proc,
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


# llava-hf/llava-onevision-qwen2-7b-ov-hf's template, cut down: ChatML with images before the text.
CHATML_IMAGE_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_llava_onevision(out: Path, seed: int = 0, attn: str = "sdpa", dtype=torch.float32,
                               init_std: float = 0.2) -> Path:
    """A 2-layer Qwen2 LLaVA-OneVision with a 2-layer SigLIP tower over 28 px tiles (anyres grid up to 56 px)."""
    from transformers import (LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration,
                              LlavaOnevisionImageProcessor, LlavaOnevisionProcessor, LlavaOnevisionVideoProcessor)

    torch.manual_seed(seed)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"]
    tok = build_tokenizer(specials)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                     chat_template=CHATML_IMAGE_TEMPLATE)
    ids = {t: tok.token_to_id(t) for t in specials}
    pinpoints = [[28, 28], [28, 56], [56, 28], [56, 56]]
    cfg = LlavaOnevisionConfig(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14),
        text_config=dict(model_type="qwen2", vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"], bos_token_id=None, tie_word_embeddings=False),
        image_token_index=ids["<image>"], video_token_index=ids["<video>"], image_grid_pinpoints=pinpoints,
        vision_feature_layer=-1, vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9",
        tie_word_embeddings=False,
    )
    model = LlavaOnevisionForConditionalGeneration._from_config(cfg, attn_implementation=attn, dtype=dtype)
    _scale_init(model, init_std)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(out)
    image_proc = LlavaOnevisionImageProcessor(size={"height": 28, "width": 28}, image_grid_pinpoints=pinpoints)
    proc = LlavaOnevisionProcessor(image_processor=image_proc, tokenizer=hf_tok,
                                   video_processor=LlavaOnevisionVideoProcessor(size={"height": 28, "width": 28}),
                                   num_image_tokens=4, vision_feature_select_strategy="full",
                                   vision_aspect_ratio="anyres_max_9", chat_template=CHATML_IMAGE_TEMPLATE)
    proc.save_pretrained(out)
    return out


# HuggingFaceTB/SmolVLM-Instruct's template (Idefics3's): "User:<image>question<end_of_utterance>\nAssistant:".
IDEFICS3_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}: {{ message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}:{% else %}: {% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<image>{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
IDEFICS3_SPECIALS = (["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>",
                      "<global-img>"] + [f"<row_{i}_col_{j}>" for i in (1, 2) for j in (1, 2)])


def build_tiny_idefics3(out: Path, seed: int = 0, attn: str = "sdpa", dtype=torch.float32,
                        init_std: float = 0.2, family: str = "idefics3") -> Path:
    """A 2-layer Llama Idefics3 (or SmolVLM, same design) with a 2-layer SigLIP tower over 56 px tiles: up to 2x2
    tiles plus the global image, 4 tokens each after the pixel shuffle."""
    import transformers as tf

    torch.manual_seed(seed)
    tok = build_tokenizer(IDEFICS3_SPECIALS)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<end_of_utterance>",
                                     pad_token="<|endoftext|>", chat_template=IDEFICS3_CHAT_TEMPLATE)
    ids = {t: tok.token_to_id(t) for t in IDEFICS3_SPECIALS}
    eos = ids["<end_of_utterance>"]
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=56, patch_size=14)
    text = dict(model_type="llama", vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                eos_token_id=eos, pad_token_id=ids["<|endoftext|>"], bos_token_id=None, tie_word_embeddings=False)
    if family == "idefics3":
        config_cls, model_cls, proc_cls = tf.Idefics3Config, tf.Idefics3ForConditionalGeneration, tf.Idefics3Processor
        image_cls, extra = tf.Idefics3ImageProcessor, {}
    elif family == "smolvlm":
        config_cls, model_cls, proc_cls = tf.SmolVLMConfig, tf.SmolVLMForConditionalGeneration, tf.SmolVLMProcessor
        image_cls = tf.SmolVLMImageProcessor
        extra = {"video_processor": tf.SmolVLMVideoProcessor(size={"longest_edge": 56},
                                                             max_image_size={"longest_edge": 56})}
    else:
        raise ValueError(f"unknown Idefics3-style family {family}")
    cfg = config_cls(vision_config=vision, text_config=text, image_token_id=ids["<image>"], scale_factor=2,
                     pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False)
    model = model_cls._from_config(cfg, attn_implementation=attn, dtype=dtype)
    _scale_init(model, init_std)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(out)
    image_proc = image_cls(size={"longest_edge": 112}, max_image_size={"longest_edge": 56})
    proc = proc_cls(image_processor=image_proc, tokenizer=hf_tok, image_seq_len=4,
                    chat_template=IDEFICS3_CHAT_TEMPLATE, **extra)
    proc.save_pretrained(out)
    return out


def build_tiny_smolvlm(out: Path, seed: int = 0, attn: str = "sdpa", dtype=torch.float32,
                       init_std: float = 0.2) -> Path:
    return build_tiny_idefics3(out, seed, attn, dtype, init_std, family="smolvlm")


# OpenGVLab/InternVL3-1B-hf's template, cut down: ChatML with <IMG_CONTEXT> where each image goes.
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}<IMG_CONTEXT>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
INTERNVL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"]


def build_tiny_internvl(out: Path, seed: int = 0, attn: str = "sdpa", dtype=torch.float32,
                        init_std: float = 0.2) -> Path:
    """A 2-layer Qwen2 InternVL with a 2-layer InternViT over 56 px tiles (up to 4 tiles and a thumbnail), 4 tokens
    per tile after the pixel shuffle."""
    from transformers import (GotOcr2ImageProcessor, InternVLConfig, InternVLForConditionalGeneration,
                              InternVLProcessor, InternVLVideoProcessor)

    torch.manual_seed(seed)
    tok = build_tokenizer(INTERNVL_SPECIALS)
    named = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
             "video_token": "<video>"}
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                     extra_special_tokens=named, chat_template=INTERNVL_CHAT_TEMPLATE)
    ids = {t: tok.token_to_id(t) for t in INTERNVL_SPECIALS}
    cfg = InternVLConfig(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=[56, 56], patch_size=[14, 14]),
        text_config=dict(model_type="qwen2", vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"], bos_token_id=None, tie_word_embeddings=False),
        image_token_id=ids["<IMG_CONTEXT>"], image_seq_length=4, downsample_ratio=0.5, tie_word_embeddings=False,
    )
    model = InternVLForConditionalGeneration._from_config(cfg, attn_implementation=attn, dtype=dtype)
    _scale_init(model, init_std)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(out)
    image_proc = GotOcr2ImageProcessor(size={"height": 56, "width": 56}, crop_to_patches=True, min_patches=2,
                                       max_patches=4)
    proc = InternVLProcessor(image_processor=image_proc, tokenizer=hf_tok,
                             video_processor=InternVLVideoProcessor(size={"height": 56, "width": 56}),
                             image_seq_length=4, chat_template=INTERNVL_CHAT_TEMPLATE)
    proc.save_pretrained(out)
    return out


# google/gemma-3-4b-it's template, cut down: "<bos><start_of_turn>user\n<start_of_image>...<end_of_turn>\n".
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA3_SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                   "<end_of_image>", "<image_soft_token>"]


def build_tiny_gemma3(out: Path, seed: int = 0, attn: str = "sdpa", dtype=torch.float32, init_std: float = 0.2,
                      window: int = 8) -> Path:
    """A 2-layer Gemma 3 (one sliding layer of ``window`` positions, one global) with a 2-layer SigLIP tower over
    56 px images pooled to 4 tokens. The small window makes most of a 50-token answer fall outside it."""
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor,
                              Gemma3Processor)

    torch.manual_seed(seed)
    tok = build_tokenizer(GEMMA3_SPECIALS)
    named = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                     extra_special_tokens=named, chat_template=GEMMA3_CHAT_TEMPLATE)
    ids = {t: tok.token_to_id(t) for t in GEMMA3_SPECIALS}
    cfg = Gemma3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=56, patch_size=14, vision_use_head=False),
        text_config=dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         query_pre_attn_scalar=16, sliding_window=window,
                         layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096,
                         eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]], bos_token_id=ids["<bos>"],
                         pad_token_id=ids["<pad>"]),
        mm_tokens_per_image=4, boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"], tie_word_embeddings=False,
    )
    model = Gemma3ForConditionalGeneration._from_config(cfg, attn_implementation=attn, dtype=dtype)
    _scale_init(model, init_std)
    model.generation_config.eos_token_id = [ids["<eos>"], ids["<end_of_turn>"]]
    model.generation_config.bos_token_id = ids["<bos>"]
    model.generation_config.pad_token_id = ids["<pad>"]
    model.save_pretrained(out)
    image_proc = Gemma3ImageProcessor(size={"height": 56, "width": 56})
    proc = Gemma3Processor(image_processor=image_proc, tokenizer=hf_tok, image_seq_length=4,
                           chat_template=GEMMA3_CHAT_TEMPLATE)
    proc.save_pretrained(out)
    return out
