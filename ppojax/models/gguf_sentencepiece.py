"""A GGUF file's SentencePiece vocabulary (``tokenizer.ggml.model == "llama"``) as a fast tokenizer.

Gemma's files (llama.cpp ``convert_hf_to_gguf.py``, ``_set_vocab_sentencepiece`` with
``add_space_prefix`` False) store the SentencePiece model as three arrays: ``tokens``,
``scores`` and ``token_type`` (llama.cpp's types: 1 normal, 2 unknown, 3 control, 4 user-defined,
5 unused, 6 byte), and no merges. The tokenizer built here is the one Hugging Face's Gemma
tokenizers are (``tokenizer.json`` of google/gemma-3-*, transformers' ``GemmaTokenizer``):

  normalizer   " " -> "▁", nothing else (no prefix space, no Unicode normalization)
  model        BPE over the vocabulary, merges recovered from it, ``byte_fallback``: a character
               missing from the vocabulary becomes its UTF-8 bytes ``<0x..>``
  decoder      "▁" -> " ", the byte tokens back to characters, fused
  added        control tokens as special tokens, user-defined ones (``"\\n\\n"``, ``"<h1>"``) as
               tokens matched whole, as SentencePiece and llama.cpp match them

Two facts of Gemma files, as transformers 5's GGUF reader also handles them
(``integrations/gguf/gguf_tokenizer_mapping.py``, ``gemma_tokenizer``):

  * the user-defined tokens for runs of 2..31 spaces are stored with real spaces, where the
    vocabulary (after the normalizer) needs "▁▁": they are respelled.
  * merges rank by the merged token's place in the file (lower id first), not by score: the
    normal tokens' scores fall with the id (0, -1, -2, ...), but the user-defined space runs near
    the top carry -1000, and they merge first.

Pure ``tokenizers``: no torch, no sentencepiece.
"""

from __future__ import annotations

import pathlib
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
from transformers import PreTrainedTokenizerFast

from ppojax.models.gguf_file import GGUFError, required_key

SPACE = "\u2581"  # "▁", SentencePiece's visible space
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def respell_spaces(token: str) -> str:
  """A token made only of spaces, as the normalized text spells it ("  " -> "▁▁")."""
  return SPACE * len(token) if token and not token.strip(" ") else token


def merges_from_vocab(tokens: list[str]) -> list[tuple[str, str]]:
  """BPE merges that rebuild every token of ``tokens`` from two others, best first.

  A token of id i merges before one of id j > i; the splits of one token, longer left part
  first (the order transformers' ``generate_merges`` gives Gemma's vocabulary).
  """
  known, merges = set(tokens), []
  for token in tokens:
    merges.extend((token[:k], token[k:]) for k in range(len(token) - 1, 0, -1)
                  if token[:k] in known and token[k:] in known)
  return merges


def sentencepiece_tokenizer(meta: dict[str, Any], path: pathlib.Path) -> PreTrainedTokenizerFast:
  """The fast tokenizer of the SentencePiece vocabulary in ``meta`` (Gemma's kind: no prefix
  space). Raises GGUFError, naming the file, for what it does not describe faithfully."""
  if meta.get("tokenizer.ggml.add_space_prefix", True):
    raise GGUFError(f"{path}: SentencePiece vocabularies with add_space_prefix (Llama 2, "
                    "Mistral) are not supported; only Gemma's (tokenizer.ggml.add_space_prefix "
                    "= False)")
  tokens, types = (required_key(meta, f"tokenizer.ggml.{k}", path) for k in ("tokens", "token_type"))
  if len(types) != len(tokens):
    raise GGUFError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for "
                    f"{len(tokens)} tokens")
  vocab_tokens = [respell_spaces(t) for t in tokens]
  vocab = {t: i for i, t in enumerate(vocab_tokens)}
  if len(vocab) != len(tokens):
    raise GGUFError(f"{path}: the vocabulary holds {len(tokens) - len(vocab)} duplicate tokens")
  special = _special_tokens(meta, tokens, path)
  if special["unk_token"] is None:
    raise GGUFError(f"{path}: tokenizer.ggml.unknown_token_id is missing (byte fallback and "
                    "BPE need an unknown token)")
  tok = Tokenizer(models.BPE(vocab, merges_from_vocab(vocab_tokens), unk_token=special["unk_token"],
                             fuse_unk=True, byte_fallback=True))
  tok.normalizer = normalizers.Replace(" ", SPACE)
  tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                   decoders.Fuse()])
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t, k in zip(tokens, types) if k == _CONTROL])
  tok.add_tokens([AddedToken(t, special=False, normalized=False)
                  for t, v, k in zip(tokens, vocab_tokens, types) if k == _USER_DEFINED and t == v])
  bos = special["bos_token"]
  if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
    bos_id = vocab[bos]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
  return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=meta.get(
      "tokenizer.chat_template"), clean_up_tokenization_spaces=False, **special)


def _special_tokens(meta: dict[str, Any], tokens: list[str], path: pathlib.Path) -> dict:
  """bos_token, eos_token, unk_token and pad_token: the tokens the file's ids name, or None."""
  named = {}
  for name, key in [("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                    ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")]:
    index = meta.get(f"tokenizer.ggml.{key}")
    if index is not None and not 0 <= int(index) < len(tokens):
      raise GGUFError(f"{path}: tokenizer.ggml.{key}={index} is outside the vocabulary of "
                      f"{len(tokens)}")
    named[name] = tokens[index] if index is not None else None
  return named
