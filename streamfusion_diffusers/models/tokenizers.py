"""Offline word-level tokenizers standing in for each pipeline's own (CLIP, T5 / UMT5, Gemma, Qwen2, Qwen3, Mistral /
Pixtral).

No model hub is needed: the vocabulary is WORDS plus each tokenizer's special tokens, lower-cased and split on
whitespace and punctuation. They answer the calls diffusers' pipelines make: padding, truncation, attention
masks, Qwen-Image's chat template whose system prefix the pipeline drops by count, and Flux.2's
`apply_chat_template` over a batch of conversations. Ids outside the vocabulary become <unk>, which the
random-weight encoders accept. Qwen-Image-Edit's Qwen2-VL processor is made here too, from the image processor
and the tokenizer with Qwen2-VL's vision tokens (`qwen_vl_processor`).
"""
from __future__ import annotations

from typing import Any

from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, processors
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast, Qwen2VLProcessor, Qwen3VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

# Enough words for demo prompts; anything else becomes <unk>.
WORDS = ("a an the of in on at with and by under over near photo painting render portrait landscape city "
         "mountain mountains river lake sea ocean forest tree trees flower flowers sky cloud clouds sun moon star "
         "stars night day sunset sunrise snow rain fog cat dog bird horse fish robot car train boat house castle "
         "bridge street road red orange yellow green blue purple black white golden silver bright dark "
         "small large tiny huge old new beautiful detailed cinematic colorful quiet").split()
# Words, punctuation runs, and line breaks as tokens of their own (Qwen's template counts its line breaks).
SPLIT = pre_tokenizers.Split(Regex(r"\w+|[^\w\s]+|\n"), behavior="removed", invert=True)
# Flux.2's conversation as text: every message's text parts, in order (what its Pixtral processor reads).
CHAT_TEMPLATE = ("{% for message in messages %}{% for part in message['content'] %}{{ part['text'] }}\n"
                 "{% endfor %}{% endfor %}")


def word_tokenizer(specials: dict[str, str], template: str, max_length: int, extra: tuple[str, ...] = (),
                   chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """A lower-casing word-level tokenizer over WORDS; `specials` maps role (unk, pad, bos, eos) to token,
    `extra` adds special tokens kept whole (chat markers, the line break)."""
    names = list(dict.fromkeys([*specials.values(), *extra]))
    vocab = {token: i for i, token in enumerate(names + list(WORDS))}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=specials["unk_token"]))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = SPLIT
    tokenizer.add_special_tokens([t for t in extra if t != "\n"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[(t, vocab[t]) for t in names if t in template])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=max_length,
                                   chat_template=chat_template, **specials)


def clip_tokenizer() -> PreTrainedTokenizerFast:
    return word_tokenizer({"unk_token": "<unk>", "pad_token": "<pad>", "bos_token": "<|startoftext|>",
                           "eos_token": "<|endoftext|>"}, "<|startoftext|> $A <|endoftext|>", 77)


def t5_tokenizer(max_length: int) -> PreTrainedTokenizerFast:
    """T5's (Flux.1, CogVideoX) and UMT5's (Wan) layout: the text, then </s>."""
    return word_tokenizer({"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}, "$A </s>", max_length)


def gemma_tokenizer(max_length: int) -> PreTrainedTokenizerFast:
    """Gemma's layout (LTX-2's Gemma 3): <bos>, then the text; padded with <pad>."""
    return word_tokenizer({"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>"},
                          "<bos> $A", max_length)


def qwen_tokenizer() -> PreTrainedTokenizerFast:
    """Qwen2's chat markers and line breaks as single tokens, so that Qwen-Image's system prefix is 34 tokens,
    as the pipeline's `prompt_template_encode_start_idx` drops."""
    return word_tokenizer({"unk_token": "<unk>", "pad_token": "<|endoftext|>", "eos_token": "<|im_end|>"}, "$A",
                          1024 + 34, extra=("<|im_start|>", "\n"))


def qwen_vl_tokenizer() -> PreTrainedTokenizerFast:
    """`qwen_tokenizer` with Qwen2-VL's vision tokens, each one token (the processor repeats <|image_pad|> per
    image patch; <|video_pad|> must be its own token or the processor counts <unk> as video)."""
    return word_tokenizer({"unk_token": "<unk>", "pad_token": "<|endoftext|>", "eos_token": "<|im_end|>"}, "$A",
                          8192, extra=("<|im_start|>", "\n", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>",
                                       "<|video_pad|>"))


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2-VL's processor without a video processor: transformers' own checks its video processor's class,
    which needs torchvision; Qwen-Image-Edit passes images only."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def qwen_vl_processor(tokenizer: PreTrainedTokenizerFast, max_pixels: int | None = None) -> ImageOnlyQwen2VLProcessor:
    """Qwen2-VL's processor over images; `max_pixels`: the most pixels an image is resized to (default Qwen2-VL's)."""
    limits = {} if max_pixels is None else {"max_pixels": max_pixels, "min_pixels": min(max_pixels, 56 * 56)}
    return ImageOnlyQwen2VLProcessor(image_processor=Qwen2VLImageProcessorPil(**limits), tokenizer=tokenizer)


class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
    """Qwen3-VL's processor without a video processor (as ImageOnlyQwen2VLProcessor): MiniMax-H3 reads its token
    types only, which the vision tokens of `qwen_vl_tokenizer` mark."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def qwen3_vl_processor(tokenizer: PreTrainedTokenizerFast) -> ImageOnlyQwen3VLProcessor:
    """Qwen3-VL's processor over images: 16-pixel patches, merged 2 x 2."""
    return ImageOnlyQwen3VLProcessor(image_processor=Qwen2VLImageProcessorPil(patch_size=16, merge_size=2),
                                     tokenizer=tokenizer)


# Qwen's chat turns as text (Z-Image's Qwen3 asks enable_thinking=True: no thinking block added; HunyuanVideo 1.5's
# Qwen2.5-VL a system turn, then the prompt's)
QWEN_CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def qwen_chat_tokenizer(max_length: int) -> PreTrainedTokenizerFast:
    """Qwen's chat markers as single tokens and its chat template (Z-Image, HunyuanVideo 1.5)."""
    return word_tokenizer({"unk_token": "<unk>", "pad_token": "<|endoftext|>", "eos_token": "<|im_end|>"}, "$A",
                          max_length, extra=("<|im_start|>", "\n"), chat_template=QWEN_CHAT_TEMPLATE)


def mistral_tokenizer(max_length: int) -> PreTrainedTokenizerFast:
    """Mistral's <s> first, and a chat template for Flux.2's `apply_chat_template(conversations, ...)`."""
    return word_tokenizer({"unk_token": "<unk>", "pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"},
                          "<s> $A", max_length, chat_template=CHAT_TEMPLATE)


__all__ = ["WORDS", "ImageOnlyQwen2VLProcessor", "ImageOnlyQwen3VLProcessor", "clip_tokenizer", "mistral_tokenizer", "qwen_chat_tokenizer", "qwen_tokenizer", "qwen3_vl_processor", "qwen_vl_processor",
           "qwen_vl_tokenizer", "t5_tokenizer", "word_tokenizer"]
