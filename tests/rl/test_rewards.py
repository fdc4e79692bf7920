"""RL rewards: verifier terms equal the eval verifiers, weighted sums by hand, and a reward function that
raises, hangs, dies or returns garbage costs that sample's term a counted 0, never the run."""

from __future__ import annotations

import random
import time

import pytest
import torch

from posttrain.config.loader import ConfigError, load_config
from posttrain.data.records import RLPrompt, user
from posttrain.eval.items import EvalItem
from posttrain.eval.verifiers import verify
from posttrain.rl.rewards import RewardConfig, RewardFunction, RewardTerm
from posttrain.tasks.emit import rl_prompts

FNS = "tests.rl.reward_fns"


def python_term(attr: str, **extra) -> dict:
    return {"kind": "python", "function": f"{FNS}:{attr}", **extra}


def rewards(terms: list[dict], prompts, completions, **config):
    with RewardFunction(RewardConfig.model_validate({"terms": terms, **config})) as function:
        return function.score(prompts, completions), function.workers_replaced


def sum_prompt(a: int, b: int) -> RLPrompt:
    return RLPrompt(prompt=[user(f"What is {a} + {b}?")], answer=str(a + b), verifier="numeric")


# --- verifier terms ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built_in():
    """Built-in RL prompts of all three verifier kinds; each answered right (its answer key) and wrong."""
    prompts = rl_prompts(30, seed=3)
    assert {p.verifier for p in prompts} == {"exact", "numeric", "ifeval"}
    samples = [(p, p.answer) for p in prompts] + [(p, "no idea, sorry") for p in prompts]
    return [p for p, _ in samples], [c for _, c in samples]


def test_verifier_rewards_match_the_eval_verifiers(built_in):
    prompts, completions = built_in
    batch, _ = rewards([{"kind": "verifier"}], prompts, completions, workers=2)
    expected = [verify(EvalItem.from_rl_prompt(p), c) for p, c in zip(prompts, completions, strict=True)]
    assert batch.rewards == batch.terms["verifier"] == [r.score for r in expected]
    assert batch.passed == [r.passed for r in expected]
    n = len(prompts) // 2
    assert batch.rewards[:n] == [1.0] * n and all(batch.passed[:n])  # an answer key passes its own verifier
    assert not any(batch.passed[n:]) and max(batch.rewards[n:]) < 1.0
    assert not batch.failures


def test_rewards_do_not_depend_on_workers_or_order(built_in):
    prompts, completions = built_in
    terms = [{"kind": "verifier", "weight": 0.7}, python_term("length", weight=0.01)]
    inline, _ = rewards(terms, prompts, completions, workers=0)
    pooled, _ = rewards(terms, prompts, completions, workers=2)
    order = list(range(len(prompts)))
    random.Random(0).shuffle(order)
    shuffled, _ = rewards(terms, [prompts[i] for i in order], [completions[i] for i in order], workers=1)
    assert inline.rewards == pooled.rewards == [shuffled.rewards[order.index(i)] for i in range(len(prompts))]
    assert inline.passed == pooled.passed


def test_weighted_sum_by_hand():
    prompts = [sum_prompt(2, 3), sum_prompt(2, 3), sum_prompt(10, 4)]
    completions = ["5", "The answer is 6", "The answer is 14"]
    terms = [
        {"kind": "verifier", "weight": 2.0},
        {"kind": "verifier", "verifier": "exact", "weight": 1.0, "name": "strict"},
        python_term("length", weight=-0.5, name="len"),
        python_term("words_in_prompt", weight=0.25),  # "What is 2 + 3?": 5 words
    ]
    batch, _ = rewards(terms, prompts, completions, workers=2)
    assert batch.terms == {
        "verifier": [1.0, 0.0, 1.0],
        "strict": [1.0, 0.0, 0.0],
        "len": [1.0, 15.0, 16.0],
        f"{FNS}:words_in_prompt": [5.0, 5.0, 5.0],
    }
    assert batch.rewards == pytest.approx([2 + 1 - 0.5 + 1.25, 0 + 0 - 7.5 + 1.25, 2 + 0 - 8 + 1.25])
    assert batch.passed == [True, False, False]  # every verifier term must pass
    without_verifier, _ = rewards([python_term("length")], prompts, completions, workers=0)
    assert without_verifier.passed == [None, None, None] and without_verifier.rewards == [1.0, 15.0, 16.0]


# --- failing reward functions ----------------------------------------------------------------------


