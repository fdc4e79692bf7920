"""Exit codes keep their promise: bad input exits 2 with one line, a bug exits 1 with one line, and only
``posttrain --debug`` prints a traceback."""

from __future__ import annotations

import gzip
import importlib
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

import posttrain.eval.cli
from posttrain.cli import BAD_INPUT_ERRORS, main

CHAT = {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]}


def write_lines(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def sft(tiny_model_dir, tmp_path, data, *extra) -> list[str]:
    return ["sft", "--config", "sft_tiny", f"model.path={tiny_model_dir}", f"data.train={data}",
            f"output_dir={tmp_path / 'run'}", "train.max_steps=2", "train.save_every=100", "train.warmup_steps=0",
            "data.curriculum=none", *extra]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("posttrain")]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def test_rl_prompts_given_to_sft_stop_with_reasons_format_and_how_to_convert(tiny_model_dir, tmp_path, capsys):
    # sft_tiny quarantines by default: every record went to quarantine, then "ValueError: the training set is empty".
    data = write_lines(tmp_path / "prompts.jsonl", [{"prompt": f"What is {i}+1?", "answer": str(i + 1)} for i in range(5)])
    assert main(sft(tiny_model_dir, tmp_path, data)) == 2
    line = one_line_error(capsys)
    assert "the training set is empty: all 5 records read were quarantined" in line
    assert "wrong record kind: 5" in line and "Detected format: rl (5)" in line and "posttrain sample" in line


def test_chat_pairs_given_to_dpo_stop_the_same_way(tiny_model_dir, tmp_path, capsys):
    data = write_lines(tmp_path / "chats.jsonl", [CHAT] * 4)
    argv = ["dpo", "--config", "dpo_tiny", f"model.path={tiny_model_dir}", f"data.train={data}", "data.eval=null",
            f"output_dir={tmp_path / 'run'}", "train.max_steps=2"]
    assert main(argv) == 2
    line = one_line_error(capsys)
    assert "the training set is empty" in line and "Detected format: messages (4)" in line


@pytest.mark.parametrize(("command", "config", "what"), [("dpo", "dpo_tiny", "training set"),
                                                         ("rm", "rm_tiny", "training set"),
                                                         ("grpo", "grpo_tiny", "prompt set")])
def test_wrong_kind_data_stops_before_any_run_state_or_model_load(command, config, what, tiny_model_dir, tmp_path,
                                                                 capsys):
    """Chats given to DPO, RM or GRPO: the start's look at the data (``peek_data``) refuses them before the run's
    directory, lock or config.yaml exist, and before any weight is read."""
    data = write_lines(tmp_path / "chats.jsonl", [CHAT] * 4)
    out = tmp_path / "run"
    argv = [command, "--config", config, f"model.path={tiny_model_dir}", f"data.train={data}", "data.eval=null",
            f"output_dir={out}", "train.max_steps=2"]
    assert main(argv) == 2
    line = one_line_error(capsys)
    assert f"the {what} is empty" in line and "Detected format: messages (4)" in line
    assert not out.exists()  # nothing written: no directory, lock, config.yaml or quarantine file


def test_an_assistant_first_chat_is_quarantined_and_sft_trains_on_the_rest(tiny_model_dir, tmp_path, capsys):
    opener = {"messages": [{"role": "assistant", "content": "Hello!"}, *CHAT["messages"]]}
    data = write_lines(tmp_path / "train.jsonl", [CHAT, opener, CHAT, CHAT])
    assert main(sft(tiny_model_dir, tmp_path, data)) == 0
    entry = json.loads((tmp_path / "run" / "quarantine.jsonl").read_text())
    assert entry["line"] == 2 and "starts with an assistant turn" in entry["reason"]


def test_a_batch_that_does_not_split_is_exit_2(tiny_model_dir, tmp_path, capsys):
    data = write_lines(tmp_path / "train.jsonl", [CHAT] * 8)
    assert main(sft(tiny_model_dir, tmp_path, data, "train.global_batch_size=8", "train.batch_size=3")) == 2
    assert "not a whole number of micro-batches of train.batch_size=3" in one_line_error(capsys)


