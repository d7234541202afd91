"""The Hugging Face configs run end to end on CPU: configs/qwen2_5_arith.py, llama3_2_rm.py and
gpt2_file.py, each for one PPO iteration (and its held-out evaluation before and after, where
the config has one) on a tiny random checkpoint of its architecture, written here as a Hugging
Face directory (config.json, model.safetensors, tokenizer) that ``model.policy`` (and
``model.reward``) point to. The stand-ins keep what the configs rely on: the real vocabulary
size, special token ids (the configs' stop and pad ids), a byte-level tokenizer of the real
class, the chat template's layout, RoPE and tied embeddings; only widths, depths and the run's
sizes are tiny."""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from ppojax.data import records as records_lib
from ppojax.models import (
  CausalLM,
  LoadedModel,
  ModelConfig,
  ValueModel,
  init_params,
  load_model,
  save_model,
)
from ppojax.run import build as build_lib
from ppojax.run import reporting, runner
from ppojax.tasks import arith

ROOT = pathlib.Path(__file__).parents[1]
TINY = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, max_position_embeddings=256)
# the run's sizes: one iteration of 8 prompts, 6 new tokens; every other option is the config's
SMALL = dict(num_iterations=1, save_every=1, sample_every=1, rl__batch_size=8,
             sampling__max_new_tokens=6, eval__batch_size=4)


def _tokenizer(vocab_size: int, specials: dict[str, int], template: str | None, *,
               merges: dict[tuple[str, str], int] | None = None,
               **roles) -> PreTrainedTokenizerFast:
  """A byte-level BPE tokenizer, as all three real ones are: the 256 byte symbols at ids 0-255
  in GPT-2's order (also Qwen's and Llama 3's: "\\n" is 198, " " 220), ``merges`` (pair → id)
  and the special tokens at their real ids, and every other id a filler that text never encodes
  to (a random model samples it; it decodes to its name)."""
  merges = merges or {}
  vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
  vocab.update({a + b: i for (a, b), i in merges.items()})
  vocab.update(specials)
  taken = set(vocab.values())
  vocab.update({f"<filler{i}>": i for i in range(vocab_size) if i not in taken})
  assert sorted(vocab.values()) == list(range(vocab_size))
  tok = Tokenizer(models.BPE(vocab, list(merges)))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template,
                                 additional_special_tokens=list(specials), **roles)


def _checkpoint(directory: pathlib.Path, hf_config: dict, tokenizer=None, tokenizer_class="",
                head: str = "lm", seed: int = 0) -> str:
  """A random model of ``hf_config`` (a config.json dict) saved as a Hugging Face directory,
  with the tokenizer class the real checkpoint names (AutoTokenizer loads it as that)."""
  cfg = ModelConfig.from_hf(hf_config)
  module = ValueModel(cfg) if head == "value" else CausalLM(cfg)
  params = jax.device_get(init_params(module, jax.random.key(seed)))
  out = save_model(directory, LoadedModel(cfg, params, tokenizer, head))
  if tokenizer_class:
    path = out / "tokenizer_config.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()),
                                    tokenizer_class=tokenizer_class)))
  return str(out)


def qwen2_5(tmp_path):
  """Qwen2.5-0.5B-Instruct's layout: ChatML with a default system prompt (a short one here)."""
  specials = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
  template = (
      "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are Qwen.<|im_end|>\n"
      "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
      "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
  tok = _tokenizer(151936, specials, template, eos_token="<|im_end|>", pad_token="<|endoftext|>")
  hf_config = dict(TINY, model_type="qwen2", vocab_size=151936, rms_norm_eps=1e-6,
                   rope_theta=1e6, tie_word_embeddings=True, bos_token_id=151643,
                   eos_token_id=151645, pad_token_id=151643, use_sliding_window=False)
  return {"model__policy": _checkpoint(tmp_path / "qwen", hf_config, tok, "Qwen2Tokenizer"),
          "data__eval_per_digits": 2}  # 4 held-out problems


def llama3_2(tmp_path):
  """Llama-3.2-1B-Instruct's layout (llama3 RoPE scaling, <|eot_id|> ends a turn, no pad token),
  and a reward model of the same architecture on its tokenizer."""
  specials = {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001,
              "<|start_header_id|>": 128006, "<|end_header_id|>": 128007, "<|eom_id|>": 128008,
              "<|eot_id|>": 128009}
  template = ("<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
              "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
              "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
              "{% endif %}")
  tok = _tokenizer(128256, specials, template, bos_token="<|begin_of_text|>",
                   eos_token="<|eot_id|>")
  hf_config = dict(TINY, model_type="llama", vocab_size=128256, rms_norm_eps=1e-5,
                   rope_theta=5e5, tie_word_embeddings=True, bos_token_id=128000,
                   eos_token_id=[128001, 128008, 128009],
                   rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192})
  prompts = tmp_path / "prompts.jsonl"
  records_lib.write_jsonl([{"prompt": [{"role": "user", "content": p["prompt"]}]}
                    for p in arith.problems(0, 16)], prompts)
  return {"model__policy": _checkpoint(tmp_path / "llama", hf_config, tok,
                                      "PreTrainedTokenizerFast"),
          "model__reward": _checkpoint(tmp_path / "llama_rm", hf_config, head="value", seed=1),
          "data__path": str(prompts), "data__max_prompt_len": 48}


