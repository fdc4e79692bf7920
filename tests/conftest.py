"""Shared fixtures: tiny models built on the fly (no hub), small thread counts for a 2-core CI."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

from posttrain.serve.pg_local import free_port

# Caches the code writes by default (the DPO reference log-probs under $XDG_CACHE_HOME) go to a
# directory of this test session, inherited by every subprocess, never into the user's home.
_CACHE_HOME = tempfile.mkdtemp(prefix="posttrain-test-cache-")
os.environ["XDG_CACHE_HOME"] = _CACHE_HOME
atexit.register(shutil.rmtree, _CACHE_HOME, True)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(1)

CHAT_TEXTS = [
    "What is 12 plus 30? The answer is 42.",
    "Reverse the word hello: olleh. Sort 3, 1, 2: 1, 2, 3.",
    "Which is larger, 17 or 71? 71. Write three fruits: apple, banana, cherry.",
    "Count the letters in banana: 6. Uppercase dog: DOG.",
] * 4


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A 2-layer, 64-wide Llama with a ~400-token BPE vocabulary, saved in HF format."""
    from posttrain.models.tiny import build_tiny_model

    path = tmp_path_factory.mktemp("tiny") / "model"
    return str(build_tiny_model(path, texts=CHAT_TEXTS, vocab_size=400, seed=0))


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory):
    """``tiny_moe_dir(arch)``: a 2-layer, 64-wide mixture of experts (4 experts, top-2; ``deepseek_v3``: its
    first layer dense, one shared expert) on the tiny model's vocabulary, built once per session and arch."""
    from posttrain.models.tiny import build_tiny_model

    built: dict[str, str] = {}

    def build(arch: str = "qwen3_moe") -> str:
        if arch not in built:
            path = tmp_path_factory.mktemp(f"tiny-{arch}") / "model"
            built[arch] = str(build_tiny_model(path, texts=CHAT_TEXTS, vocab_size=400, seed=0, arch=arch, experts=4,
                                               experts_per_token=2, shared_experts=int(arch == "deepseek_v3")))
        return built[arch]

    return build


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from posttrain.models.load import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_reward_model(tiny_model_dir, tmp_path_factory) -> str:
    """A random one-label sequence classifier on the tiny Llama, saved as `posttrain rm` exports one."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    config = AutoConfig.from_pretrained(tiny_model_dir, num_labels=1)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    path = tmp_path_factory.mktemp("rm") / "rm"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return str(path)



@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on 127.0.0.1 for this test session (a real HTTP S3 API, no cloud).

    The endpoint and dummy credentials are put into ``os.environ`` (``AWS_ENDPOINT_URL`` is read by
    botocore, hence s3fs), so the code under test and every subprocess it starts use this server.
    """
    import subprocess
    import sys
    import time
    import urllib.request

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError("moto's S3 server did not start") from None
            time.sleep(0.1)
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    yield endpoint
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    server.terminate()
    server.wait(timeout=10)


@pytest.fixture
def s3_bucket(s3_endpoint, request) -> str:
    """A fresh, empty bucket on the loopback S3 server; returns ``s3://<bucket>``."""
    import re
    import uuid

    import s3fs

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + "-" + uuid.uuid4().hex[:8]
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir(name)
    return f"s3://{name}"
