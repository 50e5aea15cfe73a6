"""The e2e test's model: tests/vllm/tiny_model.py's random OPT model, with sharper weights.

``make_tiny_model`` initialises weights like OPT (std 0.02), so its logits are nearly
uniform and greedy decoding repeats one token whatever the context: measured here, 6 of
8 prompts of 5..130 tokens gave 16 copies of a single token (top-2 logprob margins down
to 0.002). An end-to-end comparison with that model would pass even if the decode's
KV were garbage. Scaling every weight matrix (embeddings included) by ``SCALE`` = 20
makes attention and logits sharp: the same prompts then give 9..15 distinct tokens
out of 16, and the continuation depends on the whole prompt (the test checks this on
the running baseline too).

Run as a script (so that torch's import stays out of the pytest process):
``python tests/e2e/e2e_model.py DIR`` prints the model directory; idempotent.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

SCALE = 20.0
_NAME = f"opt-tiny-v1-x{int(SCALE)}"
_STAMP = ".kvpush-e2e-model"

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "vllm"))

from tiny_model import make_tiny_model  # noqa: E402


def make_e2e_model(directory: str | os.PathLike[str]) -> Path:
    root = Path(directory)
    out = root / _NAME
    if (out / _STAMP).exists():
        return out
    import torch
    from safetensors.torch import load_file, save_file

    base = make_tiny_model(root)
    build = Path(tempfile.mkdtemp(prefix=f"{_NAME}.", dir=root))
    for f in base.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy2(f, build / f.name)
    weights = load_file(base / "model.safetensors")
    with torch.no_grad():
        sharp = {k: (v * SCALE if v.dim() >= 2 else v).contiguous() for k, v in weights.items()}
    save_file(sharp, build / "model.safetensors", metadata={"format": "pt"})
    (build / _STAMP).write_text(_NAME)
    if out.exists():
        shutil.rmtree(out)
    build.rename(out)
    return out


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(make_e2e_model(sys.argv[1]))
