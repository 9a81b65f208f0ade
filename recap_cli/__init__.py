"""recap: lossless speculative decoding for batch image captioning and VQA with vision-language models."""

__version__ = "0.1.0"
