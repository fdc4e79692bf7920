"""The two small processes the rendered pods run: the exit-code wrapper (PyTorchJob) and the rendezvous store
(the coordinator), the latter driven by torchrun with the rendezvous flags `posttrain k8s render` writes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from posttrain.k8s.options import RenderOptions
from posttrain.k8s.render import launch_command, resolve
from posttrain.serve.pg_local import free_port

PY = sys.executable


def _wrapped(code: str) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "posttrain.k8s.retryable", "--", PY, "-c", code], stderr=subprocess.PIPE)


def test_exit_75_becomes_retryable_138_and_other_codes_pass_through():
    assert _wrapped("raise SystemExit(75)").wait(timeout=60) == 138
    assert _wrapped("raise SystemExit(2)").wait(timeout=60) == 2
    assert _wrapped("pass").wait(timeout=60) == 0


def test_sigterm_reaches_the_command_which_saves_and_exits_75(tmp_path):
    marker = tmp_path / "saved"
    code = ("import signal, sys, time, pathlib\n"
            "def stop(s, f):\n"
            f"    pathlib.Path({str(marker)!r}).write_text('checkpoint')\n"
            "    sys.exit(75)\n"
            "signal.signal(signal.SIGTERM, stop)\n"
            "print('ready', file=sys.stderr, flush=True)\n"
            "time.sleep(60)\n")
    process = _wrapped(code)
    assert process.stderr.readline().strip() == b"ready"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 138
    assert marker.read_text() == "checkpoint"


def test_a_command_killed_by_a_signal_exits_128_plus_n():
    assert _wrapped("import os, signal; os.kill(os.getpid(), signal.SIGKILL)").wait(timeout=60) == 128 + 9


WORKER = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}"), "w") as handle:
    handle.write(f"{dist.get_world_size()} {value.item()}")
dist.destroy_process_group()
"""


def test_two_agents_rendezvous_through_the_standalone_store(tmp_path):
    """Two torchrun agents (two 'nodes'), both clients of `posttrain.k8s.store`, form one 2-rank group."""
    options = RenderOptions(config="sft_tiny", nodes=2, gpus_per_node=1, output_dir="s3://b/run",
                            image="registry.example.com/posttrain:test",
                            overrides=("model.path=s3://b/base", "data.train=s3://b/train.jsonl"))
    command = launch_command(options, "test-run", resolve(options))
    torchrun_options = command[2:command.index("--")]
    port = free_port()
    at = torchrun_options.index("--rdzv-endpoint") + 1
    assert torchrun_options[at] == "test-run-rdzv:29400"
    torchrun_options[at] = f"127.0.0.1:{port}"
    script = tmp_path / "worker.py"
    script.write_text(WORKER, encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    store = subprocess.Popen([PY, "-m", "posttrain.k8s.store", "--host", "127.0.0.1", "--port", str(port)],
                             stderr=subprocess.PIPE, env=env)
    try:
        assert b"listening" in store.stderr.readline()
        agents = [subprocess.Popen([PY, "-m", "torch.distributed.run", *torchrun_options, str(script), str(tmp_path)],
                                   env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(2)]
        codes = [agent.wait(timeout=240) for agent in agents]
        assert codes == [0, 0], [agent.stderr.read().decode()[-2000:] for agent in agents]
        assert sorted((tmp_path / f"rank{r}").read_text() for r in range(2)) == ["2 3.0", "2 3.0"]
        assert store.poll() is None  # the store outlives the agents (the next round would use it)
    finally:
        store.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while store.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if store.poll() is None:
            store.kill()
    assert store.returncode == 0
