"""recap: lossless speculative decoding for batch image captioning and VQA with vision-language models."""

import os

__version__ = "0.1.0"


def on_amd_cpu() -> bool:
    """Whether this is a Linux machine with an AMD CPU (what MKL's default mode was measured slow on)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return "AuthenticAMD" in f.read(4096)
    except OSError:
        return False


# A draft tree's step multiplies a few activation rows by every weight matrix. torch's x86 wheels do that in MKL,
# whose default mode took 1.5-2x a one-token step's time for 2-8 rows on an AMD EPYC (SmolLM2-135M, fp32, 2 cores:
# 78 ms for 1 token, 130 for 2, 153 for 8), which few drafts can win back. In its conditional-reproducibility mode
# (``AUTO``: the best code path the CPU has) those steps took 80-100 ms, and prefills were no slower
# (benchmarks/step_costs.py). MKL reads the variable at its first call, so setting it here, before any model
# runs, is enough; a value the user set wins (an empty one leaves MKL's default). Only AMD CPUs were measured,
# so only they get it; GPU runs do no matrix work in MKL.
if on_amd_cpu():
    os.environ.setdefault("MKL_CBWR", "AUTO")
