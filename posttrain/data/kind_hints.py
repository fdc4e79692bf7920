"""Messages for a record that is recognised but belongs to another recipe (an RL prompt given to SFT).

Each says what the record is, what the recipe that was asked for needs, and how to convert the data
or which recipe takes it as it is. ``posttrain.data.formats.convert`` raises them as ``WRONG_KIND``.
"""

from __future__ import annotations

_WHAT_IT_IS = {
    "messages": "an SFT chat (`messages`)",
    "sharegpt": "an SFT chat (ShareGPT `conversations`)",
    "alpaca": "an SFT example (Alpaca `instruction` + `output`)",
    "prompt_completion": "an SFT example (`prompt` + `completion`/`response`)",
    "preference": "a preference pair (`prompt` + `chosen` + `rejected`)",
    "preference_conversational": "a preference pair (`chosen` + `rejected` chats)",
    "hh_rlhf": "a preference pair (HH-RLHF `chosen`/`rejected` transcripts)",
    "rl": "an RL prompt ({keys}: no response to learn from)",
}
_WHAT_IT_NEEDS = {
    "sft": "SFT needs `messages` with an assistant turn, or `prompt` + `completion` (or `response`)",
    "preference": "preference training (DPO, reward model) needs `prompt` + `chosen` + `rejected`",
    "rl": "RL needs a `prompt` (text or messages) with an answer key (`answer` or `tests`) for its verifier",
}
_HOW_TO_CONVERT = {
    ("rl", "sft"): "draw responses first (`posttrain sample` keeps the best verified one as an SFT target), or use "
                   "these prompts for RL",
    ("preference", "sft"): "to fine-tune on the preferred answers, keep `prompt` + `chosen` as `prompt` + "
                           "`completion` and drop `rejected`; or train the pairs with `posttrain dpo` / `posttrain rm`",
    ("sft", "preference"): "pair each prompt with a better and a worse response (`posttrain sample` makes pairs by "
                           "rejection sampling, `posttrain feedback` from edge cases); or train this data with "
                           "`posttrain sft`",
    ("rl", "preference"): "draw and score responses with `posttrain sample`, which writes best-vs-worst pairs",
    ("sft", "rl"): "keep the turns before the last assistant reply as `prompt`, drop the response and add `answer`; "
                   "or train this data with `posttrain sft`",
    ("preference", "rl"): "keep `prompt`, drop `chosen` and `rejected` and add `answer`; or train the pairs with "
                          "`posttrain dpo`",
}


def wrong_kind_message(fmt: str, found: str, kind: str, raw: dict) -> str:
    """What a record of format ``fmt`` (a ``found`` record) is, what a ``kind`` recipe needs, and how to convert it."""
    keys = " + ".join(f"`{key}`" for key in ("prompt", "answer", "tests") if raw.get(key) is not None) or "`prompt`"
    return (f"a {found!r} record (format {fmt!r}) where {kind!r} records are expected: this is "
            f"{_WHAT_IT_IS[fmt].format(keys=keys)}; {_WHAT_IT_NEEDS[kind]}; {_HOW_TO_CONVERT[(found, kind)]}")
