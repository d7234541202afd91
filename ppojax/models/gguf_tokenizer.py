"""A GGUF file's tokenizer as a transformers fast tokenizer, from its ``tokenizer.*`` metadata
alone (no torch): byte-level BPE (``tokenizer.ggml.model == "gpt2"``: SmolLM2) or Gemma's
SentencePiece vocabulary (``"llama"`` in a gemma3 file: ``gguf_sentencepiece``).
"""

from __future__ import annotations

import pathlib
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from ppojax.models import gguf_sentencepiece
from ppojax.models.gguf_file import GGUFError, required_key

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def gguf_tokenizer(meta: dict[str, Any], path: pathlib.Path) -> PreTrainedTokenizerFast:
  """Byte-level BPE tokenizer (``tokenizer.ggml.model == "gpt2"``) with the file's chat template,
  or Gemma's SentencePiece one (``"llama"`` in a gemma3 file: ppojax.models.gguf_sentencepiece).

  Splitting follows llama.cpp's pre-tokenizer type: "smollm" (and StarCoder-family vocabularies)
  put every digit in its own piece before the GPT-2 regex, as their tokenizer.json files do.
  """
  kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
  if kind == "llama" and meta.get("general.architecture") == "gemma3":
    return gguf_sentencepiece.sentencepiece_tokenizer(meta, path)
  digit_split = {"smollm", "starcoder", "refact", "codeshell"}
  if kind != "gpt2" or pre not in digit_split | {"default", "gpt-2"}:
    raise GGUFError(f"{path}: tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported")
  tokens, types, merges = (required_key(meta, f"tokenizer.ggml.{k}", path)
                           for k in ("tokens", "token_type", "merges"))
  merges = [tuple(m.split(" ", 1)) for m in merges]
  tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                byte_level]) if pre in digit_split else byte_level)
  tok.decoder = decoders.ByteLevel()
  tok.add_tokens([AddedToken(t, special=False, normalized=False)
                  for t, k in zip(tokens, types) if k == _USER_DEFINED])
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t, k in zip(tokens, types) if k == _CONTROL])

  def special(key):
    if key not in meta:
      return None
    if not 0 <= int(meta[key]) < len(tokens):
      raise GGUFError(f"{path}: {key}={meta[key]} is outside the vocabulary of {len(tokens)}")
    return tokens[meta[key]]

  bos = special("tokenizer.ggml.bos_token_id")
  if meta.get("tokenizer.ggml.add_bos_token", False):
    bos_id = meta["tokenizer.ggml.bos_token_id"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
  else:
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
  return PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token=bos, eos_token=special("tokenizer.ggml.eos_token_id"),
      unk_token=special("tokenizer.ggml.unknown_token_id"),
      pad_token=special("tokenizer.ggml.padding_token_id"),
      chat_template=meta.get("tokenizer.chat_template"))
