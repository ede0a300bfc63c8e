#!/usr/bin/env python3
"""Write a tiny random-weight Llama model that vLLM can serve, with no download.

    python tests/e2e/make_tiny_model.py OUT_DIR
    python tests/e2e/make_tiny_model.py --tokenizer-only OUT_DIR   # tokenizer files only

* Tokenizer: byte-level BPE trained here with `tokenizers` on local text (the
  Python standard library's own sources, read in a fixed order), 8k vocabulary,
  special tokens for a small chat template.
* Model: LlamaForCausalLM with random weights (seeded), ~22M parameters, 4
  layers, hidden 512, max_position_embeddings 4096, float32 safetensors.

Output is gibberish, but everything a gateway can see is real: token counts,
streaming, usage, the engine's /metrics and its prefix cache (a ~2k-token prompt
costs a visible prefill; a cached one does not).

Idempotent: an existing complete OUT_DIR (marker file) is left alone.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from pathlib import Path

VOCAB = 8192
SPECIALS = ["<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MARKER = ".tiny-model-v1"


def corpus() -> list[str]:
    """~8 MB of local text in a fixed order: the stdlib's .py files."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py"))
    out, size = [], 0
    for p in files:
        try:
            t = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        out.append(t)
        size += len(t)
        if size > 8_000_000:
            break
    if size < 1_000_000:
        raise SystemExit(f"not enough local text to train a tokenizer ({size} bytes from {stdlib})")
    return out


def write_tokenizer(out: Path):
    """The tokenizer files alone (tokenizer.json, tokenizer_config.json,
    special_tokens_map.json); returns the trained `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))

    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>",
        "model_max_length": 4096,
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>"}, indent=1))
    return tok


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--tokenizer-only"]
    out = Path(args[0] if args else os.environ.get("TINY_MODEL_DIR", "bench-out/tiny-llama"))
    if "--tokenizer-only" in sys.argv:
        out.mkdir(parents=True, exist_ok=True)
        write_tokenizer(out)
        print(f"tiny tokenizer at {out}")
        return 0
    if (out / MARKER).exists():
        print(f"tiny model already at {out}")
        return 0
    out.mkdir(parents=True, exist_ok=True)

    tok = write_tokenizer(out)
    vocab = tok.get_vocab_size()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        pad_token_id=tok.token_to_id("</s>"),
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg).to(torch.float32)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(out), safe_serialization=True)
    (out / MARKER).write_text(json.dumps({"parameters": params, "vocab": vocab}) + "\n")
    print(f"tiny model at {out}: {params / 1e6:.1f}M parameters, vocab {vocab}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
