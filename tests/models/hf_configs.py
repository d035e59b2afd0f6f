"""Tiny configs of Hugging Face architectures users train, made with transformers'
own config classes (no download): what ``hf:config.json`` is tested on.

``ARCHS[name] = (make_config, expected class)``. Some configs name their class in
``architectures``, as a config from the hub does; the others leave it to the
task's Auto class (See [Note: which Hugging Face class] in wrapopt/models/hf.py).
Every model has 2 layers of width 32 over a 128-token vocabulary.
"""

from __future__ import annotations

import os
from typing import Any, Callable

_H = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=128,
          max_position_embeddings=64)
_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_ENC_DEC = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=128, decoder_start_token_id=1, **_TOKENS)
_MOE = ("mixtral", "qwen2_moe", "deepseek_v3", "qwen3_moe", "olmoe")


def _archs(tf) -> dict[str, tuple[Callable[[], Any], str]]:
    return {
        "llama": (lambda: tf.LlamaConfig(num_key_value_heads=1, **_H, **_TOKENS), "LlamaForCausalLM"),
        "qwen2": (lambda: tf.Qwen2Config(num_key_value_heads=1, **_H, **_TOKENS), "Qwen2ForCausalLM"),
        "qwen3": (lambda: tf.Qwen3Config(num_key_value_heads=1, head_dim=16, **_H, **_TOKENS), "Qwen3ForCausalLM"),
        "mistral": (lambda: tf.MistralConfig(num_key_value_heads=1, **_H, **_TOKENS), "MistralForCausalLM"),
        "gemma2": (lambda: tf.Gemma2Config(num_key_value_heads=1, head_dim=16, **_H, **_TOKENS), "Gemma2ForCausalLM"),
        "phi3": (lambda: tf.Phi3Config(num_key_value_heads=1, **_H, **_TOKENS), "Phi3ForCausalLM"),
        "gpt2": (lambda: tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64, bos_token_id=1,
                                       eos_token_id=2, architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel"),
        "gpt_neox": (lambda: tf.GPTNeoXConfig(**_H, **_TOKENS), "GPTNeoXForCausalLM"),
        "opt": (lambda: tf.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2,
                                     vocab_size=128, max_position_embeddings=64, word_embed_proj_dim=32, **_TOKENS),
                "OPTForCausalLM"),
        "falcon": (lambda: tf.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, vocab_size=128,
                                           **_TOKENS), "FalconForCausalLM"),
        "stablelm": (lambda: tf.StableLmConfig(num_key_value_heads=1, **_H, **_TOKENS), "StableLmForCausalLM"),
        "bert": (lambda: tf.BertConfig(**_H, pad_token_id=0, architectures=["BertForMaskedLM"]), "BertForMaskedLM"),
        "roberta": (lambda: tf.RobertaConfig(**{**_H, "max_position_embeddings": 72}, pad_token_id=1),
                    "RobertaForMaskedLM"),
        "distilbert": (lambda: tf.DistilBertConfig(dim=32, hidden_dim=64, n_layers=2, n_heads=2, vocab_size=128,
                                                   max_position_embeddings=64), "DistilBertForMaskedLM"),
        "t5": (lambda: tf.T5Config(d_model=32, d_ff=64, d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=2,
                                   vocab_size=128, decoder_start_token_id=0), "T5ForConditionalGeneration"),
        "bart": (lambda: tf.BartConfig(**_ENC_DEC, max_position_embeddings=64), "BartForConditionalGeneration"),
        "whisper": (lambda: tf.WhisperConfig(**_ENC_DEC, num_mel_bins=8, max_source_positions=16,
                                             max_target_positions=64, begin_suppress_tokens=None, suppress_tokens=None),
                    "WhisperForConditionalGeneration"),
        "vit": (lambda: tf.ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     image_size=16, patch_size=4, num_labels=3), "ViTForImageClassification"),
        "mixtral": (lambda: tf.MixtralConfig(num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, **_H,
                                             **_TOKENS), "MixtralForCausalLM"),
        "qwen2_moe": (lambda: tf.Qwen2MoeConfig(num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                                                moe_intermediate_size=32, shared_expert_intermediate_size=64, **_H,
                                                **_TOKENS), "Qwen2MoeForCausalLM"),
        "deepseek_v3": (lambda: tf.DeepseekV3Config(num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                                                    moe_intermediate_size=32, n_shared_experts=1,
                                                    first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
                                                    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1,
                                                    topk_group=1, **_H, **_TOKENS), "DeepseekV3ForCausalLM"),
        "qwen3_moe": (lambda: tf.Qwen3MoeConfig(num_key_value_heads=1, head_dim=16, num_experts=4,
                                                num_experts_per_tok=2, moe_intermediate_size=32, **_H, **_TOKENS),
                      "Qwen3MoeForCausalLM"),
        "olmoe": (lambda: tf.OlmoeConfig(num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, **_H,
                                         **_TOKENS), "OlmoeForCausalLM"),
    }


def archs() -> dict[str, tuple[Callable[[], Any], str]]:
    import transformers

    return _archs(transformers)


def write_config(name: str, directory: str) -> str:
    """The tiny config of ``name`` as ``directory/name.json``; its path."""
    path = os.path.join(directory, f"{name}.json")
    if not os.path.exists(path):
        archs()[name][0]().to_json_file(path)
    return path


def num_experts(config: Any) -> int:
    for field in ("num_local_experts", "num_experts", "n_routed_experts"):
        if getattr(config, field, None):
            return int(getattr(config, field))
    raise AssertionError(f"{type(config).__name__} names no expert count")


MOE = _MOE
