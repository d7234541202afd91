"""Qwen3-0.6B learns small-number arithmetic by PPO on one accelerator: configs/qwen2_5_arith.py
with Qwen3, whose chat template thinks first by default.

    python -m ppojax.train --config configs/qwen3_arith.py --workdir runs/qwen3_arith \\
        --config.model.policy=/path/to/Qwen3-0.6B     # a local Hugging Face directory

Qwen3's template takes ``enable_thinking`` (True by default: the model writes <think>…</think>
before its answer, hundreds of tokens that the response budget must hold). For one-number
answers this config turns it off (``data.chat_template_kwargs``): the template then closes an
empty think block and the model answers directly. To train with thinking on, drop that line and
raise ``sampling.max_new_tokens`` (and ``rl.missing_stop_penalty`` then penalises a think block
cut off by the budget). Qwen3 ships no default system prompt, so prompts are shorter than
Qwen2.5's.
"""

from __future__ import annotations

import pathlib
import runpy

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  qwen2_5 = runpy.run_path(str(pathlib.Path(__file__).with_name("qwen2_5_arith.py")))
  c = qwen2_5["get_config"]()  # task, reward, evaluation, PPO settings: the same
  c.model.policy = "Qwen/Qwen3-0.6B"  # or a local Hugging Face directory
  c.data.chat_template_kwargs = ml_collections.ConfigDict({"enable_thinking": False})
  c.data.max_prompt_len = 48  # the template adds "<think>\n\n</think>\n\n" to the prompt
  c.sampling.stop_ids = [151645, 151643]  # <|im_end|> (end of turn), <|endoftext|>
  c.sampling.pad_id = 151643
  return c
