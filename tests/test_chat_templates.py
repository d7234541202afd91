"""Chat templates of the 2026 families (ppojax.data.encoding) and their tool-call formats
(ppojax.data.tool_formats), offline.

Small hand-written Jinja templates behave like the real ones where it matters: a Gemma-2-like
one raises "System role not supported", a Gemma-3-like one folds the system message into the
first user turn itself, a Qwen3-like one reads ``enable_thinking``. They sit on a character-level
tokenizer built here, so every rendered prompt decodes back to its exact text.
"""

from __future__ import annotations

import pathlib
import string

import ml_collections
import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from ppojax.data import encoding
from ppojax.data.records import DataError
from ppojax.data.tool_formats import FORMATS, parse_tool_calls, tool_format
from ppojax.run import aot, baselines, checks
from ppojax.run.config import defaults, supervised_defaults
from ppojax.tasks import sources

# as Gemma 2's: a system message raises, roles must alternate, "assistant" is "model"
GEMMA2 = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
          "{{ raise_exception('System role not supported') }}{% endif %}"
          "{% for message in messages %}"
          "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/...') }}"
          "{% endif %}{% set role = 'model' if message['role'] == 'assistant' else "
          "message['role'] %}"
          "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
# as Gemma 3's: the system text and a blank line open the first user turn
GEMMA3 = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
          "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}"
          "{% set loop_messages = messages[1:] %}"
          "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
          "{% for message in loop_messages %}"
          "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/...') }}"
          "{% endif %}{% set role = 'model' if message['role'] == 'assistant' else "
          "message['role'] %}"
          "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
          "{{ message['content'] | trim + '<end_of_turn>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
# as Qwen3's: enable_thinking=False adds an empty think block after the generation prompt
QWEN3 = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
         "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
         "{{ '<|im_start|>assistant\n' }}"
         "{% if enable_thinking is defined and enable_thinking is false %}"
         "{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}")
EMPTY_THINK = "<think>\n\n</think>\n\n"


def char_tokenizer(template: str) -> PreTrainedTokenizerFast:
  """One token per printable ASCII character and "\\n", <bos> as a special token; decodes to
  the exact text."""
  chars = sorted(set(string.printable) - set("\t\n\r\x0b\x0c")) + ["\n"]
  vocab = {t: i for i, t in enumerate(["<pad>", "</s>", "<unk>", "<bos>"] + chars)}
  tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
  tok.decoder = decoders.Fuse()
  return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="</s>",
                                 pad_token="<pad>", unk_token="<unk>", chat_template=template)


@pytest.fixture(scope="module")
def gemma2():
  return char_tokenizer(GEMMA2)


@pytest.fixture(scope="module")
def gemma3():
  return char_tokenizer(GEMMA3)


@pytest.fixture(scope="module")
def qwen3():
  return char_tokenizer(QWEN3)


def text(tok, ids) -> str:
  return tok.decode(ids)


def rendered(tok, messages, **kwargs) -> str:
  """The template's own text of ``messages`` with the generation prompt."""
  return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)


def config(**changes) -> ml_collections.ConfigDict:
  """``defaults()`` for the arith task with ``section__field=value`` changes."""
  c = defaults()
  c.rl.batch_size = 4
  c.data.max_prompt_len = 96
  for name, value in changes.items():
    section, field = name.split("__")
    assert field in c[section], name
    c[section][field] = value
  return c


def batch_texts(config_, tok) -> list[str]:
  """The decoded prompts (special tokens too) of the first batch of ``config_``'s source."""
  prompts = sources.make_source(config_, tok).batch(0).prompts
  return [text(tok, tokens[mask]) for tokens, mask in zip(prompts.tokens, prompts.mask)]


# ----------------------------------------------------------------------------- system folding