def test_a_raising_reward_scores_zero_and_is_counted():
    prompts = [sum_prompt(1, 1)] * 4
    completions = ["2", "bad", "2", "bad"]
    terms = [{"kind": "verifier"}, python_term("raises_on_bad", name="py"),
             python_term("calls_sys_exit", weight=0.0, name="exits")]
    batch, replaced = rewards(terms, prompts, completions)
    assert batch.terms["py"] == [1.0, 0.0, 1.0, 0.0]
    assert batch.terms["verifier"] == [1.0, 0.0, 1.0, 0.0]  # "bad" is no number; the other term keeps its value
    assert batch.rewards == [2.0, 0.0, 2.0, 0.0]
    assert batch.failures == {"error: ValueError": 2, "error: SystemExit": 4}
    assert batch.reasons["py"] == [None, "error: ValueError", None, "error: ValueError"]
    assert replaced == 0  # exceptions, SystemExit included, are caught inside the worker
    inline, _ = rewards(terms[1:2], prompts, completions, workers=0)
    assert inline.rewards == [1.0, 0.0, 1.0, 0.0] and inline.failures == {"error: ValueError": 2}


@pytest.mark.parametrize("workers", [1, 2])
def test_a_hanging_reward_times_out_and_later_items_are_scored(workers):
    timeout_s = 0.5
    config = RewardConfig.model_validate({"terms": [python_term("hangs_on_hang")], "timeout_s": timeout_s,
                                          "workers": workers})
    prompts = [sum_prompt(1, 2)] * 8
    completions = ["3", "hang", "3", "3", "3", "3", "3", "3"]
    with RewardFunction(config) as function:
        function.score(prompts[:2], ["3", "3"])  # the workers are up: the clock below measures the timeout only
        start = time.monotonic()
        batch = function.score(prompts, completions)
        elapsed = time.monotonic() - start
        assert batch.rewards == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
        assert batch.failures == {"timeout": 1} and batch.reasons[f"{FNS}:hangs_on_hang"][1] == "timeout"
        assert timeout_s <= elapsed < timeout_s + 4.0
        assert function.workers_replaced == 1
        again = function.score(prompts[:3], ["3", "3", "3"])  # the replaced worker serves the next step
        assert again.rewards == [1.0, 1.0, 1.0] and not again.failures


def test_a_reward_that_kills_its_process_scores_zero_and_the_pool_goes_on():
    prompts = [sum_prompt(2, 2)] * 6
    completions = ["4", "exit", "4", "kill", "4", "4"]
    batch, replaced = rewards([python_term("exits_on_exit", name="py")], prompts, completions, workers=1)
    assert batch.rewards == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    assert batch.failures == {"crashed": 2} and replaced == 2
    assert batch.reasons["py"] == [None, "crashed", None, "crashed", None, None]


def test_non_finite_and_non_numeric_values_score_zero():
    prompts = [sum_prompt(0, 1)] * 4
    batch, _ = rewards([python_term("odd_values")], prompts, ["nan", "inf", "text", "fine"], workers=2)
    assert batch.rewards == [0.0, 0.0, 0.0, 0.5]
    assert batch.failures == {"non-finite": 2, "not a number: str": 1}


def test_a_prompt_without_a_verifier_is_counted_and_check_prompts_names_it():
    loose = RLPrompt(prompt=[user("Say hi.")])
    config = RewardConfig()
    with RewardFunction(config) as function:
        batch = function.score([loose, sum_prompt(1, 1)], ["hi", "2"])
        assert batch.rewards == [0.0, 1.0] and batch.failures == {"bad prompt: ValueError": 1}
        with pytest.raises(ValueError, match=f"RL prompt {loose.id}: .*names no verifier"):
            function.check_prompts([sum_prompt(1, 1), loose])
        bad_key = RLPrompt(prompt=[user("What is 1 + 1?")], answer="two", verifier="numeric")
        with pytest.raises(ValueError, match="`answer`: numeric verifier: answer 'two' is not a number"):
            function.check_prompts([bad_key])
        function.check_prompts([sum_prompt(1, 1)])


def test_code_items_run_in_their_sandbox_from_this_process():
    prompt = RLPrompt(prompt=[user("Write add(a, b).")], verifier="code",
                      tests="assert add(2, 3) == 5\nassert add(-1, 1) == 0")
    right = "```python\ndef add(a, b):\n    return a + b\n```"
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    config = {"code": {"allow_unsandboxed": True, "timeout_s": 20}}  # the sandbox is used wherever it works
    batch, _ = rewards([{"kind": "verifier"}], [prompt, prompt, sum_prompt(1, 1)], [right, wrong, "2"], **config)
    assert batch.rewards == [1.0, 0.0, 1.0] and batch.passed == [True, False, True]
    assert not batch.failures


# --- reward model --------------------------------------------------------------------------------


