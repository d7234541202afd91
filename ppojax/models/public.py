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

_QWEN3 = dict(model_type="qwen3", hidden_act="silu", bos_token_id=151643, eos_token_id=151645,
              max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
              attention_bias=False, use_sliding_window=False, sliding_window=None,
              head_dim=128, num_key_value_heads=8, vocab_size=151936)
_GEMMA3 = dict(model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh", bos_token_id=2,
               eos_token_id=[1, 106], pad_token_id=0, rms_norm_eps=1e-6, head_dim=256,
               query_pre_attn_scalar=256, rope_theta=1000000.0, rope_local_base_freq=10000.0,
               sliding_window_pattern=6, final_logit_softcapping=None,
               attn_logit_softcapping=None, tie_word_embeddings=True)
_GEMMA3_LONG = dict(_GEMMA3, vocab_size=262208, sliding_window=1024,
                    max_position_embeddings=131072,
                    rope_scaling={"rope_type": "linear", "factor": 8.0})  # 4B and larger

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
    "Qwen/Qwen3-0.6B": dict(
        _QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, tie_word_embeddings=True),
    "Qwen/Qwen3-1.7B": dict(
        _QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, tie_word_embeddings=True),
    "Qwen/Qwen3-4B": dict(
        _QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, tie_word_embeddings=True),
    "Qwen/Qwen3-8B": dict(
        _QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, tie_word_embeddings=False),
    "google/gemma-3-270m-it": dict(
        _GEMMA3, vocab_size=262144, hidden_size=640, intermediate_size=2048,
        num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, sliding_window=512,
        max_position_embeddings=32768),
    "google/gemma-3-1b-it": dict(
        _GEMMA3, vocab_size=262144, hidden_size=1152, intermediate_size=6912,
        num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, sliding_window=512,
        max_position_embeddings=32768),
    # the text model of the multimodal checkpoints (their config.json's text_config)
    "google/gemma-3-4b-it": dict(
        _GEMMA3_LONG, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
        num_attention_heads=8, num_key_value_heads=4),
    "google/gemma-3-12b-it": dict(
        _GEMMA3_LONG, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=8),
}


def lookup(name: str) -> dict[str, Any] | None:
  """The config.json dict of a known hub id (case-insensitive; base and instruct models share
  their shapes), or None."""
  wanted = _base_name(name)
  for hub_id, config in CONFIGS.items():
    if _base_name(hub_id) == wanted:
      return dict(config)
  return None


def _base_name(name: str) -> str:
  """A hub id without its instruct suffix ("-Instruct", Gemma's "-it", Qwen3's "-Base")."""
  name = name.lower()
  for suffix in ("-instruct", "-it", "-pt", "-base"):
    name = name.removesuffix(suffix)
  return name
