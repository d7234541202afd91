"""The data section's free-form options, checked before anything loads (``checks.validate``):
the chat template's variables (``data.chat_template_kwargs``) and the raw-text frame of each
prompt (``data.prompt_format``). Each check takes the option's value and raises ``ValueError``
with the message the run stops with.
"""

from __future__ import annotations

from ppojax.data import encoding


def chat_template_kwargs(value) -> None:
  """A dict of the chat template's variables: string keys, none of the arguments ppojax sets
  itself (``encoding.template_kwargs``)."""
  if value is None:
    raise ValueError("data.chat_template_kwargs=None: give a dict of the chat template's "
                     "variables, {} for none (the default), e.g. {'enable_thinking': False}")
  encoding.template_kwargs(value)  # a DataError (a ValueError) names what is wrong


def prompt_format(fmt) -> None:
  """A str.format template whose one field is {prompt}."""
  try:
    ok = isinstance(fmt, str) and fmt.format(prompt="\0") != fmt
  except (KeyError, IndexError, ValueError) as e:
    raise ValueError(f"data.prompt_format={fmt!r} is not a str.format template whose only "
                     f"field is {{prompt}} ({type(e).__name__}: {e}); write literal braces as "
                     "{{ and }}") from None
  if not ok:
    raise ValueError(f"data.prompt_format={fmt!r} must be a string holding {{prompt}}, e.g. "
                     "'Question: {prompt}\\nAnswer:' ('{prompt}': the prompt as it is)")


OPTIONS = {"data.chat_template_kwargs": chat_template_kwargs, "data.prompt_format": prompt_format}
