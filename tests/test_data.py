"""Tests of ppojax.data.encoding: reading records, chat templates, padding/truncation, batching.

A tiny word-level tokenizer built here (with a Jinja chat template, BOS post-processor, eos and pad
tokens, and variants without pad token or template) covers the logic offline; one test checks the
real SmolLM2 tokenizer (read from the cached GGUF's metadata, weights never dequantized).
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from ppojax.data import encoding
from ppojax.data import records as records_lib
from ppojax.data.records import DataError

WORDS = "a b c d e f g h hello world what is two plus".split()
SPECIAL = ["<pad>", "<unk>", "<bos>", "<eos>", "<system>", "<user>", "<assistant>", "<end>"]
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <end> {% endfor %}"
            "{% if add_generation_prompt %}<assistant> {% endif %}")


def make_tokenizer(pad: bool = True, template: bool = True, eos: bool = True, bos: bool = True):
  """A whitespace word-level tokenizer; raw text gets a <bos> prefix (when ``bos``)."""
  vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  if bos:
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
  return PreTrainedTokenizerFast(
      tokenizer_object=tok, unk_token="<unk>", bos_token="<bos>",
      eos_token="<eos>" if eos else None, pad_token="<pad>" if pad else None,
      chat_template=TEMPLATE if template else None)


@pytest.fixture(scope="module")
def tok():
  return make_tokenizer()


def ids(tok, text):
  """Ids of whitespace-separated tokens (special or not), for writing expectations."""
  return tok.convert_tokens_to_ids(text.split())


# ----------------------------------------------------------------------------- read_records


def test_jsonl_round_trip_skips_blank_lines(tmp_path):
  records = [{"prompt": "a b", "n": 1}, {"prompt": [{"role": "user", "content": "é"}]}]
  path = tmp_path / "sub" / "dir" / "d.jsonl"
  records_lib.write_jsonl(iter(records), path)
  assert records_lib.read_records(path, required=["prompt"]) == records
  assert [p.name for p in path.parent.iterdir()] == ["d.jsonl"]  # no temp file left behind
  path.write_text("\n" + path.read_text() + "\n  \n")
  assert records_lib.read_records(str(path)) == records


def test_jsonl_with_utf8_bom(tmp_path):
  path = tmp_path / "bom.jsonl"
  path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "a"}\n')
  assert records_lib.read_records(path) == [{"prompt": "a"}]


def test_write_jsonl_failure_keeps_old_file(tmp_path):
  path = tmp_path / "d.jsonl"
  records_lib.write_jsonl([{"a": 1}], path)
  with pytest.raises(DataError, match=r"record 1 is not JSON-serialisable"):
    records_lib.write_jsonl([{"a": 2}, {"b": object()}], path)
  with pytest.raises(DataError, match=r"record 0 is a list, not a dict"):
    records_lib.write_jsonl([[1]], path)
  assert records_lib.read_records(path) == [{"a": 1}]
  assert [p.name for p in tmp_path.iterdir()] == ["d.jsonl"]


@pytest.mark.parametrize("line, detail", [
    ('{"prompt": "a"', "Expecting"),
    ("not json", "Expecting value"),
    ('["a list"]', "got a JSON array"),
    ('"a string"', "got a JSON string"),
])
def test_jsonl_bad_line_names_file_and_line(tmp_path, line, detail):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"prompt": "a"}\n\n' + line + "\n")
  with pytest.raises(DataError, match="not a JSON object") as e:
    records_lib.read_records(path)
  assert f"{path}:3:" in str(e.value) and detail in str(e.value)


def test_jsonl_invalid_utf8(tmp_path):
  path = tmp_path / "bin.jsonl"
  path.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff"}\n')
  with pytest.raises(DataError, match=rf"{path}:2: not valid UTF-8"):
    records_lib.read_records(path)


def test_missing_required_field_names_file_line_and_fields(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_text('{"prompt": "a"}\n{"question": "b", "answer": "c"}\n')
  with pytest.raises(DataError) as e:
    records_lib.read_records(path, required=("prompt",))
  assert str(e.value) == (f"{path}:2: record has no field 'prompt' "
                          "(fields: 'question', 'answer')")


@pytest.mark.parametrize("value, detail", [
    (3, "got type int"),
    (None, "got type NoneType"),
    ({"role": "user"}, "got type dict"),
    ([], "got an empty list"),
    ([{"role": "user"}], "message 0 is not"),
    ([{"role": "user", "content": "a"}, "b"], "message 1 is not"),
])
def test_required_field_of_wrong_type(tmp_path, value, detail):
  path = tmp_path / "d.jsonl"
  records_lib.write_jsonl([{"prompt": "a", "chosen": "x"}, {"prompt": value, "chosen": "y"}], path)
  with pytest.raises(DataError) as e:
    records_lib.read_records(path, required=("chosen", "prompt"))
  assert f"{path}:2: field 'prompt'" in str(e.value) and detail in str(e.value)


def test_missing_and_empty_and_unsupported_sources(tmp_path):
  with pytest.raises(DataError, match=r"data file not found: .*nowhere\.jsonl"):
    records_lib.read_records(tmp_path / "nowhere.jsonl")
  (tmp_path / "empty.jsonl").write_text("\n\n")
  with pytest.raises(DataError, match=r"empty\.jsonl contains no records"):
    records_lib.read_records(tmp_path / "empty.jsonl")
  (tmp_path / "empty.json").write_text("[]")
  with pytest.raises(DataError, match=r"empty\.json contains no records"):
    records_lib.read_records(tmp_path / "empty.json")
  (tmp_path / "d.txt").write_text("a")
  with pytest.raises(DataError, match=r"d\.txt: unsupported data file type '\.txt'"):
    records_lib.read_records(tmp_path / "d.txt")
  (tmp_path / "plain").mkdir()
  with pytest.raises(DataError, match=r"plain is a directory but not one written by datasets"):
    records_lib.read_records(tmp_path / "plain")


def test_json_list(tmp_path):
  records = [{"prompt": "a", "response": "b"}, {"prompt": "c", "response": "d"}]
  path = tmp_path / "d.json"
  path.write_text(json.dumps(records, indent=1))
  assert records_lib.read_records(path, required=("prompt", "response")) == records
  path.write_text(json.dumps([records[0], {"prompt": "c"}]))
  with pytest.raises(DataError, match=r"d\.json: record 1: record has no field 'response'"):
    records_lib.read_records(path, required=("prompt", "response"))
  path.write_text(json.dumps([records[0], 7]))
  with pytest.raises(DataError, match=r"d\.json: record 1: not a JSON object"):
    records_lib.read_records(path)
  path.write_text(json.dumps({"prompt": "a"}))
  with pytest.raises(DataError, match=r"d\.json: a \.json data file must hold a list"):
    records_lib.read_records(path)
  path.write_text('[\n{"prompt": "a"},\n{"prompt": }\n]')
  with pytest.raises(DataError, match=r"d\.json:3: not valid JSON"):
    records_lib.read_records(path)


def test_datasets_save_to_disk_dataset_and_splits(tmp_path):
  datasets = pytest.importorskip("datasets")
  train = [{"prompt": "a b", "chosen": "c", "rejected": "d"},
           {"prompt": "e", "chosen": "f", "rejected": "g"}]
  test = [{"prompt": "h", "chosen": "a", "rejected": "b"}]
  datasets.Dataset.from_list(train).save_to_disk(tmp_path / "ds")
  assert records_lib.read_records(tmp_path / "ds", required=("prompt", "chosen")) == train
  dd = datasets.DatasetDict(train=datasets.Dataset.from_list(train),
                            test=datasets.Dataset.from_list(test))
  dd.save_to_disk(tmp_path / "dd")
  assert records_lib.read_records(tmp_path / "dd") == train
  assert records_lib.read_records(tmp_path / "dd", split="test") == test
  with pytest.raises(DataError, match=r"dd: no split 'validation'; the splits are \['test', "
                     r"'train'\]"):
    records_lib.read_records(tmp_path / "dd", split="validation")
  with pytest.raises(DataError, match=r"dd \(split 'test'\): record 0: record has no field "
                     r"'response' \(fields: 'prompt', 'chosen', 'rejected'\)"):
    records_lib.read_records(tmp_path / "dd", required=("response",), split="test")
  datasets.DatasetDict(train=datasets.Dataset.from_list(train),
                       test=datasets.Dataset.from_list(test).select([])).save_to_disk(
                           tmp_path / "dd0")
  with pytest.raises(DataError, match=r"dd0 \(split 'test'\) contains no records"):
    records_lib.read_records(tmp_path / "dd0", split="test")
  assert records_lib.read_records(tmp_path / "dd0") == train
  next((tmp_path / "ds").glob("*.arrow")).write_bytes(b"corrupt")
  with pytest.raises(DataError, match=r"ds: could not load the saved dataset"):
    records_lib.read_records(tmp_path / "ds")


def test_datasets_chat_messages_and_files(tmp_path):
  datasets = pytest.importorskip("datasets")
  records = [{"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}],
              "response": "b"},
             {"prompt": [{"role": "user", "content": "c"}], "response": "d"}]
  ds = datasets.Dataset.from_list(records)
  ds.to_parquet(str(tmp_path / "d.parquet"))
  assert records_lib.read_records(tmp_path / "d.parquet", required=("prompt", "response")) == records
  flat = [{"prompt": "a b", "response": "c"}, {"prompt": "d", "response": "e"}]
  datasets.Dataset.from_list(flat).to_csv(str(tmp_path / "d.csv"), index=False)
  assert records_lib.read_records(tmp_path / "d.csv", required=("prompt",)) == flat
  ds.save_to_disk(tmp_path / "ds")
  arrow = next((tmp_path / "ds").glob("*.arrow"))
  assert records_lib.read_records(arrow, required=("prompt",)) == records
  datasets.Dataset.from_list([{"prompt": 1}]).to_parquet(str(tmp_path / "n.parquet"))
  with pytest.raises(DataError, match=r"n\.parquet: record 0: field 'prompt' must be a string "
                     r"or a list of chat messages .* got type int"):
    records_lib.read_records(tmp_path / "n.parquet", required=("prompt",))
  (tmp_path / "junk.parquet").write_bytes(b"not parquet")
  with pytest.raises(DataError, match=r"junk\.parquet: could not read it as a parquet file"):
    records_lib.read_records(tmp_path / "junk.parquet")


def test_missing_datasets_package_says_how_to_install(tmp_path, monkeypatch):
  import builtins  # pylint: disable=import-outside-toplevel
  real_import = builtins.__import__

  def no_datasets(name, *args, **kwargs):
    if name == "datasets":
      raise ImportError("No module named 'datasets'")
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", no_datasets)
  (tmp_path / "d.parquet").write_bytes(b"x")
  with pytest.raises(DataError, match=r"d\.parquet needs .*pip install datasets"):
    records_lib.read_records(tmp_path / "d.parquet")
  (tmp_path / "dir").mkdir()
  (tmp_path / "dir" / "state.json").write_text('{"_data_files": [{"filename": "x.arrow"}]}')
  with pytest.raises(DataError, match=r"dir needs .*pip install datasets"):
    records_lib.read_records(tmp_path / "dir")


# ----------------------------------------------------------------------------- tokenizing


def test_pad_token_id_falls_back_to_eos_with_one_warning():
  assert encoding.pad_token_id(make_tokenizer()) == 0
  tok = make_tokenizer(pad=False)
  with pytest.warns(UserWarning, match=r"no pad token; padding with the eos token \(id 3\)"):
    assert encoding.pad_token_id(tok) == 3
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert encoding.pad_token_id(tok) == 3  # warned once already
  with pytest.raises(DataError, match="neither a pad token nor an eos token"):
    encoding.pad_token_id(make_tokenizer(pad=False, eos=False))


def test_prompt_ids_chat_template(tok):
  assert encoding.prompt_ids(tok, "a b") == ids(tok, "<user> a b <end> <assistant>")
  assert encoding.prompt_ids(tok, "a", system="c") == ids(
      tok, "<system> c <end> <user> a <end> <assistant>")
  messages = [{"role": "system", "content": "d"}, {"role": "user", "content": "a"}]
  assert encoding.prompt_ids(tok, messages, system="c") == ids(  # the prompt's own system wins
      tok, "<system> d <end> <user> a <end> <assistant>")
  out = encoding.prompt_ids(tok, messages)
  assert type(out) is list and all(type(t) is int for t in out)
  with pytest.raises(DataError, match=r"the tokenizer has no chat template; set "
                     r"data\.chat_template=False"):
    encoding.prompt_ids(make_tokenizer(template=False), "a")
  with pytest.raises(DataError, match="a prompt must be a string or a list of chat messages"):
    encoding.prompt_ids(tok, 5)


def test_prompt_ids_raw_text(tok):
  assert encoding.prompt_ids(tok, "a b", chat_template=False) == ids(tok, "<bos> a b")
  assert encoding.prompt_ids(make_tokenizer(template=False), "a", chat_template=False) == ids(
      tok, "<bos> a")
  with pytest.raises(DataError, match=r"the prompt is a list .* data\.chat_template=False"):
    encoding.prompt_ids(tok, [{"role": "user", "content": "a"}], chat_template=False)
  with pytest.raises(DataError, match="a system prompt needs the chat template"):
    encoding.prompt_ids(tok, "a", system="s", chat_template=False)


def test_prompt_ids_template_failure_is_a_data_error():
  """A template's error is a DataError naming the roles (one that rejects only a system message
  gets it folded into the first user message instead: tests/test_chat_templates.py)."""
  tok = make_tokenizer()
  tok.chat_template = ("{% if messages[0]['role'] == 'system' %}"
                       "{{ raise_exception('System role not supported') }}{% endif %}"
                       "{{ raise_exception('no chat here') }}")
  with pytest.raises(DataError, match=r"chat template failed on the messages \['user'\]: "
                                      r".*no chat here"):
    encoding.prompt_ids(tok, "a")
  with pytest.raises(DataError, match=r"chat template failed .*System role not supported.* "
                                      r"folded .* failed too: .*no chat here"):
    encoding.prompt_ids(tok, "a", system="s")


def test_a_missing_jinja2_is_reported_as_a_missing_package(monkeypatch):
  """Without jinja2, transformers' apply_chat_template raises an ImportError; prompt_ids says
  which package is missing and how to install it, not that the template failed."""
  from transformers.utils import chat_template_utils  # pylint: disable=import-outside-toplevel
  tok = make_tokenizer()
  tok.chat_template = TEMPLATE + "{# a template not compiled before: no lru_cache hit #}"
  monkeypatch.setattr(chat_template_utils, "is_jinja_available", lambda: False)
  with pytest.raises(ImportError) as e:
    encoding.prompt_ids(tok, "a")
  assert not isinstance(e.value, DataError) and e.value.name == "jinja2"
  message = str(e.value)
  assert "chat template needs the Python package `jinja2`" in message
  assert "pip install jinja2" in message and "pip install -e ." in message
  assert "failed on the messages" not in message
  assert "requires jinja2" in message  # transformers' own words are kept


@pytest.mark.parametrize("error, install", [
    (ModuleNotFoundError("No module named 'jinja2'", name="jinja2"), "pip install jinja2"),
    (ImportError("No module named 'markupsafe._speedups'"), "pip install markupsafe"),
    (ImportError("cannot import name 'pass_context' from 'jinja2'", name="jinja2"),
     "pip install -U jinja2"),
])
def test_an_import_error_in_the_template_names_the_package(monkeypatch, error, install):
  tok = make_tokenizer()

  def apply_chat_template(*args, **kwargs):
    raise error

  monkeypatch.setattr(tok, "apply_chat_template", apply_chat_template)
  with pytest.raises(ImportError, match="rendering the tokenizer's chat template needs") as e:
    encoding.prompt_ids(tok, "a")
  assert not isinstance(e.value, DataError) and e.value.__cause__ is error
  assert install in str(e.value) and str(error) in str(e.value)


def test_response_ids(tok):
  assert encoding.response_ids(tok, "a b", stop_id=3) == ids(tok, "a b <eos>")
  assert encoding.response_ids(tok, "", stop_id=7) == [7]
  with pytest.raises(DataError, match="a response must be a string"):
    encoding.response_ids(tok, ["a"], stop_id=3)


def test_smollm2_tokenizer(smollm2_path):
  from ppojax.models import gguf  # pylint: disable=import-outside-toplevel
  tok = gguf.read_tokenizer(smollm2_path)
  messages = [{"role": "user", "content": "What is 2 + 3?"}]
  expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
  expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
  assert encoding.prompt_ids(tok, "What is 2 + 3?") == expected
  assert tok.pad_token_id == tok.eos_token_id
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # pad == eos is a real pad token: no warning
    sft = encoding.encode_sft(tok, [{"prompt": "What is 2 + 3?", "response": "5"}], 64, 4)
  eos = tok.eos_token_id
  assert sft.prompt.tokens[0, sft.prompt.mask[0]].tolist() == expected
  assert sft.response.tokens[0].tolist() == tok.encode("5", add_special_tokens=False) + [eos] * 3
  assert sft.response.mask[0].tolist() == [True, True, False, False]


# ----------------------------------------------------------------------------- padding


def test_left_and_right_pad_examples():
  enc = encoding.left_pad([[1, 2], [3, 4, 5, 6, 7], [8]], 3, pad_id=0)
  np.testing.assert_array_equal(enc.tokens, [[0, 1, 2], [5, 6, 7], [0, 0, 8]])
  np.testing.assert_array_equal(enc.mask, [[0, 1, 1], [1, 1, 1], [0, 0, 1]])
  np.testing.assert_array_equal(enc.truncated, [False, True, False])
  assert enc.tokens.dtype == np.int32 and enc.mask.dtype == bool and enc.truncated.dtype == bool
  enc = encoding.right_pad([[1, 2], [3, 4, 5, 6, 7]], 3, pad_id=9)
  np.testing.assert_array_equal(enc.tokens, [[1, 2, 9], [3, 4, 5]])
  np.testing.assert_array_equal(enc.mask, [[1, 1, 0], [1, 1, 1]])
  np.testing.assert_array_equal(enc.truncated, [False, True])
  assert encoding.left_pad([], 4, 0).tokens.shape == (0, 4)


def test_pad_errors():
  with pytest.raises(DataError, match=r"row 1 has 5 tokens, more than the limit of 3"):
    encoding.left_pad([[1], [1, 2, 3, 4, 5]], 3, 0, truncate="error")
  with pytest.raises(DataError, match=r"row 0 has 4 tokens, more than the limit of 3"):
    encoding.right_pad([[1, 2, 3, 4]], 3, 0, truncate="error")
  assert encoding.left_pad([[1, 2, 3]], 3, 0, truncate="error").truncated.tolist() == [False]
  with pytest.raises(DataError, match=r"row 2 is empty \(zero tokens\)"):
    encoding.left_pad([[1], [2], []], 3, 0)
  with pytest.raises(DataError, match=r"row 0 is empty"):
    encoding.right_pad([[]], 3, 0)
  with pytest.raises(DataError, match=r"left_pad: truncate must be one of \('left', 'error'\), "
                     r"got 'right'"):
    encoding.left_pad([[1]], 3, 0, truncate="right")
  with pytest.raises(DataError, match=r"right_pad: truncate must be one of \('right', 'error'\)"):
    encoding.right_pad([[1]], 3, 0, truncate="left")
  with pytest.raises(DataError, match=r"length must be >= 1, got 0"):
    encoding.left_pad([[1]], 0, 0)


def _reference_pad(seqs, length, pad_id, left):
  """Plain-Python padding: rows of (tokens, mask), truncated flags."""
  rows, flags = [], []
  for s in seqs:
    kept = (s[-length:] if left else s[:length])
    pad = [pad_id] * (length - len(kept))
    toks = pad + kept if left else kept + pad
    mask = [False] * len(pad) + [True] * len(kept) if left else [True] * len(kept) + [False] * len(
        pad)
    rows.append((toks, mask))
    flags.append(len(s) > length)
  return rows, flags


@settings(max_examples=60, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(1, 50_000), min_size=1, max_size=12), max_size=6),
       length=st.integers(1, 10), pad_id=st.integers(0, 5), left=st.booleans())
def test_padding_matches_reference(seqs, length, pad_id, left):
  enc = (encoding.left_pad if left else encoding.right_pad)(seqs, length, pad_id)
  rows, flags = _reference_pad(seqs, length, pad_id, left)
  assert enc.tokens.shape == enc.mask.shape == (len(seqs), length)
  assert [r[0] for r in rows] == enc.tokens.tolist()
  assert [r[1] for r in rows] == enc.mask.tolist()
  assert flags == enc.truncated.tolist()


# ----------------------------------------------------------------------------- encoding


def test_encode_prompts(tok):
  records = [{"prompt": "a b"}, {"q": [{"role": "user", "content": "c"}]}]
  with pytest.raises(DataError, match=r"record 1 has no field 'prompt' \(fields: 'q'\)"):
    encoding.encode_prompts(tok, records, 8)
  enc = encoding.encode_prompts(tok, [{"q": "a b"}, {"q": [{"role": "user", "content": "c"}]}], 5,
                            field="q")
  assert enc.tokens.tolist() == [ids(tok, "<user> a b <end> <assistant>"),
                                 ids(tok, "<pad> <user> c <end> <assistant>")]
  assert enc.mask.sum(1).tolist() == [5, 4] and not enc.truncated.any()
  enc = encoding.encode_prompts(tok, [{"prompt": "a b c d"}], 4)
  assert enc.tokens.tolist() == [ids(tok, "c d <end> <assistant>")] and enc.truncated.all()
  with pytest.raises(DataError, match=r"prompts \(field 'prompt'\): row 0 has 7 tokens, more "
                     "than the limit of 4"):
    encoding.encode_prompts(tok, [{"prompt": "a b c d"}], 4, truncate="error")
  with pytest.raises(DataError, match=r"prompts \(field 'prompt'\): row 1 is empty"):
    encoding.encode_prompts(make_tokenizer(bos=False), [{"prompt": "a"}, {"prompt": " "}], 4,
                        chat_template=False)
  with pytest.raises(DataError, match=r"record 0, field 'prompt': the tokenizer has no chat"):
    encoding.encode_prompts(make_tokenizer(template=False), [{"prompt": "a"}], 4)
  with pytest.raises(DataError, match=r"encode_prompts: truncate must be one of"):
    encoding.encode_prompts(tok, [{"prompt": "a"}], 4, truncate="right")


def test_encode_pairs(tok):
  records = [{"prompt": "a", "chosen": "b c", "rejected": "d"},
             {"prompt": "e f", "chosen": "g", "rejected": "a b c d"}]
  pairs = encoding.encode_pairs(tok, records, 6, 3, system="h")
  assert pairs.prompt.tokens.shape == (2, 6) and pairs.prompt.truncated.tolist() == [True, True]
  assert pairs.prompt.tokens.tolist() == [ids(tok, "h <end> <user> a <end> <assistant>"),
                                          ids(tok, "<end> <user> e f <end> <assistant>")]
  assert pairs.chosen.tokens.tolist() == [ids(tok, "b c <eos>"), ids(tok, "g <eos> <pad>")]
  assert pairs.chosen.mask.tolist() == [[1, 1, 1], [1, 1, 0]]
  assert pairs.rejected.tokens.tolist() == [ids(tok, "d <eos> <pad>"), ids(tok, "a b c")]
  assert pairs.rejected.truncated.tolist() == [False, True]
  pairs = encoding.encode_pairs(tok, records[:1], 8, 4, stop_id=7, chat_template=True)
  assert pairs.chosen.tokens.tolist() == [ids(tok, "b c") + [7, 0]]
  with pytest.raises(DataError, match=r"record 1 has no field 'rejected' \(fields: 'prompt', "
                     r"'chosen'\)"):
    encoding.encode_pairs(tok, [records[0], {"prompt": "a", "chosen": "b"}], 8, 4)
  with pytest.raises(DataError, match=r"record 0, field 'chosen': a response must be a string"):
    encoding.encode_pairs(tok, [{"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}],
                             "rejected": "c"}], 8, 4)


def test_encode_sft_pads_responses_with_eos_when_no_pad(tmp_path):
  tok = make_tokenizer(pad=False)
  path = tmp_path / "sft.jsonl"
  records_lib.write_jsonl([{"prompt": "a", "response": "b c"}, {"prompt": "d", "response": ""}], path)
  records = records_lib.read_records(path, required=("prompt", "response"))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    sft = encoding.encode_sft(tok, records, 5, 4)
  eos = tok.eos_token_id
  assert sft.prompt.tokens.tolist() == [ids(tok, "<eos> <user> a <end> <assistant>"),
                                        ids(tok, "<eos> <user> d <end> <assistant>")]
  assert sft.prompt.mask[:, 0].tolist() == [False, False]
  assert sft.response.tokens.tolist() == [ids(tok, "b c") + [eos, eos], [eos] * 4]
  assert sft.response.mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
  with pytest.raises(DataError, match="no eos token to end responses with; pass stop_id"):
    encoding.encode_sft(make_tokenizer(eos=False), records, 5, 4)
  sft = encoding.encode_sft(make_tokenizer(eos=False), records, 5, 4, stop_id=5)
  assert sft.response.tokens[1].tolist() == [5, 0, 0, 0]


# ----------------------------------------------------------------------------- batching


def test_batch_indices_is_deterministic_and_covers_each_epoch():
  n, b = 10, 4
  a = [encoding.batch_indices(n, b, seed=3, position=p) for p in range(10)]
  assert all(x.dtype == np.int64 and x.shape == (b,) for x in a)
  assert all(np.array_equal(x, encoding.batch_indices(n, b, 3, p)) for p, x in enumerate(a))
  stream = np.concatenate(a)  # 40 indices = exactly 4 epochs, batches 2 and 7 straddle
  for e in range(4):
    epoch = stream[e * n:(e + 1) * n]
    assert sorted(epoch.tolist()) == list(range(n))
    np.testing.assert_array_equal(epoch, np.random.default_rng([3, e]).permutation(n))
  assert not np.array_equal(stream[:n], stream[n:2 * n])  # reshuffled each epoch
  np.testing.assert_array_equal(a[2], np.concatenate([stream[8:10], stream[10:12]]))
  assert not np.array_equal(encoding.batch_indices(n, b, 4, 0), a[0])


def test_batch_indices_larger_than_n_and_far_positions():
  x = encoding.batch_indices(3, 7, seed=0, position=1)  # rows 7..13 of the stream: epochs 2, 3, 4
  perms = [np.random.default_rng([0, e]).permutation(3) for e in range(5)]
  np.testing.assert_array_equal(x, np.concatenate(perms)[7:14])
  far = encoding.batch_indices(1000, 32, seed=1, position=10**9)
  start = 10**9 * 32
  perm = np.random.default_rng([1, start // 1000]).permutation(1000)
  np.testing.assert_array_equal(far, perm[start % 1000:start % 1000 + 32])


def test_batch_indices_errors():
  with pytest.raises(DataError, match=r"no rows to draw from \(n=0\)"):
    encoding.batch_indices(0, 4, 0, 0)
  with pytest.raises(DataError, match=r"batch_size must be >= 1, got 0"):
    encoding.batch_indices(5, 0, 0, 0)
  with pytest.raises(DataError, match=r"position must be >= 0"):
    encoding.batch_indices(5, 2, 0, -1)
