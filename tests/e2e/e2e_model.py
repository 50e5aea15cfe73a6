"""The e2e test's models: tiny random-weight Llama-style models, with sharp weights.

Generated offline (no hub access) by transformers, seeded, with the small WordLevel
tokenizer of tests/vllm/tiny_model.py. :data:`SHAPES` names the shapes the e2e matrix
runs: GQA with head_dim 64 (4 query heads, 2 KV heads) and MHA with head_dim 128
(2 query heads, 2 KV heads), 3 layers each, 1024 positions.

Random weights initialised like the originals (std 0.02) give nearly uniform logits:
greedy decoding then repeats one token whatever the context, and an end-to-end
comparison would pass even if the decode's KV were garbage. Scaling every weight
matrix (embeddings included) by ``SCALE`` makes attention and logits sharp: the
continuation depends on the whole prompt (the test checks this on the baseline).

Run as a script (so that torch's import stays out of the pytest process):
``python tests/e2e/e2e_model.py DIR SHAPE`` prints the model directory; idempotent.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SCALE = 20.0
VOCAB_SIZE = 256
MAX_POSITIONS = 1024
SEED = 1234
_SPECIALS = ("<pad>", "</s>", "<unk>")
_STAMP = ".kvpush-e2e-model"


@dataclass(frozen=True)
class Shape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    layers: int = 3

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim


SHAPES = {
    s.name: s
    for s in (
        Shape("gqa-d64", heads=4, kv_heads=2, head_dim=64),
        Shape("mha-d128", heads=2, kv_heads=2, head_dim=128),
    )
}


def make_e2e_model(directory: str | os.PathLike[str], shape: str = "gqa-d64") -> Path:
    s = SHAPES[shape]
    recipe = f"llama-{s.name}-l{s.layers}-x{int(SCALE)}-v1"
    root = Path(directory)
    out = root / recipe
    if (out / _STAMP).exists():
        return out
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=f"{recipe}.", dir=root))
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=s.hidden,
        intermediate_size=2 * s.hidden,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        max_position_embeddings=MAX_POSITIONS,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(SCALE)
    model.save_pretrained(build, safe_serialization=True)

    vocab = {tok: i for i, tok in enumerate(_SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(_SPECIALS), VOCAB_SIZE)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        bos_token="</s>",
        unk_token="<unk>",
        model_max_length=MAX_POSITIONS,
    )
    fast.save_pretrained(build)
    (build / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 1, "pad_token_id": 0})
    )
    (build / _STAMP).write_text(recipe)
    if out.exists():
        shutil.rmtree(out)
    build.rename(out)
    return out


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for name in sys.argv[2:] or ["gqa-d64"]:
        print(make_e2e_model(sys.argv[1], name))
