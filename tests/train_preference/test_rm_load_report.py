"""What ``posttrain rm`` says when it loads a causal LM as a reward model, in a log (stderr a pipe).

transformers reports the new score head and the unused LM head as a table under a bold "LOAD REPORT"
title (raw ANSI codes outside a terminal), after a carriage-return "Loading weights" bar. A reward model
always has those two differences; the run says so in one plain line instead.
"""

from __future__ import annotations

import subprocess
import sys

from tests.train.conftest import ROOT, env
from tests.train_preference.conftest import rm_overrides


def test_a_reward_model_load_is_one_plain_line_in_a_log(pref_model_dir, pref_data, tmp_path):
    out = tmp_path / "rm"
    command = [sys.executable, "-m", "posttrain", "rm", "--config", "rm_tiny",
               *rm_overrides(pref_model_dir, {"train": pref_data["train"]}, out, **{"train.max_steps": 1})]
    proc = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, timeout=300)
    stderr = proc.stderr.decode()  # not text=True: universal newlines would turn the bars' \r into \n
    assert proc.returncode == 0, stderr[-3000:]
    assert "\x1b[" not in stderr and "\r" not in stderr
    assert "LOAD REPORT" not in stderr and "Loading weights" not in stderr
    said = [line for line in stderr.splitlines() if "score.weight" in line]
    assert said == [f"[posttrain] reward model from {pref_model_dir}: a new score head (score.weight, seeded random "
                    "init); the checkpoint's lm_head.weight is not used"]
    # Loading the exported reward model back (the scorer's path) has nothing new to say.
    probe = ("import sys; from posttrain.train.reward_model import load_reward_lm; "
             f"load_reward_lm({str(out / 'final')!r}, 'float32', 'sdpa', False, 0)")
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env(), capture_output=True, text=True,
                            timeout=120)
    assert loaded.returncode == 0 and loaded.stderr == "", loaded.stderr[-2000:]