def test_a_rejected_system_message_is_folded_as_gemma3_folds_it(gemma2, gemma3):
  with pytest.raises(Exception, match="System role not supported"):  # the template itself
    rendered(gemma2, [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
  ids = encoding.prompt_ids(gemma2, "What is 2 + 3?", system="Be brief.")
  assert ids == encoding.prompt_ids(gemma3, "What is 2 + 3?", system="Be brief.")
  assert text(gemma2, ids) == ("<bos><start_of_turn>user\nBe brief.\n\nWhat is 2 + 3?"
                               "<end_of_turn>\n<start_of_turn>model\n")
  chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"},
          {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
  assert text(gemma2, encoding.prompt_ids(gemma2, chat)) == rendered(gemma3, chat)
  assert encoding.prompt_ids(gemma2, "x") == encoding.prompt_ids(gemma3, "x")  # nothing to fold
  assert (encoding.template_prefix(gemma2, system="Be brief.")
          == encoding.template_prefix(gemma3, system="Be brief."))


def test_folding_goes_through_the_config_to_the_batches(gemma2, gemma3):
  c = config(data__system="Be brief.")
  source = sources.make_source(c, gemma2)
  records = source.batch(0).records
  assert batch_texts(c, gemma2) == [
      rendered(gemma3, [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": r["prompt"]}]) for r in records]
  assert source.prefix == encoding.template_prefix(gemma3, system="Be brief.")
  assert text(gemma2, source.prefix).startswith("<bos><start_of_turn>user\nBe brief.\n\n")


def test_a_template_that_rejects_something_else_still_fails_clearly(gemma2):
  two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
  with pytest.raises(DataError, match=r"failed on the messages \['user', 'user'\]: .*must "
                                      "alternate"):
    encoding.prompt_ids(gemma2, two_users)
  # with a system message too, folding it does not help: both errors are reported
  with pytest.raises(DataError, match=r"\['system', 'user', 'user'\]: .*System role not "
                                      r"supported; with the system message folded into the first "
                                      r"user message .* failed too: .*must alternate"):
    encoding.prompt_ids(gemma2, two_users, system="s")
  with pytest.raises(DataError, match="System role not supported"):  # no user turn to fold into
    encoding.prompt_ids(gemma2, [{"role": "assistant", "content": "a"}], system="s")
  with pytest.raises(DataError, match=r"record 1, field 'prompt'.*must alternate"):
    encoding.encode_prompts(gemma2, [{"prompt": "a"}, {"prompt": two_users}], 64, system="s")


def test_fold_system():
  chat = [{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"},
          {"role": "user", "content": "U"}]
  assert encoding.fold_system(chat) == [{"role": "assistant", "content": "A"},
                                        {"role": "user", "content": "S\n\nU"}]
  assert chat[2]["content"] == "U"  # the messages given are not changed
  assert encoding.fold_system(chat[1:]) is None
  assert encoding.fold_system(chat[:2]) is None
  assert encoding.fold_system([{"role": "system", "content": [{"type": "text"}]},
                               {"role": "user", "content": "U"}]) is None


# ----------------------------------------------------------------------------- chat_template_kwargs


def test_enable_thinking_reaches_the_template(qwen3):
  on = text(qwen3, encoding.prompt_ids(qwen3, "2+3?"))
  off = text(qwen3, encoding.prompt_ids(qwen3, "2+3?",
                                        chat_template_kwargs={"enable_thinking": False}))
  assert on == "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"
  assert off == on + EMPTY_THINK
  kwargs = ml_collections.ConfigDict({"enable_thinking": False})  # as the config holds it
  assert text(qwen3, encoding.prompt_ids(qwen3, "2+3?", chat_template_kwargs=kwargs)) == off


def test_chat_template_kwargs_go_from_the_config_to_the_rl_batches(qwen3):
  default = config()
  assert default.data.chat_template_kwargs.to_dict() == {}
  assert all(t.endswith("<|im_start|>assistant\n") for t in batch_texts(default, qwen3))
  c = config(data__chat_template_kwargs={"enable_thinking": False})
  checks.validate(c, num_devices=1)
  texts = batch_texts(c, qwen3)
  assert texts and all(t.endswith("<|im_start|>assistant\n" + EMPTY_THINK) for t in texts)
  source = sources.make_source(c, qwen3)
  held_out = source.encode(source.eval_records[:2])  # evaluation encodes with the same options
  assert all(sources.decode_text(qwen3, t, m).endswith(EMPTY_THINK)
             for t, m in zip(held_out.tokens, held_out.mask))
  assert aot.training_prefix_len(c, qwen3) == len(source.prefix)
  longest = baselines._longest(c, qwen3, source.eval_records)  # pylint: disable=protected-access
  assert longest == max(int(m.sum()) for m in source.encode(source.eval_records).mask)


@pytest.mark.parametrize("stage", ["sft", "train_rm"])
def test_chat_template_kwargs_reach_the_supervised_stages(qwen3, stage):
  from ppojax.supervised import sft, train_rm  # pylint: disable=import-outside-toplevel
  c = supervised_defaults()
  c.data.train_size, c.data.eval_size, c.data.max_prompt_len = 4, 2, 96
  c.data.chat_template_kwargs = {"enable_thinking": False}
  from ppojax.supervised import checks as supervised_checks  # pylint: disable=C0415
  supervised_checks.validate_supervised(c)
  load = sft.load_examples if stage == "sft" else train_rm.load_pairs
  train, held_out, _ = load(c, qwen3)
  for arrays in (train, held_out):
    for tokens, mask in zip(arrays["prompt"], arrays["prompt_mask"]):
      assert text(qwen3, tokens[mask]).endswith("<|im_start|>assistant\n" + EMPTY_THINK)


def test_chat_template_kwargs_on_the_command_line():
  from absl import flags  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  path = pathlib.Path(__file__).parents[1] / "configs" / "quickstart.py"
  override = "--config.data.chat_template_kwargs={'enable_thinking': False}"
  argv = ["train", f"--config={path}", override]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", str(path), flag_values=fv, sys_argv=argv)
  fv(argv)
  assert fv.config.data.chat_template_kwargs.to_dict() == {"enable_thinking": False}
  checks.validate(fv.config, num_devices=1)


@pytest.mark.parametrize("value, message", [
    ("enable_thinking=False", r"must be a dict of the chat template's variables.*got the str"),
    ([("enable_thinking", False)], r"must be a dict.*got the list"),
    ({1: True}, r"the keys must be the names \(strings\).*got \[1\]"),
    ({"": True}, r"the keys must be the names"),
    ({"add_generation_prompt": False, "tokenize": False},
     r"sets \['add_generation_prompt', 'tokenize'\]: ppojax sets these"),
])
def test_bad_chat_template_kwargs_give_a_clear_error(qwen3, value, message):
  with pytest.raises(DataError, match=message):
    encoding.template_kwargs(value)
  with pytest.raises(DataError, match=message):
    encoding.prompt_ids(qwen3, "a", chat_template_kwargs=value)
  if isinstance(value, dict):  # a config can hold only a section here
    c = config(data__chat_template_kwargs=value)
    with pytest.raises(checks.ConfigError, match=r"data\.chat_template_kwargs" if "keys" in message
                       else message):
      checks.validate(c, num_devices=1)


def test_chat_template_kwargs_none_and_wrong_types_in_the_config():
  c = config()
  c.data.chat_template_kwargs = None
  with pytest.raises(checks.ConfigError, match=r"data\.chat_template_kwargs=None: give a dict"):
    checks.validate(c, num_devices=1)
  with pytest.raises(TypeError):  # ml_collections itself refuses a string for the section
    config().data.chat_template_kwargs = "enable_thinking=False"
  s = supervised_defaults()
  s.data.chat_template_kwargs = {2: "x"}
  from ppojax.supervised import checks as supervised_checks  # pylint: disable=C0415
  with pytest.raises(checks.ConfigError, match=r"data\.chat_template_kwargs: the keys"):
    supervised_checks.validate_supervised(s)


def test_chat_template_kwargs_need_the_chat_template(qwen3):
  with pytest.raises(DataError, match=r"data\.chat_template_kwargs are the chat template's "
                                      r"variables; set data\.chat_template=True"):
    encoding.encode_prompts(qwen3, [{"prompt": "a"}], 8, chat_template=False,
                            chat_template_kwargs={"enable_thinking": False})
  raw = encoding.prompt_ids(qwen3, "a", chat_template=False, chat_template_kwargs={})
  assert text(qwen3, raw) == "a"


# ----------------------------------------------------------------------------- prompt format


def test_prompt_format_frames_raw_prompts_for_a_base_model(qwen3):
  """data.prompt_format puts every string prompt in a frame (configs/quickstart_gemma3.py):
  the batches and the held-out encoder alike; chat-message prompts stay as they are."""
  c = config(data__chat_template=False, data__prompt_format="Question: {prompt}\nAnswer:")
  source = sources.make_source(c, qwen3)
  records = source.batch(0).records
  assert batch_texts(c, qwen3) == [f"Question: {r['prompt']}\nAnswer:" for r in records]
  held_out = source.encode(source.eval_records[:2])
  assert [text(qwen3, t[m]) for t, m in zip(held_out.tokens, held_out.mask)] == [
      f"Question: {r['prompt']}\nAnswer:" for r in source.eval_records[:2]]
  chat = [{"role": "user", "content": "a"}]
  assert sources.formatted([{"prompt": chat}], "prompt", "Q: {prompt}") == [{"prompt": chat}]


@pytest.mark.parametrize("fmt,message", [
    ("Question:", r"must be a string holding \{prompt\}"),
    ("{question}", r"only\s+field is \{prompt\} \(KeyError"),
    ("{prompt} {", r"not a str.format template"),
])
def test_a_bad_prompt_format_is_a_clear_config_error(fmt, message):
  with pytest.raises(checks.ConfigError, match=r"data\.prompt_format=.*" + message):
    checks.validate(config(data__prompt_format=fmt), num_devices=1)


# ----------------------------------------------------------------------------- tool calls


def test_every_family_has_a_format_with_its_markers():
  assert set(FORMATS) == {"qwen3", "smollm3", "llama3", "gemma3", "olmo3"}
  assert tool_format("Qwen2.5") is FORMATS["qwen3"] and tool_format("gemma2") is FORMATS["gemma3"]
  assert (FORMATS["qwen3"].call_open, FORMATS["qwen3"].result_role) == ("<tool_call>", "tool")
  assert FORMATS["llama3"].result_role == "ipython"
  assert FORMATS["olmo3"].result_role == "environment"
  assert FORMATS["gemma3"].result_open == "```tool_output\n"
  with pytest.raises(ValueError, match="unknown tool-call format 'mistral'; known: .*qwen3"):
    tool_format("mistral")


def test_hermes_calls():
  completion = ('<think>\nI could <tool_call>{"name": "no"}</tool_call> here.\n</think>\n\n'
                'Let me look.\n<tool_call>\n{"name": "search", "arguments": {"q": "cows"}}\n'
                '</tool_call>\n<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n'
                '</tool_call>\n<tool_call>\n{"name": "now"}')  # cut off: runs to the end
  assert parse_tool_calls(completion, "qwen3") == [
      {"name": "search", "arguments": {"q": "cows"}}, {"name": "add", "arguments": {"a": 1}},
      {"name": "now", "arguments": {}}]
  assert parse_tool_calls(completion, "smollm3") == parse_tool_calls(completion, "qwen3")
  bad = ('<tool_call>{"name": "s", "arguments": {"q": }}</tool_call>'
         '<tool_call>{"arguments": {}}</tool_call><tool_call>["s"]</tool_call>'
         '<tool_call>{"name": "s", "arguments": [1]}</tool_call>')
  errors = parse_tool_calls(bad, "qwen3")
  assert [sorted(e) for e in errors] == [["error", "text"]] * 4
  assert errors[0]["error"].startswith("bad JSON") and errors[0]["text"].startswith('{"name"')
  assert 'no "name"' in errors[1]["error"] and "got list" in errors[2]["error"]
  assert "must be a JSON object, got list" in errors[3]["error"]
  assert parse_tool_calls("The answer is 5.", "qwen3") == []
  assert parse_tool_calls("<think>still thinking <tool_call>{", "qwen3") == []


def test_llama3_json_calls():
  assert parse_tool_calls('{"name": "weather", "parameters": {"city": "Paris"}}<|eot_id|>',
                          "llama3") == [{"name": "weather", "arguments": {"city": "Paris"}}]
  several = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}'
  assert parse_tool_calls(several, "llama3.1") == [{"name": "a", "arguments": {}},
                                                   {"name": "b", "arguments": {"x": 1}}]
  assert parse_tool_calls('<|python_tag|>brave_search.call(query="cows")', "llama3") == [
      {"name": "brave_search", "arguments": {"query": "cows"}}]
  assert parse_tool_calls("Paris is sunny {mostly}.", "llama3") == []  # not a call: prose
  cut = parse_tool_calls('{"name": "a", "parameters": {"x": ', "llama3")
  assert len(cut) == 1 and cut[0]["error"].startswith("bad JSON")
  tagged = parse_tool_calls("<|python_tag|>print(1)", "llama3")
  assert "neither a JSON call nor a built-in" in tagged[0]["error"]
  assert "no \"name\"" in parse_tool_calls('{"parameters": {}}', "llama3")[0]["error"]


def test_gemma_tool_code_calls():
  completion = ('I will check.\n```tool_code\nget_weather(city="London", days=3)\n'
                'get_time(zone=None)\n```\nand a list:\n```tool_code\n'
                '[f(a=[1, 2], b={"k": true}), g()]\n```')
  assert parse_tool_calls(completion, "gemma3") == [
      {"name": "get_weather", "arguments": {"city": "London", "days": 3}},
      {"name": "get_time", "arguments": {"zone": None}},
      {"name": "f", "arguments": {"a": [1, 2], "b": {"k": True}}}, {"name": "g", "arguments": {}}]
  errors = parse_tool_calls('```tool_code\nf(1)\nx = g()\nh(a=open("x"))\n```', "gemma2")
  assert ["by name" in errors[0]["error"], "not a function call" in errors[1]["error"],
          "must be literals" in errors[2]["error"]] == [True] * 3
  assert "not Python calls" in parse_tool_calls("```tool_code\nf(a=\n```", "gemma3")[0]["error"]
  assert parse_tool_calls("```python\nf(a=1)\n```", "gemma3") == []


def test_olmo3_function_calls():
  completion = ('<function_calls>get_weather(city="SF", metric=true)\n'
                'get_time()\n</function_calls>')
  assert parse_tool_calls(completion, "olmo3") == [
      {"name": "get_weather", "arguments": {"city": "SF", "metric": True}},
      {"name": "get_time", "arguments": {}}]
  assert "empty call block" in parse_tool_calls("<function_calls></function_calls>",
                                                "olmo3")[0]["error"]
  assert "never closed" in parse_tool_calls('<function_calls>f(a="x"</function_calls>',
                                            "olmo3")[0]["error"]
  assert parse_tool_calls("No tools needed.", "olmo3") == []


@pytest.mark.parametrize("family", sorted(FORMATS))
def test_no_input_crashes_the_parser(family):
  for completion in ["", "<tool_call>", "```tool_code", "<function_calls>", "{", "<|python_tag|>",
                     "<tool_call>" + "[" * 5000, "```tool_code\n" + "(" * 5000 + "\n```",
                     "<function_calls>f(a=\x00)</function_calls>", "{" * 3000,
                     '<tool_call>{"name": "x", "arguments": {"a": 1e999}}</tool_call>']:
    calls = parse_tool_calls(completion, family)
    assert all(("name" in c and isinstance(c["arguments"], dict)) or "error" in c for c in calls)
