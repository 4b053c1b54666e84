"""The ``optimizer_state`` policy: which lossy codec, if any, encodes an optimizer's moments.

* ``"exact"`` (the default): everything lossless, restored bit-exact.
* ``"bf16"``: first and second moments rounded to bfloat16.
* ``"int8"``: first moments in int8 absmax blocks, second moments in 8-bit logarithmic blocks
  (linear int8 would round small second moments to zero and blow up the Adam step).

Moments are recognised by their key path, whatever wraps the optimizer's ``state_dict()``: the
state of parameter ``<id>`` is ``...['state'][<id>]['<name>']`` in a plain torch checkpoint
(``state['optimizer']['state'][0]['exp_avg']``), in Lightning's ``optimizer_states`` list
(``state['optimizer_states'][0]['state'][0]['exp_avg']``) and in Accelerate's ``optimizers`` list
(``state['optimizers'][0]['state'][0]['exp_avg']``); ``<id>`` is an int, or a parameter's name in
state dicts keyed by name. Only float32 tensors are ever coded lossily (the encoder checks);
weights and every other key stay lossless.
"""

from __future__ import annotations

import re

POLICIES = ("exact", "bf16", "int8")
FIRST_MOMENTS = ("exp_avg",)
SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq")

_MOMENT = re.compile(
    r"\['state'\]\[(?:\d+|'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")\]\['(?P<name>\w+)'\]$"
)
_KINDS = {
    "bf16": {"first": "b16", "second": "b16"},
    "int8": {"first": "q8", "second": "l8"},
}


def moment(path: str) -> str | None:
    """``"first"`` or ``"second"`` for the key path of an optimizer's moment, else None."""
    match = _MOMENT.search(path)
    if match is None:
        return None
    name = match.group("name")
    if name in FIRST_MOMENTS:
        return "first"
    if name in SECOND_MOMENTS:
        return "second"
    return None


def codec_kind(path: str, policy: str) -> str | None:
    """The lossy codec kind ``policy`` names for the tensor at ``path``; None for lossless.

    Raises:
        ValueError: an unknown policy.
    """
    if policy not in POLICIES:
        raise ValueError(f"optimizer_state must be one of {', '.join(POLICIES)}, got {policy!r}")
    if policy == "exact":
        return None
    which = moment(path)
    return _KINDS[policy][which] if which else None
