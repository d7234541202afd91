"""The public ``config.json`` values of the models users train most, keyed by hub id.

They let a deviceless compile (``python -m ppojax.aot``) know a model's shapes without a
download or any weights: only the fields ``ModelConfig.from_hf`` reads are kept, copied from each
repository's config.json on the Hugging Face Hub. A local directory given instead of the hub id
(``--config.model.policy=/path/to/dir``) is read from its own config.json, and weights come from
there when a run loads them.
"""

from __future__ import annotations

from typing import Any

_QWEN2 = dict(model_type="qwen2", hidden_act="silu", bos_token_id=151643, eos_token_id=151645,
              max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
              use_sliding_window=False)
_LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
_LLAMA3 = dict(model_type="llama", hidden_act="silu", bos_token_id=128000,
               eos_token_id=[128001, 128008, 128009], max_position_embeddings=131072,
               rms_norm_eps=1e-5, rope_theta=500000.0, attention_bias=False, mlp_bias=False,
               vocab_size=128256)

CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-0.5B-Instruct": dict(
        _QWEN2, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
        tie_word_embeddings=True),
    "Qwen/Qwen2.5-1.5B-Instruct": dict(
        _QWEN2, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
        tie_word_embeddings=True),
    "Qwen/Qwen2.5-7B-Instruct": dict(
        _QWEN2, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
        tie_word_embeddings=False),
    "meta-llama/Llama-3.2-1B-Instruct": dict(
        _LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
        rope_scaling=dict(_LLAMA3_ROPE, factor=32.0)),
    "meta-llama/Llama-3.2-3B-Instruct": dict(
        _LLAMA3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
        num_attention_heads=24, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
        rope_scaling=dict(_LLAMA3_ROPE, factor=32.0)),
    "meta-llama/Llama-3.1-8B-Instruct": dict(
        _LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
        rope_scaling=dict(_LLAMA3_ROPE, factor=8.0)),
}


def lookup(name: str) -> dict[str, Any] | None:
  """The config.json dict of a known hub id (case-insensitive; base and instruct models share
  their shapes), or None."""
  wanted = name.lower().removesuffix("-instruct")
  for hub_id, config in CONFIGS.items():
    if hub_id.lower().removesuffix("-instruct") == wanted:
      return dict(config)
  return None