def test_reward_model_term_reads_the_model_and_adds_with_weights(tiny_reward_model):
    prompts = [sum_prompt(1, 2), sum_prompt(1, 2), sum_prompt(3, 4)]
    completions = ["3", "a much longer wrong answer: 4", "7"]
    terms = [{"kind": "reward_model", "path": tiny_reward_model, "weight": 0.5, "batch_size": 2},
             {"kind": "verifier", "weight": 1.0}]
    with RewardFunction(RewardConfig.model_validate({"terms": terms})) as function:
        batch = function.score(prompts, completions)
        scorer = function._scorers["reward_model"]
        expected = []
        for prompt, completion in zip(prompts, completions, strict=True):
            ids = torch.tensor([scorer.encode(prompt.prompt, completion)])
            with torch.no_grad():  # HF's own forward on the unpadded chat, read at its last token
                expected.append(scorer.root.lm(input_ids=ids).logits[0, 0].item())
    assert batch.terms["reward_model"] == pytest.approx(expected, abs=1e-5)
    assert len(set(batch.terms["reward_model"])) == 3
    assert batch.rewards == pytest.approx([0.5 * expected[0] + 1, 0.5 * expected[1], 0.5 * expected[2] + 1], abs=1e-5)
    assert batch.passed == [True, False, True]


# --- config --------------------------------------------------------------------------------------


def test_default_config_is_one_verifier_term():
    config = RewardConfig()
    assert [(t.kind, t.weight, t.verifier, t.label) for t in config.terms] == [("verifier", 1.0, None, "verifier")]
    assert config.workers == 2 and config.timeout_s > 0


@pytest.mark.parametrize(("data", "message"), [
    ({"terms": [{"kind": "reward_model"}]}, "a reward_model term needs `path`"),
    ({"terms": [{"kind": "verifier", "path": "rm/"}]}, "`path` applies to reward_model terms only"),
    ({"terms": [{"kind": "python"}]}, 'a python term needs `function: "module:attr"`'),
    ({"terms": [{"kind": "python", "function": "no_colon"}]}, '`function` must read "module:attr" or "path/to/file.py:attr"'),
    ({"terms": [{"kind": "python", "function": "rewards.py"}]}, '`function` must read "module:attr"'),
    ({"terms": [{"kind": "verifier", "verifier": "numerc"}]}, "did you mean `numeric`"),
    ({"terms": [{"kind": "verifier", "weigth": 2}]}, "`terms.0.weigth`: unknown key; did you mean `terms.0.weight`"),
    ({"terms": [{"weight": float("nan")}]}, "must be a finite number"),
    ({"terms": [{}, {"weight": 2}]}, "two terms are labelled 'verifier'; give each its own `name`"),
    ({"terms": []}, "at least 1 item"),
    ({"workers": -1}, "greater than or equal to 0"),
    ({"code": {"allow_unsandbox": True}}, "did you mean `code.allow_unsandboxed`"),
])
def test_config_errors_say_what_to_fix(data, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        load_config(RewardConfig, data=data)


@pytest.mark.parametrize(("function", "message"), [
    ("tests.rl.no_such_module:f", "cannot import 'tests.rl.no_such_module'"),
    (f"{FNS}:missing", "has no attribute 'missing'"),
    (f"{FNS}:NOT_CALLABLE", "is not callable"),
])
def test_a_python_term_that_cannot_load_fails_when_the_function_is_built(function, message):
    with pytest.raises(ValueError, match=message):
        RewardFunction(RewardConfig(terms=[RewardTerm(kind="python", function=function)], workers=0))


def test_a_python_term_can_name_a_file_and_pool_workers_load_it_too(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative file is taken from the working directory, in the workers as here
    (tmp_path / "my_rewards.py").write_text("from dataclasses import dataclass\n\n"
                                            "@dataclass\nclass Weight:\n    per_char: float = 0.5\n\n"
                                            "def scaled_length(prompt, completion):\n"
                                            "    return Weight().per_char * len(completion)\n")
    term = {"kind": "python", "function": "my_rewards.py:scaled_length"}
    for workers in (0, 1):
        batch, _ = rewards([term], [sum_prompt(1, 1)] * 2, ["abcd", "ab"], workers=workers)
        assert batch.rewards == [2.0, 1.0] and not batch.failures
    assert RewardTerm(**term).label == "my_rewards.py:scaled_length"


@pytest.mark.parametrize(("function", "message"), [
    ("not_there.py:f", "not_there.py: no such file under"),
    ("syntax.py:f", "cannot import syntax.py (SyntaxError: "),
    ("ok.py:scroe", "ok.py has no attribute 'scroe'; did you mean 'score'?"),
    ("no_such_pkg.rewards:f", 'PYTHONPATH, or name the file: "path/to/rewards.py:f"'),
])
def test_a_reward_that_cannot_load_is_a_setup_error_the_cli_reports_as_bad_input(tmp_path, monkeypatch, function,
                                                                                 message):
    from posttrain.cli import is_bad_input
    from posttrain.rl.rewards import RewardSetupError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "syntax.py").write_text("def f(:\n")
    (tmp_path / "ok.py").write_text("def score(prompt, completion):\n    return 1.0\n")
    with pytest.raises(RewardSetupError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")
                       .replace("?", r"\?")) as caught:
        RewardFunction(RewardConfig(terms=[RewardTerm(kind="python", function=function)], workers=0))
    assert is_bad_input(caught.value)
