"""Reward functions for the GRPO tests (python reward terms import them by "module:attr")."""

from __future__ import annotations


def letter_share(prompt, completion: str) -> float:  # noqa: ARG001 - the prompt does not matter here
    """A dense reward a random tiny model already varies on: the share of the completion's characters that are 'e'."""
    return completion.count("e") / (len(completion) + 1)


def signal_on_even_answers(prompt, completion: str) -> float:
    """No signal (a constant) for prompts whose answer is odd; ``letter_share`` for the others."""
    if int(prompt.answer) % 2:
        return 0.5
    return letter_share(prompt, completion)


def constant_half(prompt, completion: str) -> float:  # noqa: ARG001
    return 0.5
