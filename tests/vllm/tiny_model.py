"""A tiny random-weight OPT model that vLLM can load, generated offline.

No network: the config, the weights (seeded, so byte-for-byte reproducible) and a small
WordLevel tokenizer are written by transformers/tokenizers into a local directory, which
``vllm.config.ModelConfig(model=DIR)`` accepts. Shape: hidden 128, 2 layers, 2 heads
(head_dim 64, which vLLM's CPU attention backend accepts; 16 is refused), vocabulary 256,
positions 256 -- about 1.3 MB of float32 weights, generated in a few seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

#: Shape of the generated model, shared with the fixtures that build KV cache specs.
HIDDEN_SIZE = 128
NUM_LAYERS = 2
NUM_HEADS = 2
HEAD_DIM = HIDDEN_SIZE // NUM_HEADS
VOCAB_SIZE = 256
MAX_POSITIONS = 256
SEED = 1234

# Special tokens first, then plain word tokens "w0", "w1", ...
_SPECIALS = ("<pad>", "</s>", "<unk>")
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2

# Bump when the recipe changes, so a cached directory is regenerated.
_RECIPE = "opt-tiny-v1"
_STAMP = ".kvpush-tiny-model"


def attention_layer_names(num_layers: int = NUM_LAYERS) -> list[str]:
    """The attention layer names vLLM's OPT implementation registers (and so the
    keys of the ``kv_caches`` dict a worker-side connector receives)."""
    return [f"model.decoder.layers.{i}.self_attn.attn" for i in range(num_layers)]


def make_tiny_model(directory: str | os.PathLike[str]) -> Path:
    """Create (or reuse) the tiny model under ``directory``; return the model directory.

    Idempotent: a directory already holding this recipe's stamp is returned as is.
    """
    root = Path(directory)
    model_dir = root / _RECIPE
    stamp = model_dir / _STAMP
    if stamp.exists() and stamp.read_text() == _RECIPE:
        return model_dir

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import OPTConfig, OPTForCausalLM, PreTrainedTokenizerFast

    # Build in a scratch directory and rename it into place, so that an interrupted run
    # never leaves a half-written model behind a valid-looking path.
    root.mkdir(parents=True, exist_ok=True)
    build_dir = Path(tempfile.mkdtemp(prefix=f"{_RECIPE}.", dir=root))

    config = OPTConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        num_hidden_layers=NUM_LAYERS,
        ffn_dim=2 * HIDDEN_SIZE,
        num_attention_heads=NUM_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        word_embed_proj_dim=HIDDEN_SIZE,
        do_layer_norm_before=True,
        pad_token_id=PAD_ID,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        dtype="float32",
    )
    torch.manual_seed(SEED)
    model = OPTForCausalLM(config).eval()
    model.save_pretrained(build_dir, safe_serialization=True)

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
    fast.save_pretrained(build_dir)

    # No generation defaults beyond the token ids: sampling settings stay explicit in tests.
    (build_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": EOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID})
    )
    (build_dir / _STAMP).write_text(_RECIPE)
    if model_dir.exists():
        shutil.rmtree(model_dir)
    build_dir.rename(model_dir)
    return model_dir
