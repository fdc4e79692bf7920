"""The vLLM rollout engine's plumbing, against a stdlib stand-in for vLLM's server (``fake_vllm_server.py``), so
it runs in seconds: config checks, finding the engine's Python, start (health check with a deadline, warm-up,
engine.log) and stop, the client's requests, weight files in checkpoint names (LoRA merged), restart once then
exit 75 (a GRPO run through it: tests/rl/test_grpo_engine_failures.py). The real engine's numbers (greedy
equality, log-prob agreement after a sync) are tested in tests/rl/test_vllm_engine.py."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

from posttrain.config.loader import ConfigError, load_config
from posttrain.config.rl import GRPORecipe
from posttrain.generate.engine import SamplingParams
from posttrain.generate.vllm_server import (
    EngineSetupError,
    EngineUnavailable,
    VLLMClient,
    VLLMServer,
    engine_python,
)
from tests.rl.conftest import grpo_overrides

FAKE = Path(__file__).with_name("fake_vllm_server.py")


def fake_engine_python(directory: Path) -> str:
    """An 'engine Python' that runs the stand-in server with whatever arguments VLLMServer passes."""
    script = directory / "engine-python"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    script.chmod(0o755)
    return str(script)


@pytest.fixture
def fake_python(tmp_path) -> str:
    return fake_engine_python(tmp_path)


def _server(model: str, python: str, tmp_path: Path, **kwargs) -> VLLMServer:
    return VLLMServer(model, python=python, log_path=tmp_path / "engine.log", max_model_len=96, **kwargs)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# ------------------------------------------------------------------ config


@pytest.mark.parametrize(("extra", "message"), [
    ({"rollout.server_url": "http://127.0.0.1:8000"}, "rollout.server_url is for rollout.engine=vllm"),
    ({"rollout.engine": "vllm", "rollout.server_url": "127.0.0.1:8000"}, "must be http://HOST:PORT"),
    ({"rollout.engine": "vllm", "rollout.server_url": "http://127.0.0.1:8000", "rollout.engine_python": "/bin/python"},
     "connects to a server you started yourself"),
    ({"rollout.engine": "vllm", "model.lora": '{"quantize": "4bit"}'}, "cannot be merged"),
    ({"rollout.engin": "vllm"}, "rollout.engine"),
    ({"rollout.sync_every": 0}, "sync_every"),
    ({"rollout.overlap": "false"}, "rollout.overlap is for rollout.engine=vllm"),
    ({"rollout.sync_method": "broadcast"}, "rollout.sync_method is for rollout.engine=vllm"),
    ({"rollout.engine": "vllm", "rollout.sync_method": "nccl"}, "sync_method"),
    ({"rollout.engine": "vllm", "rollout.sync_method": "broadcast", "rollout.sync_dir": "/tmp/w"}, "writes no file"),
    ({"rollout.engine": "vllm", "rollout.sync_backend": "nccl"}, "sync_backend is for rollout.sync_method=broadcast"),
])
def test_rollout_config_fails_loudly(extra, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        load_config(GRPORecipe, "grpo_tiny", grpo_overrides("m", "d.jsonl", tmp_path, **extra))


def test_rollout_defaults_to_hf(tmp_path):
    config = load_config(GRPORecipe, "grpo_tiny", grpo_overrides("m", "d.jsonl", tmp_path))
    assert config.rollout.engine == "hf" and config.rollout.sync_every == 1


def test_engine_python_is_found_or_the_error_says_how_to_install(monkeypatch, tmp_path, fake_python):
    monkeypatch.delenv("POSTTRAIN_VLLM_PYTHON", raising=False)
    assert engine_python(fake_python) == fake_python
    monkeypatch.setenv("POSTTRAIN_VLLM_PYTHON", fake_python)
    assert engine_python() == fake_python
    with pytest.raises(EngineSetupError, match="make vllm-env"):
        engine_python(str(tmp_path / "missing"))
    monkeypatch.delenv("POSTTRAIN_VLLM_PYTHON")
    monkeypatch.setattr("posttrain.generate.vllm_server.default_venv_python", lambda: tmp_path / "none" / "python")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(EngineSetupError, match="make vllm-env"):
        engine_python()


# ------------------------------------------------------------------ the server process and the client


def test_server_starts_answers_and_stops(tiny_model_dir, tiny_tokenizer, fake_python, tmp_path):
    server = _server(tiny_model_dir, fake_python, tmp_path).start()
    try:
        pid = server.process.pid
        log = (tmp_path / "engine.log").read_text()
        assert "vllm.entrypoints.openai.api_server" in log and "--logprobs-mode processed_logprobs" in log
        assert "--generation-config vllm" in log and "--enforce-eager" in log
        client = VLLMClient(server.url, tiny_tokenizer)
        params = SamplingParams(n=3, temperature=1.0, max_new_tokens=5, seed=7, logprobs=True)
        prompts = ["Hi", "What is 2 plus 2?", "Sort 3, 1, 2"]
        first = client.generate(prompts, params, seed_keys=[10, 11, 12])
        assert [len(group) for group in first] == [3, 3, 3]
        for completion in first[0]:
            assert len(completion.token_ids) == 5 and len(completion.logprobs) == 5
            assert completion.finish_reason == "length"
        assert len({tuple(c.token_ids) for c in first[0]}) == 3  # the n samples of a prompt differ
        # A prompt's samples depend on its key, not on which other prompts share the call.
        alone = client.generate(prompts[1:2], params, seed_keys=[11])
        assert [c.token_ids for c in alone[0]] == [c.token_ids for c in first[1]]
        with pytest.raises(ValueError, match="top_p=1"):
            client.generate(prompts, SamplingParams(top_p=0.9, logprobs=True))
    finally:
        server.stop()
    assert server.process is None and _gone(pid)


def test_a_server_that_dies_while_starting_reports_its_log(tiny_model_dir, fake_python, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL_START", "1")
    with pytest.raises(EngineSetupError, match="(?s)exited with code 3 while starting.*failing at start as asked"):
        _server(tiny_model_dir, fake_python, tmp_path).start()


def test_a_server_that_never_answers_hits_the_deadline(tiny_model_dir, tmp_path):
    sleeper = tmp_path / "sleepy-python"
    sleeper.write_text("#!/bin/sh\nexec sleep 60\n")
    sleeper.chmod(0o755)
    started = time.monotonic()
    with pytest.raises(EngineSetupError, match="did not answer /health within rollout.start_timeout_s=2"):
        _server(tiny_model_dir, str(sleeper), tmp_path, start_timeout_s=2).start()
    assert time.monotonic() - started < 30


# ------------------------------------------------------------------ weights


def test_merge_lora_is_w_plus_scaled_ba():
    from posttrain.rl.weight_sync import merge_lora

    torch.manual_seed(0)
    w, a, b = torch.randn(4, 3), torch.randn(2, 3), torch.randn(4, 2)
    state = {"base_model.model.layer.q.base_layer.weight": w, "base_model.model.layer.q.lora_A.default.weight": a,
             "base_model.model.layer.q.lora_B.default.weight": b, "base_model.model.norm.weight": torch.ones(3)}
    merged = merge_lora(state, {"layer.q": (0.5, False)})
    assert set(merged) == {"layer.q.weight", "norm.weight"}
    torch.testing.assert_close(merged["layer.q.weight"], w + 0.5 * b @ a)
    with pytest.raises(ValueError, match="cannot merge"):
        merge_lora({**state, "base_model.model.layer.q.lora_magnitude_vector.default": torch.ones(4)},
                   {"layer.q": (0.5, False)})


def _policy(model_dir: str, lora: bool = False):
    from posttrain.models.load import load_model, load_tokenizer
    from posttrain.models.logprobs import TokenLogprobModel

    lm = load_model(model_dir, "float32")
    if lora:
        from posttrain.config.sections import LoraConfig
        from posttrain.models.lora import apply_lora

        lm = apply_lora(lm, LoraConfig(r=4, alpha=8.0))
    return TokenLogprobModel(lm, 64), lm, load_tokenizer(model_dir)


def test_sync_writes_checkpoint_named_weights_lora_merged(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from posttrain.rl.weight_sync import PolicyWeights, WeightWriter

    reference = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    root, lm, _ = _policy(tiny_model_dir)
    state, gathered = PolicyWeights(root, lm).gather()
    assert set(state) == set(reference) and gathered > 0
    writer = WeightWriter(tmp_path / "sync", "float32")
    size = writer.write(state)
    written = load_file(str(writer.directory / "model.safetensors"))
    assert size == (writer.directory / "model.safetensors").stat().st_size
    assert all(torch.equal(written[k], reference[k]) for k in reference)
    writer.clear()
    assert not (writer.directory / "model.safetensors").exists()
    writer.close()

    root, lm, _ = _policy(tiny_model_dir, lora=True)
    layer = lm.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        layer.lora_B["default"].weight.fill_(0.01)  # a trained adapter: B is no longer 0
    weights = PolicyWeights(root, lm)
    first, _ = weights.gather()
    second, adapters_only = weights.gather()  # the base comes from the cache: only the adapters are gathered
    assert set(first) == set(reference) and adapters_only < gathered / 4
    expected = reference["model.layers.0.self_attn.q_proj.weight"] + layer.scaling["default"] * (
        layer.lora_B["default"].weight @ layer.lora_A["default"].weight).detach()
    for state in (first, second):
        torch.testing.assert_close(state["model.layers.0.self_attn.q_proj.weight"], expected)
        torch.testing.assert_close(state["model.layers.1.mlp.up_proj.weight"], reference["model.layers.1.mlp.up_proj.weight"])


def _rollouts(model_dir: str, python: str, tmp_path: Path, **kwargs):
    from posttrain.rl.engines import VLLMRollouts

    root, lm, tokenizer = _policy(model_dir)
    server = _server(model_dir, python, tmp_path, weight_extension=kwargs.get("sync_method") == "broadcast").start()
    engine = VLLMRollouts(root, lm, tokenizer, url=server.url, server=server, sync_base=tmp_path / "sync", **kwargs)
    return engine, root


@pytest.mark.parametrize("sync_method", ["file", "broadcast"])
def test_engine_syncs_when_the_version_moves_and_restarts_once(tiny_model_dir, fake_python, tmp_path, monkeypatch,
                                                               sync_method):
    reloads = tmp_path / "reloads.txt"
    monkeypatch.setenv("FAKE_VLLM_RELOADS", str(reloads))
    monkeypatch.setenv("FAKE_VLLM_STARTS", str(tmp_path / "starts.txt"))
    # start 1 dies at its 6th completion request (the warm-up is the 1st), start 2 at its 5th
    monkeypatch.setenv("FAKE_VLLM_DIE_AFTER", "6,5")
    engine, root = _rollouts(tiny_model_dir, fake_python, tmp_path, sync_every=2, sync_method=sync_method)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=4)
    try:
        out = engine.sample(["Hi", "Sort 3, 1, 2"], params, [0, 1], version=0)
        assert [len(g) for g in out] == [2, 2] and all(len(r.logprobs) == 4 for g in out for r in g)
        assert engine.log["rollout/sync_bytes"] > 0 and engine.log["rollout/engine_lag"] == 0
        assert len(reloads.read_text().splitlines()) == 1  # the first call syncs
        engine.sample(["Hi"], params, [0], version=1)  # one step on, sync_every=2: no sync, lag 1
        assert "rollout/sync_s" not in engine.log and engine.log["rollout/engine_lag"] == 1
        assert len(reloads.read_text().splitlines()) == 1
        engine.sample(["Hi"], params, [0], version=2)
        assert len(reloads.read_text().splitlines()) == 2 and engine.log["rollout/engine_lag"] == 0
        first_pid = engine.server.process.pid
        # the 6th request kills start 1: the engine restarts, re-syncs and answers the same call
        again = engine.sample(["Hi", "Sort 3, 1, 2"], params, [0, 1], version=2)
        assert [len(g) for g in again] == [2, 2]
        assert engine.restarts == 1 and engine.log["rollout/engine_restarts"] == 1
        assert len(reloads.read_text().splitlines()) == 3 and _gone(first_pid)
        assert (tmp_path / "engine.log").read_text().count("==== posttrain: starting the engine") == 2
        engine.sample(["Hi"], params, [0], version=2)
        with pytest.raises(EngineUnavailable, match="restarted 1 time"):  # start 2 dies too: no second restart
            engine.sample(["Hi"], params, [0], version=2)
    finally:
        engine.close()


def test_broadcast_delivers_the_checkpoint_tensors_in_the_engines_dtype(tiny_model_dir, fake_python, tmp_path,
                                                                         monkeypatch):
    """What the engine's worker receives is what the file method writes: checkpoint names, the engine's dtype, a
    tied head once; ``sync_bytes`` counts it. Small buckets: several tensors per bucket, and buckets of one."""
    import json

    from posttrain.rl.weight_sync import PolicyWeights, engine_tensors

    received = tmp_path / "received.jsonl"
    monkeypatch.setenv("FAKE_VLLM_RECEIVED", str(received))
    engine, root = _rollouts(tiny_model_dir, fake_python, tmp_path, sync_method="broadcast", dtype="bfloat16")
    try:
        engine.broadcaster.bucket_bytes = 4096
        for version in (0, 1):
            engine.sync(version)
        expected = engine_tensors(PolicyWeights(root, engine.weights.lm).gather()[0], torch.bfloat16)
        got = [json.loads(line) for line in received.read_text().splitlines()]
        assert len(got) == 2 and engine.broadcaster.connects == 1 and engine.broadcaster.backend == "gloo"
        assert list(got[1]) == list(expected)
        for name, tensor in expected.items():
            dtype, shape, total = got[1][name]
            assert (dtype, shape) == ("bfloat16", list(tensor.shape))
            assert total == pytest.approx(float(tensor.double().sum()), rel=1e-9, abs=1e-9)
        assert engine.log["rollout/sync_bytes"] == sum(t.numel() * t.element_size() for t in expected.values())
    finally:
        engine.close()


def test_a_trainer_whose_engine_joined_another_group_sets_up_a_new_one(tiny_model_dir, fake_python, tmp_path):
    """Two trainers on one engine (rollout.server_url): each sync finds the engine in the other's group and joins
    its own again, rather than fail or restart it."""
    from posttrain.rl.engines import VLLMRollouts

    root, lm, tokenizer = _policy(tiny_model_dir)
    server = _server(tiny_model_dir, fake_python, tmp_path, weight_extension=True).start()
    first, second = (VLLMRollouts(root, lm, tokenizer, url=server.url, sync_method="broadcast") for _ in range(2))
    try:
        first.sync(0)
        second.sync(0)
        first.sync(1)
        assert first.broadcaster.connects == 2 and second.broadcaster.connects == 1 and first.restarts == 0
    finally:
        first.close(), second.close()
        server.stop()


def test_an_engine_that_dies_in_a_broadcast_is_restarted_and_regrouped(tiny_model_dir, fake_python, tmp_path,
                                                                        monkeypatch):
    reloads = tmp_path / "reloads.txt"
    monkeypatch.setenv("FAKE_VLLM_RELOADS", str(reloads))
    monkeypatch.setenv("FAKE_VLLM_STARTS", str(tmp_path / "starts.txt"))
    monkeypatch.setenv("FAKE_VLLM_DIE_IN_RECEIVE", "2")  # start 1 dies in its 2nd receive, before any tensor
    engine, _ = _rollouts(tiny_model_dir, fake_python, tmp_path, sync_method="broadcast", timeout_s=60)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=4)
    try:
        engine.sample(["Hi"], params, [0], version=0)
        started = time.monotonic()
        out = engine.sample(["Hi"], params, [0], version=1)  # dies in the sync: restart, new group, sync, sample
        assert time.monotonic() - started < 30  # the broadcast to a dead worker fails, it does not wait out a timeout
        assert [len(g) for g in out] == [2] and engine.restarts == 1 and engine.synced == 1
        assert engine.broadcaster.connects == 2 and len(reloads.read_text().splitlines()) == 2
    finally:
        engine.close()


def test_broadcast_to_a_server_without_the_extension_says_how_to_start_it(tiny_model_dir, fake_python, tmp_path):
    from posttrain.rl.engines import VLLMRollouts

    root, lm, tokenizer = _policy(tiny_model_dir)
    server = _server(tiny_model_dir, fake_python, tmp_path).start()  # started as a user would, without it
    engine = VLLMRollouts(root, lm, tokenizer, url=server.url, sync_method="broadcast")  # rollout.server_url
    try:
        with pytest.raises(EngineUnavailable, match="worker-extension-cls posttrain_vllm_ext.WeightReceiver"):
            engine.sample(["Hi"], SamplingParams(n=1, temperature=1.0, max_new_tokens=2), [0], version=0)
        # a GRPO run finds out at setup (exit 2), before any step
        from posttrain.rl.engines import rollout_engine

        config = load_config(GRPORecipe, "grpo_tiny", grpo_overrides(
            tiny_model_dir, "d.jsonl", tmp_path / "run", **{"rollout.engine": "vllm", "rollout.server_url": server.url,
                                                              "rollout.sync_method": "broadcast"}))
        with pytest.raises(EngineSetupError, match="python -m posttrain.generate.vllm_worker_ext DIR"):
            rollout_engine(config, root, lm, tokenizer)
    finally:
        engine.close()
        server.stop()


def test_the_worker_extension_is_standalone_and_installs_alone(tmp_path):
    """The engine's Python has no posttrain: the extension imports only the standard library and torch."""
    import ast
    import subprocess

    from posttrain.generate import vllm_worker_ext

    tree = ast.parse(Path(vllm_worker_ext.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"__future__", "collections", "datetime", "json", "math", "os", "shutil", "socket", "sys",
                        "typing", "torch"}
    done = subprocess.run([sys.executable, "-m", "posttrain.generate.vllm_worker_ext", str(tmp_path / "ext")],
                          capture_output=True, text=True, check=True)
    assert "--worker-extension-cls posttrain_vllm_ext.WeightReceiver" in done.stdout
    assert [p.name for p in (tmp_path / "ext").iterdir()] == ["posttrain_vllm_ext.py"]


def test_engine_unavailable_is_exit_75():
    from posttrain.cli import report_failure

    assert report_failure(EngineUnavailable("the rollout engine died"), debug=False) == 75
    assert report_failure(EngineSetupError("no engine"), debug=False) == 2


def test_a_reply_cut_short_is_the_engine_down_not_a_crash():
    """A server that dies while answering (CI saw it: one thread of the engine sent the headers, another exited the
    process) leaves ``IncompleteRead``; that must be ``EngineDown`` so the engine restarts, like a refused connection."""
    import socketserver
    import threading

    from posttrain.generate.vllm_server import EngineDown, request_json

    class CutShort(socketserver.BaseRequestHandler):
        def handle(self):
            self.request.recv(65536)
            self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 456\r\n\r\n{\"id\"")

    class NoStatusLine(socketserver.BaseRequestHandler):
        def handle(self):
            self.request.recv(65536)
            self.request.sendall(b"garbage\r\n\r\n")

    for handler, message in ((CutShort, "cut short .IncompleteRead"), (NoStatusLine, "cut short .BadStatusLine")):
        with socketserver.TCPServer(("127.0.0.1", 0), handler) as server:
            threading.Thread(target=server.handle_request, daemon=True).start()
            with pytest.raises(EngineDown, match=message):
                request_json(f"http://127.0.0.1:{server.server_address[1]}/v1/completions", {"prompt": "Hi"}, timeout=10)


def test_generate_and_eval_sample_on_an_engine_they_start_and_stop(tiny_model_dir, fake_python, tmp_path, monkeypatch,
                                                                   capsys):
    """``posttrain generate`` / ``eval --backend vllm``: an engine started for the command (its pid gone after),
    seeded requests (same seed, same samples), results in the usual files; ``--engine-url`` reuses a running one."""
    import json

    from posttrain.cli import main
    from tests.eval.test_eval_cli import SUITE_ROWS

    starts = tmp_path / "starts.txt"
    monkeypatch.setenv("FAKE_VLLM_STARTS", str(starts))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hi\nSort 3, 1, 2\n")
    vllm = ["--backend", "vllm", "--engine-python", fake_python, "--max-new-tokens", "6", "--quiet"]
    outputs = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}.jsonl"
        assert main(["generate", "--model", tiny_model_dir, "--prompts", str(prompts), "-o", str(out), "--n", "2",
                     *vllm]) == 0
        outputs.append([json.loads(line) for line in out.read_text().splitlines()])
    assert [row["id"] for row in outputs[0]] == ["1", "2"]
    assert all(c["num_tokens"] == 6 and c["finish_reason"] == "length" for row in outputs[0] for c in row["completions"])
    assert outputs[0] == outputs[1]  # seeded: the same samples from a fresh engine
    pids = [int(line) for line in starts.read_text().splitlines()]
    assert len(pids) == 2 and all(_gone(pid) for pid in pids)
    assert "starting a vLLM engine" in capsys.readouterr().err

    suite = tmp_path / "suite.jsonl"
    suite.write_text("".join(json.dumps(row) + "\n" for row in SUITE_ROWS[:4]))
    server = _server(tiny_model_dir, fake_python, tmp_path).start()
    try:
        result = tmp_path / "eval.json"
        assert main(["eval", "--model", tiny_model_dir, "--suite", str(suite), "-o", str(result), "--n-boot", "50",
                     "--backend", "vllm", "--engine-url", server.url, "--max-new-tokens", "4", "--quiet"]) == 0
        scored = json.loads(result.read_text())
        assert scored["counts"]["items"] == 4 and all(row["output"] is not None for row in scored["items"])
        assert server.process is not None and server.process.poll() is None  # a server we did not start stays up
    finally:
        server.stop()
    assert len(starts.read_text().splitlines()) == 3

    # posttrain sample with policy.backend=vllm: the engine Python from the environment, stopped at the end
    monkeypatch.setenv("POSTTRAIN_VLLM_PYTHON", fake_python)
    asks = tmp_path / "asks.jsonl"
    asks.write_text("".join(json.dumps({"prompt": row["prompt"], "answer": row["answer"], "verifier": "numeric"}) + "\n"
                            for row in SUITE_ROWS[:3]))
    out = tmp_path / "sampled"
    assert main(["sample", "--config", "sample", f"data.input={asks}", f"policy.path={tiny_model_dir}",
                 "policy.backend=vllm", f"output_dir={out}", "scorer.kind=verifier", "sampling.max_new_tokens=4",
                 "sampling.n=2", "progress=false"]) == 0
    candidates = [json.loads(line) for line in (out / "candidates.jsonl").read_text().splitlines()]
    assert len(candidates) == 3 and all(len(c["candidates"]) == 2 and c["scores"] == [0.0, 0.0] for c in candidates)
    pids = [int(line) for line in starts.read_text().splitlines()]
    assert len(pids) == 4 and all(_gone(pid) for pid in pids)
