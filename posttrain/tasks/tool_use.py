"""Tool use: arithmetic and counting a tiny model cannot do in its head but can do with one Python call.

An opt-in group (``posttrain.tasks.problem.OPT_IN_GROUPS``): never part of the default selection or of the
``flywheel`` eval suite, chosen by name (``posttrain data tasks rl out.jsonl --group tool_use``), the data of the
``grpo_tools_tiny`` recipe (docs/agentic.md). Every answer is an integer checked by the ``numeric`` verifier
(tolerance 0), and each prompt states the computation exactly, so one ``<python>print(...)</python>`` call
answers it:

- tier 1 ``multiply_large``: a product of two 4-digit numbers (``print(4821 * 7390)``);
- tier 2 ``long_sum``: a sum of eight 3-digit numbers (``print(381 + 912 + ...)``);
- tier 3 ``count_letter``: how often a letter occurs in a 32-letter string (``print('abdc...'.count('b'))``).

**Transcripts** (``tool_transcripts``): SFT examples that teach the call format before RL (a random tiny model
never writes ``<python>``, so GRPO has nothing to raise). A tool-using transcript is the episode a correct policy
has, as chat messages: the tool format's instructions as a system message (what ``episode_prompt_ids`` puts
first when the template does not render ``tools``), the question, the call, a ``tool`` message holding what the
call prints (``answer + "\n"``: stdout, as the Python tool returns it), and the answer. The chat template renders
the ``tool`` message as the same tool turn the episode loop appends (``posttrain.rl.multiturn.tool_turn``), and
SFT trains assistant turns only, so the tool's output is context, never a target (tests/rl/test_tool_transcripts.py
checks both against a real episode). A direct transcript answers at once, with no call; ``tool_share`` sets the mix.
"""

from __future__ import annotations

import random
import re

from posttrain.data.records import Message, SFTExample, assistant, user
from posttrain.tasks.problem import Problem, canonical_key, register_family, sample_problems
from posttrain.tasks.reasoning import _off_by_a_little, numeric_problem

GROUP = "tool_use"


@register_family("multiply_large", GROUP, 1, "What is 4821 * 7390? -> 35627190", _off_by_a_little)
def multiply_large(rng: random.Random) -> Problem:
    a, b = rng.randint(1000, 9999), rng.randint(1000, 9999)
    key = canonical_key("multiply_large", sorted((a, b)))
    return numeric_problem("multiply_large", 1, key, f"What is {a} * {b}?", a * b, f"{a} * {b} = {a * b}.",
                           group=GROUP)


@register_family("long_sum", GROUP, 2, "What is 381 + 912 + 275 + 640 + 118 + 953 + 407 + 726? -> 4412",
                 _off_by_a_little)
def long_sum(rng: random.Random) -> Problem:
    numbers = [rng.randint(100, 999) for _ in range(8)]
    key = canonical_key("long_sum", sorted(numbers))
    text = " + ".join(str(n) for n in numbers)
    return numeric_problem("long_sum", 2, key, f"What is {text}?", sum(numbers), f"{text} = {sum(numbers)}.",
                           group=GROUP)


@register_family("count_letter", GROUP, 3, "How many times does the letter b appear in abdcabbd...? -> 9",
                 _off_by_a_little)
def count_letter(rng: random.Random) -> Problem:
    letters = "abcd"
    text = "".join(rng.choice(letters) for _ in range(32))
    letter = rng.choice(letters)
    count = text.count(letter)
    key = canonical_key("count_letter", letter, text)
    return numeric_problem("count_letter", 3, key, f"How many times does the letter {letter} appear in {text}?",
                           count, f"The letter {letter} appears {count} times in {text}.", group=GROUP)


def tool_program(problem: Problem) -> str:
    """The one Python program that answers a ``tool_use`` problem (what a correct call runs)."""
    counting = re.fullmatch(r"How many times does the letter (\w) appear in (\w+)\?", problem.prompt)
    if problem.family == "count_letter" and counting:
        return f"print({counting.group(2)!r}.count({counting.group(1)!r}))"
    if problem.family in ("multiply_large", "long_sum") and problem.prompt.startswith("What is "):
        return f"print({problem.prompt.removeprefix('What is ').removesuffix('?')})"
    raise ValueError(f"not a tool_use problem: {problem.family} {problem.prompt!r}")


def tool_transcript(problem: Problem, instructions: str | None, use_tool: bool = True) -> SFTExample:
    """One SFT transcript (see the module docstring): ``[system(instructions)], user, assistant(<python>call</python>),
    tool(printed), assistant("Answer: <answer>")`` with ``use_tool``, else ``[system], user, assistant("Answer: <answer>")``:
    both kinds of answer start alike, so the warm start's first token is a choice between ``<python>`` (the call, with
    the transcripts' share of the probability) and ``Answer`` — greedy decoding calls the tool where the share is
    above one half, and RL can move that choice. The numeric verifier reads the number after "answer:".
    ``instructions``: the tool format's (``TOOL_FORMATS.get(name)().instructions``); ``None`` for no system message
    (a recipe with ``env.instructions: false``). ``meta.tool_call`` says which kind it is."""
    messages = [Message(role="system", content=instructions)] if instructions else []
    messages.append(user(problem.prompt))
    if use_tool:
        messages += [assistant(f"<python>{tool_program(problem)}</python>"),
                     Message(role="tool", content=problem.answer + "\n"), assistant(f"Answer: {problem.answer}")]
    else:
        messages.append(assistant(f"Answer: {problem.answer}"))
    return SFTExample(messages=messages, tier=problem.tier,
                      meta={"group": problem.group, "family": problem.family, "task_key": problem.key,
                            "tool_call": use_tool})


def tool_transcripts(n: int, seed: int, instructions: str | None, tool_share: float = 1.0,
                     tiers: tuple[int, ...] | list[int] | None = None) -> list[SFTExample]:
    """``n`` transcripts of distinct train-split problems (``tiers``: all by default), ``round(n * tool_share)`` of
    them tool-using and the rest direct answers, which ones chosen by a seeded shuffle (so the choice carries no
    signal about the problem). A share below 1 leaves RL room: the warm-started model calls the tool only
    sometimes, and a tiny model's direct answer to these problems is almost always wrong."""
    if not 0.0 <= tool_share <= 1.0:
        raise ValueError(f"tool_share must be in [0, 1], got {tool_share}")
    problems = sample_problems(n, seed, split="train", groups=[GROUP], tiers=tiers, stream="tool_transcripts")
    with_tool = set(random.Random(f"{seed}:tool_share").sample(range(n), round(n * tool_share)))
    return [tool_transcript(p, instructions, i in with_tool) for i, p in enumerate(problems)]
