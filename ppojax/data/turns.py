"""The tokens of a message that answers the policy in a multi-turn episode (an environment's
observation, a tool's result), framed by the chat template as the conversation goes on: what
follows the policy's end-of-turn token, up to and including the next generation prompt.

    SmolLM2 / Qwen:  "\\n<|im_start|>user\\nHigher.<|im_end|>\\n<|im_start|>assistant\\n"
    raw text:        "\\nHigher.\\n"   (``chat_template=False``: a base model's frame)

Token in, token out: these ids are appended to the sampled ids as they are; the conversation is
never rendered and tokenised again.
"""

from __future__ import annotations

from collections.abc import Mapping

from ppojax.data.chat import plain_ids, template_kwargs
from ppojax.data.records import DataError

_MARK = "PPOJAX_TURN_MARK"  # stands for the policy's turn in the rendered conversation


def end_of_turn(tokenizer, stop_ids) -> str:
  """The text of the stop token that ends the policy's turn (the first of ``stop_ids``)."""
  return tokenizer.decode([stop_ids[0]])


def observation_ids(tokenizer, text: str, *, end_of_turn: str, role: str = "user",
                    chat_template: bool = True, chat_template_kwargs: Mapping | None = None
                    ) -> list[int]:
  """Token ids of ``text`` as the next ``role`` message after an assistant turn that ended on
  ``end_of_turn`` (the text of the stop token the policy sampled, e.g. "<|im_end|>"), with the
  generation prompt of the assistant's next turn. Without the chat template: "\\n" + text +
  "\\n"."""
  if not chat_template:
    return plain_ids(tokenizer(f"\n{text}\n", add_special_tokens=False)["input_ids"])
  messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": _MARK},
              {"role": role, "content": text}]
  try:
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False,
                                             **template_kwargs(chat_template_kwargs))
  except Exception as e:  # jinja errors: e.g. a template without the role
    raise DataError(f"the chat template cannot frame a {role!r} message after an assistant "
                    f"turn: {type(e).__name__}: {e}") from e
  if _MARK not in rendered:
    raise DataError("the chat template drops the assistant's turn from the conversation; "
                    "multi-turn rollouts need a template that keeps it")
  tail = rendered[rendered.index(_MARK) + len(_MARK):]
  if end_of_turn and tail.startswith(end_of_turn):  # the policy sampled it already
    tail = tail[len(end_of_turn):]
  return plain_ids(tokenizer(tail, add_special_tokens=False)["input_ids"])