def gpt2(tmp_path):
  """GPT-2's layout: no chat template, <|endoftext|> (50256) for everything special, "\\n" 198
  and "\\n\\n" 628 (the config's stop ids); the prompt files written by the config's own
  command (python -m ppojax.tasks.arith prompts)."""
  tok = _tokenizer(50257, {"<|endoftext|>": 50256}, None, merges={("Ċ", "Ċ"): 628},
                   bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                   unk_token="<|endoftext|>")
  assert tok("\n\n")["input_ids"] == [628] and tok(" \n")["input_ids"] == [220, 198]
  hf_config = dict(model_type="gpt2", vocab_size=50257, n_embd=16, n_layer=2, n_head=2,
                   n_positions=256, layer_norm_epsilon=1e-5, bos_token_id=50256,
                   eos_token_id=50256)
  train, test = tmp_path / "arith_train.jsonl", tmp_path / "arith_test.jsonl"
  arith.main(["prompts", "--n", "16", "--out", str(train)])
  arith.main(["prompts", "--n", "4", "--split", "test", "--out", str(test)])
  # "your own" reward by import path, as the config's docstring shows: the completion's length
  # (tests/text_reward_fn.py), which a random model's completions vary in; arith's reward is 0
  # for all of them, which leaves nothing to learn from
  return {"model__policy": _checkpoint(tmp_path / "gpt2", hf_config, tok, "GPT2Tokenizer"),
          "data__path": str(train), "data__eval_path": str(test),
          "reward__fn": "text_reward_fn:length", "eval__metrics__score": "text_reward_fn:length"}


@pytest.mark.parametrize("name, stand_in", [("qwen2_5_arith", qwen2_5), ("llama3_2_rm", llama3_2),
                                            ("gpt2_file", gpt2)])
def test_hugging_face_config_runs_one_iteration(name, stand_in, tmp_path):
  config = build_lib.load_config(ROOT / "configs" / f"{name}.py", **SMALL, **stand_in(tmp_path))
  work = tmp_path / "run"
  result = runner.run(config, str(work))

  (row,) = result.history
  assert row["iteration"] == 1
  for key in ("objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg"):
    assert np.isfinite(row[key]), (key, row)
  logged = [r for r in reporting.read_metrics(str(work / "metrics.jsonl"))
            if "objective/scores" in r]
  assert [r["step"] for r in logged] == [1]
  assert logged[0]["objective/scores"] == pytest.approx(row["objective/scores"])
  samples = [json.loads(line) for line in open(work / "samples.jsonl")]  # decoded by the
  assert samples and all(s["step"] == 1 and "What is " in s["prompt"] for s in samples)  # tokenizer
  if config.reward.kind == "model":  # the random reward model scored the responses
    assert row["objective/scores"] != 0
  held_out = config.data.task == "arith" or bool(config.data.eval_path)  # not llama3_2_rm's
  baselines = {f"before_{name}" for name in config.eval.baselines}  # the untrained, instructed
  assert set(result.evals) == ({"before", "after"} | baselines if held_out else set())
  assert bool(baselines) == held_out  # tests/test_configs.py: every accuracy table has one
  if held_out:
    assert json.loads((work / "eval.json").read_text()) == result.evals
    assert {"eval/accuracy", "eval/score"} <= set(result.evals["after"])
  # the trained policy: the same architecture and tokenizer, and weights that moved
  start, trained = load_model(config.model.policy), load_model(work / "policy")
  assert trained.cfg == start.cfg and trained.tokenizer.get_vocab() == start.tokenizer.get_vocab()
  moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()),
                       trained.params, start.params)
  assert max(jax.tree.leaves(moved)) > 0