def test_a_truncated_gz_is_exit_2(tmp_path, capsys):
    whole = gzip.compress(("".join(json.dumps(CHAT) + "\n" for _ in range(300))).encode())
    path = tmp_path / "train.jsonl.gz"
    path.write_bytes(whole[: len(whole) // 2])
    assert main(["data", "inspect", str(path)]) == 2
    assert f"{path}: the gzip-compressed file is truncated or corrupt" in one_line_error(capsys)


def _crashing_compare(monkeypatch):
    """`eval compare` with a bug inside: the handler of `main` is what is under test."""
    def broken(args):
        raise KeyError("summary")
    monkeypatch.setattr(posttrain.eval.cli, "_compare", broken)


def test_an_unexpected_error_is_one_line_and_exit_1(monkeypatch, capsys):
    _crashing_compare(monkeypatch)
    assert main(["eval", "compare", "a.json", "b.json"]) == 1
    assert one_line_error(capsys) == ("posttrain: internal error: KeyError: 'summary' (rerun with --debug for the "
                                      "traceback)")


def test_debug_shows_the_traceback_and_keeps_the_exit_code(monkeypatch, capsys):
    _crashing_compare(monkeypatch)
    assert main(["--debug", "eval", "compare", "a.json", "b.json"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "in broken" in err and "KeyError: 'summary'" in err
    assert main(["--debug", "data", "inspect", "missing.jsonl"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "posttrain: missing.jsonl: no such file or directory" in err


def test_every_named_bad_input_error_exists_where_the_cli_looks_for_it():
    # The CLI recognises these without importing them; a renamed or moved class must fail here.
    for module, name in BAD_INPUT_ERRORS:
        error = getattr(importlib.import_module(module), name)
        assert isinstance(error, type) and issubclass(error, Exception), (module, name)


def test_help_documents_debug(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "--debug" in out and "traceback" in out and "internal error" in out


def test_a_missing_model_directory_is_one_line_before_any_run_state(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = write_lines(tmp_path / "train.jsonl", [CHAT] * 4)
    assert main(sft("runs/demo/base-model", tmp_path, data)) == 2  # two slashes: a path, never a hub id
    line = one_line_error(capsys)
    assert "runs/demo/base-model: not an HF model directory (no such directory under" in line
    assert "posttrain model tiny runs/demo/base-model" in line
    assert not (tmp_path / "run").exists()  # refused before the output directory was made
    (tmp_path / "empty").mkdir()
    assert main(sft(str(tmp_path / "empty"), tmp_path, data)) == 2
    assert "(no config.json in it)" in one_line_error(capsys)


def test_a_name_that_is_no_directory_and_no_reachable_hub_model_is_one_line(tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # the same failure as no network
    monkeypatch.chdir(tmp_path)
    data = write_lines(tmp_path / "train.jsonl", [CHAT] * 4)
    assert main(sft("runs/base", tmp_path, data)) == 2  # a relative path of one slash, mistyped, or an org/name
    line = one_line_error(capsys)
    assert line.startswith("posttrain: runs/base: no such directory under")
    assert "loading it as a Hugging Face hub id failed" in line


# --- a hub id without a network -------------------------------------------------------------------


def offline_hub_env(tmp_path) -> dict[str, str]:
    """A process that believes it is online, with the hub at a closed local port (no traffic leaves the machine)
    and an empty cache of its own."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HF_HOME")}
    env.update({"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf-home"), "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false"})
    return env


def test_a_hub_id_without_a_network_fails_in_seconds_and_writes_nothing(tmp_path):
    data = write_lines(tmp_path / "train.jsonl", [CHAT] * 4)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "posttrain", *sft("some-org/some-model", tmp_path, data)],
                          cwd=tmp_path, env=offline_hub_env(tmp_path), capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert elapsed <= 10, f"{elapsed:.1f} s"
    assert "Retrying" not in proc.stderr and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("posttrain: some-org/some-model: no such directory under"), lines
    assert "cannot connect to http://127.0.0.1:9" in lines[0] and "not in the local Hugging Face cache" in lines[0]
    assert not (tmp_path / "run").exists()  # no config.yaml, no lock, no directory


def test_a_cached_hub_model_trains_offline_without_retries(tiny_model_dir, tmp_path):
    # The hub cache's layout (models--ORG--NAME/snapshots/REV, refs/main): what `hf download` leaves behind.
    env = offline_hub_env(tmp_path)
    repo = tmp_path / "hf-home" / "hub" / "models--some-org--tiny-chat"
    shutil.copytree(tiny_model_dir, repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    data = write_lines(tmp_path / "train.jsonl", [CHAT] * 4)
    proc = subprocess.run([sys.executable, "-m", "posttrain", *sft("some-org/tiny-chat", tmp_path, data)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Retrying" not in proc.stderr and "thrown while requesting" not in proc.stderr
    said = [line for line in proc.stderr.splitlines() if "cannot connect" in line]
    assert len(said) == 1 and "the cached copy" in said[0], said
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


# --- user errors that used to read as internal errors ----------------------------------------------


def grpo(tiny_model_dir, tmp_path, data, *extra) -> list[str]:
    return ["grpo", "--config", "grpo_tiny", f"model.path={tiny_model_dir}", f"data.train={data}",
            f"output_dir={tmp_path / 'run'}", "train.max_steps=1", "train.global_batch_size=2", "train.batch_size=4",
            "rl.group_size=2", "rl.max_new_tokens=4", "reward.workers=0", "metrics.tensorboard=false", *extra]


def python_reward(function: str) -> str:
    return 'reward.terms=[{"kind": "python", "function": "' + function + '"}]'


RL_PROMPTS = [{"prompt": "What is 2+2?", "answer": "4", "verifier": "numeric"}] * 4


@pytest.mark.parametrize(("function", "expected"), [
    ("no_such_reward_module:score", ["cannot import 'no_such_reward_module'", "PYTHONPATH", ".py:score"]),
    ("missing/rewards.py:score", ["missing/rewards.py: no such file under", ".py:FUNCTION"]),
    ("broken.py:score", ["cannot import broken.py", "ModuleNotFoundError", "no_such_dependency"]),
    ("rewards.py:scroe", ["rewards.py has no attribute 'scroe'"]),
])
def test_a_reward_function_that_cannot_load_is_one_line_exit_2(tiny_model_dir, tmp_path, capsys, monkeypatch,
                                                                function, expected):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards.py").write_text("def score(prompt, completion):\n    return 1.0\n")
    (tmp_path / "broken.py").write_text("import no_such_dependency\n")
    data = write_lines(tmp_path / "prompts.jsonl", RL_PROMPTS)
    assert main(grpo(tiny_model_dir, tmp_path, data, python_reward(function))) == 2
    line = one_line_error(capsys)
    assert line.startswith(f"posttrain: reward function '{function}': ")
    for text in expected:
        assert text in line, line
    assert not (tmp_path / "run" / "final").exists()


def test_a_reward_function_from_a_file_trains(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards.py").write_text("def brevity(prompt, completion):\n    return -len(completion) / 10\n")
    data = write_lines(tmp_path / "prompts.jsonl", RL_PROMPTS)
    assert main(grpo(tiny_model_dir, tmp_path, data, python_reward("my_rewards.py:brevity"))) == 0
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics and all(record["reward_mean"] <= 0 for record in metrics if "reward_mean" in record)
    assert not [key for record in metrics for key in record if key.startswith("reward_failure/")]  # it ran


def test_rl_prompts_without_a_verifier_under_a_verifier_reward_are_one_line_exit_2(tiny_model_dir, tmp_path, capsys):
    data = write_lines(tmp_path / "prompts.jsonl", [{"prompt": f"Tell a story about {i}."} for i in range(4)])
    assert main(grpo(tiny_model_dir, tmp_path, data)) == 2
    line = one_line_error(capsys)
    assert "names no verifier" in line and "reward term 'verifier'" in line
    assert "reward.terms" in line and "posttrain data tasks rl" in line  # the two fixes


def test_updates_per_rollout_that_do_not_split_the_step_are_one_line_exit_2(tiny_model_dir, tmp_path, capsys):
    data = write_lines(tmp_path / "prompts.jsonl", RL_PROMPTS)
    # 2 prompts × 2 completions in micro-batches of 2: 2 micro-batches per step, not 3 updates' worth
    assert main(grpo(tiny_model_dir, tmp_path, data, "train.batch_size=2", "rl.updates_per_rollout=3")) == 2
    line = one_line_error(capsys)
    assert "do not split into rl.updates_per_rollout=3 updates" in line and "train.batch_size" in line


@pytest.mark.parametrize("command", [["validate", "--config", "sft_tiny"], ["recipes", "list"], ["--help"]])
def test_a_closed_stdout_pipe_is_exit_0_without_a_traceback(command):
    # `posttrain validate … | head`: the reader leaves before the output is written.
    reader, writer = os.pipe()
    os.close(reader)
    try:
        proc = subprocess.run([sys.executable, "-m", "posttrain", *command], stdout=writer,
                              stderr=subprocess.PIPE, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        os.close(writer)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


@pytest.mark.parametrize(("flag", "message"), [
    (["--top-p", "2"], "top_p must be in (0, 1] (got 2.0)"),
    (["--temperature", "-1"], "temperature must be >= 0 (got -1.0)"),
    (["--n", "0"], "n must be >= 1 (got 0)"),
    (["--max-new-tokens", "0"], "max_new_tokens must be >= 1 (got 0)"),
    (["--batch-size", "0"], "batch_size must be >= 1 (got 0)"),
])
def test_sampling_flags_out_of_range_are_exit_2(tiny_model_dir, tmp_path, capsys, flag, message):
    prompts = write_lines(tmp_path / "prompts.jsonl", [{"prompt": "Hi"}])
    assert main(["generate", "--model", tiny_model_dir, "--prompts", prompts, "-o", str(tmp_path / "out.jsonl"),
                 *flag]) == 2
    err = capsys.readouterr().err  # `generate` may first say which prompt format it used
    errors = [line for line in err.splitlines() if line.startswith("posttrain: ")]
    assert "Traceback" not in err and len(errors) == 1 and message in errors[0], err


def test_a_model_without_a_chat_template_is_exit_2(tiny_model_dir, tmp_path, capsys):
    model = tmp_path / "base"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    data = write_lines(tmp_path / "train.jsonl", [CHAT] * 4)
    assert main(sft(str(model), tmp_path, data)) == 2
    line = one_line_error(capsys)
    assert "the tokenizer has no chat template" in line and "chat_template" in line


def test_data_that_cannot_fill_one_step_is_exit_2(tiny_model_dir, tmp_path, capsys):
    data = write_lines(tmp_path / "train.jsonl", [CHAT] * 4)
    assert main(sft(tiny_model_dir, tmp_path, data, "train.max_steps=null", "train.epochs=1",
                    "train.global_batch_size=8")) == 2
    assert "the data cannot fill one optimizer step" in one_line_error(capsys)


def test_writing_records_to_an_unsupported_suffix_is_exit_2(tmp_path, capsys):
    assert main(["data", "tasks", "rl", str(tmp_path / "prompts.txt"), "-n", "4"]) == 2
    assert "prompts.txt: cannot write '.txt'; use .jsonl or .parquet" in one_line_error(capsys)


def rm(tiny_model_dir, tmp_path, data, *extra) -> list[str]:
    return ["rm", "--config", "rm_tiny", f"model.path={tiny_model_dir}", f"data.train={data}",
            f"output_dir={tmp_path / 'run'}", "train.max_steps=2", "train.warmup_steps=0",
            "metrics.tensorboard=false", *extra]


def pairs(n: int) -> list[dict]:
    return [{"prompt": f"What is {i}+1?", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(n)]


def test_reward_model_data_problems_are_exit_2(tiny_model_dir, tmp_path, capsys):
    data = write_lines(tmp_path / "pairs.jsonl", pairs(8))
    assert main(rm(tiny_model_dir, tmp_path, data, "rm.holdout_fraction=0.5", "rm.score_margin=true")) == 2
    assert "rm.score_margin needs chosen_score and rejected_score on every pair" in one_line_error(capsys)
    assert main(rm(tiny_model_dir, tmp_path, data, "rm.holdout_fraction=0.001")) == 2
    line = one_line_error(capsys)
    assert "no pair fell in the held-out split" in line and "rm.holdout_fraction" in line and "data.eval" in line


def test_sampling_with_a_verifier_scorer_refuses_prompts_without_a_key_before_sampling(tiny_model_dir, tmp_path,
                                                                                       capsys):
    prompts = write_lines(tmp_path / "prompts.jsonl", [{"prompt": "What is 2+2?", "answer": "4", "verifier": "numeric"},
                                                       {"prompt": "Tell a story."}])
    argv = ["sample", "--config", "sample", f"data.input={prompts}", f"policy.path={tiny_model_dir}",
            "policy.backend=hf", f"output_dir={tmp_path / 'out'}", "scorer.kind=verifier", "sampling.max_new_tokens=4"]
    assert main(argv) == 2
    line = one_line_error(capsys)
    assert "scorer.kind=verifier, but 1 of 2 prompts have no verifier and answer key" in line
    assert "line 2" in line and "scorer.kind=auto" in line
    assert not (tmp_path / "out" / "candidates.jsonl").exists()  # nothing was sampled
