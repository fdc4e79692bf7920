"""Reward functions for tests/rl/test_rewards.py: importable by name, as pool workers (spawned) need."""

from __future__ import annotations

import os
import signal
import time

from posttrain.data.records import RLPrompt


def length(prompt: RLPrompt, completion: str) -> float:
    """Characters in the completion: a value the tests compute by hand."""
    return float(len(completion))


def words_in_prompt(prompt: RLPrompt, completion: str) -> int:
    """Words of the prompt's last message (an int: numbers of any real type are rewards)."""
    return len(prompt.prompt[-1].content.split())


def raises_on_bad(prompt: RLPrompt, completion: str) -> float:
    if "bad" in completion:
        raise ValueError("cannot score this one")
    return 1.0


def hangs_on_hang(prompt: RLPrompt, completion: str) -> float:
    if "hang" in completion:
        time.sleep(1000)
    return 1.0


def exits_on_exit(prompt: RLPrompt, completion: str) -> float:
    if "exit" in completion:
        os._exit(1)
    if "kill" in completion:
        os.kill(os.getpid(), signal.SIGKILL)
    return 1.0


def odd_values(prompt: RLPrompt, completion: str):
    """Returns what the completion asks for: nan, inf, a string, or 0.5."""
    return {"nan": float("nan"), "inf": float("inf"), "text": "0.5", "exit": SystemExit}.get(completion, 0.5)


def calls_sys_exit(prompt: RLPrompt, completion: str) -> float:
    raise SystemExit(3)


NOT_CALLABLE = 42
