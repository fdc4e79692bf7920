"""The rollout engine of online RL, chosen in one place (``rollout_engine``); the loop never knows which.

Both engines turn ``(prompts, SamplingParams, prompt keys, policy version)`` into the same ``Rollout``
records (``posttrain.rl.rollout.to_rollouts``): the sampled token ids, the behaviour log-probs of each token
(``log softmax(logits / T)`` in float32 at sampling time) and the finish reason.

- ``HFRollouts`` (``rollout.engine: hf``): the trainer's own sampler on its live weights (under FSDP2 gathered
  once per rollout phase, ``posttrain.rl.rollout.sample_rollouts``). Nothing to sync; bit-reproducible.
- ``VLLMRollouts`` (``rollout.engine: vllm``): a vLLM server (``posttrain.generate.vllm_server``) that
  posttrain starts on rank 0 — or one the user runs (``rollout.server_url``) — fed the trainer's weights
  (``posttrain.rl.weight_sync``: a file it reloads; ``rollout.sync_method: broadcast``: over a collective,
  ``posttrain.rl.weight_broadcast``) before it samples for a newer policy version: at the first call, and then
  whenever ``version`` moved ``rollout.sync_every`` steps past the synced one, or back (a rollback or resume).
  Every rank sends its own prompts to the one engine; a sync is a collective (gather on rank 0, reload,
  broadcast of the outcome) so no rank samples before the engine serves the new weights.

**Engine failure.** A request that finds the engine dead (connection refused, HTTP 5xx, the process gone)
fails the call on every rank (one all-reduce); posttrain then restarts the engine it started, once per run,
re-syncs the weights and repeats the call. A second failure — or any failure of a server posttrain did not
start — raises ``EngineUnavailable``, which the CLI turns into exit 75: the newest checkpoint is intact and
rerunning the same command resumes from it (steps after it are sampled again).

**Sampling in the background** (``submit``). ``sample`` is ``submit(...).result()``. The vLLM engine's
``submit`` syncs (a collective, in the calling thread) and sends the requests from a background thread, so the
trainer can train while the engine samples (``GRPOSource`` does, with ``rl.max_staleness >= 1``);
``result()`` waits, and handles an engine failure — restart, re-sync, resample — collectively there, so no
collective ever runs outside the main thread. The HF engine samples in the trainer's process with its live
weights: its ``submit`` samples at once (``overlaps = False``).

**Policy versions.** Each rollout's ``version`` is the version of the weights that sampled it: the one asked
for on the HF engine; the one the engine last synced on vLLM (older than asked when ``rollout.sync_every > 1``).

Figures (``log``, merged into the step's metrics by the step source): ``rollout/sync_s`` (gather, then write and
reload or broadcast), ``rollout/sync_bytes`` (the file the engine read, or the bytes broadcast),
``rollout/sync_gathered_bytes`` (what left the shards: the adapters only after the first LoRA sync),
``rollout/engine_lag`` (policy versions between the weights the engine sampled with and the version asked for; 0
with ``sync_every: 1``) and ``rollout/engine_restarts``."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import torch

from posttrain import dist
from posttrain.data.chat import Prompt
from posttrain.generate.engine import SamplingParams
from posttrain.rl.rollout import Rollout, sample_rollouts, to_rollouts

__all__ = ["EngineJob", "HFRollouts", "RolloutEngine", "RolloutFn", "Sampled", "VLLMRollouts", "rollout_engine"]


class Sampled(Protocol):
    """Rollouts on their way (``RolloutEngine.submit``)."""

    seconds: float  # how long the sampling itself took, once ``result()`` returned

    def result(self) -> list[list[Rollout]]:
        """The rollouts, waiting for them if need be. A collective (every rank calls it at the same point)."""
        ...


class RolloutEngine(Protocol):
    log: dict[str, Any]
    overlaps: bool  # whether submit returns before the sampling is done (training can go on meanwhile)

    def submit(self, prompts: Sequence[Prompt], params: SamplingParams, prompt_keys: Sequence[int],
               version: int) -> Sampled:
        """Start sampling ``params.n`` rollouts per prompt with the policy of ``version`` (the loop step whose
        starting weights the trainer holds now). A collective: every rank calls it, with its own prompts."""
        ...

    def sample(self, prompts: Sequence[Prompt], params: SamplingParams, prompt_keys: Sequence[int],
               version: int) -> list[list[Rollout]]:
        """``submit(...).result()``."""
        ...

    def close(self) -> None: ...


class Ready:
    """``Sampled`` for rollouts sampled already (``seconds``: how long that took)."""

    def __init__(self, rollouts: list[list[Rollout]], seconds: float):
        self.rollouts, self.seconds = rollouts, seconds

    def result(self) -> list[list[Rollout]]:
        return self.rollouts


class HFRollouts:
    """``rollout.engine: hf``: the trainer's own sampler on its live weights (so it cannot sample while they train)."""

    overlaps = False

    def __init__(self, root: torch.nn.Module, lm: torch.nn.Module, tokenizer: Any, batch_size: int):
        self.root, self.lm, self.tokenizer, self.batch_size = root, lm, tokenizer, batch_size
        self.log: dict[str, Any] = {}

    def submit(self, prompts: Sequence[Prompt], params: SamplingParams, prompt_keys: Sequence[int],
               version: int) -> Ready:
        started = time.perf_counter()
        groups = sample_rollouts(self.root, self.lm, self.tokenizer, list(prompts), params,
                                 batch_size=self.batch_size, prompt_keys=prompt_keys)
        for rollout in (r for group in groups for r in group):
            rollout.version = version  # the live weights are the version's
        return Ready(groups, time.perf_counter() - started)

    def sample(self, prompts: Sequence[Prompt], params: SamplingParams, prompt_keys: Sequence[int],
               version: int) -> list[list[Rollout]]:
        return self.submit(prompts, params, prompt_keys, version).result()

    def close(self) -> None:
        pass


def _any_rank(flag: bool) -> bool:
    if dist.world_size() == 1:
        return flag
    return bool(dist.all_reduce_sum(torch.tensor([float(flag)], dtype=torch.float64)).item() > 0)


# A sampling job for the engine: given its client, the rollouts (in prompt order) and the seconds they took. It runs
# in the background thread, so it never runs a collective; it may run twice (after an engine restart).
EngineJob = Callable[[Any], tuple[list[list[Rollout]], float]]


class _Requests:
    """``Sampled`` for a job a background thread is running against the vLLM engine (``VLLMRollouts.submit``)."""

    def __init__(self, engine: VLLMRollouts, job: EngineJob, version: int, future: Future | None,
                 failure: str | None):
        self.engine, self.job, self.version = engine, job, version
        self.future, self.failure = future, failure
        self.seconds = 0.0
        self._rollouts: list[list[Rollout]] | None = None

    def result(self) -> list[list[Rollout]]:
        if self._rollouts is None:
            self._rollouts = self.engine._finish(self)
        return self._rollouts


class VLLMRollouts:
    """``rollout.engine: vllm`` (see the module docstring). ``server`` is the ``VLLMServer`` posttrain started
    (rank 0 only; ``None`` when connecting to ``url``); ``sync_method``: ``file`` (under ``sync_base``) or
    ``broadcast`` (``posttrain.rl.weight_broadcast``, over ``sync_backend``)."""

    overlaps = True

    def __init__(self, root: torch.nn.Module, lm: torch.nn.Module, tokenizer: Any, *, url: str, server=None,
                 sync_every: int = 1, sync_base: str | Path | None = None, dtype: str = "float32",
                 timeout_s: float = 600.0, max_restarts: int = 1, sync_method: str = "file",
                 sync_backend: str = "auto"):
        from posttrain.generate.vllm_server import VLLMClient
        from posttrain.rl.weight_broadcast import WeightBroadcaster
        from posttrain.rl.weight_sync import DTYPES, PolicyWeights, WeightWriter

        self.root, self.tokenizer, self.server = root, tokenizer, server
        self.sync_every, self.max_restarts = sync_every, max_restarts
        self.client = VLLMClient(url, tokenizer, lm, timeout_s=timeout_s)
        self.weights = PolicyWeights(root, lm)
        self.sync_method, self.dtype = sync_method, DTYPES[dtype]
        self.writer = WeightWriter(sync_base, dtype) if dist.is_main() and sync_method == "file" else None
        self.broadcaster = (WeightBroadcaster(self.client, dtype, backend=sync_backend, timeout_s=timeout_s)
                            if dist.is_main() and sync_method == "broadcast" else None)
        self.synced: int | None = None  # the policy version the engine serves (None: not synced yet)
        self.restarts = 0
        self.log: dict[str, Any] = {}
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="posttrain-rollouts")

    # ------------------------------------------------------------------ sync

    def _due(self, version: int) -> bool:
        return self.synced is None or version < self.synced or version - self.synced >= self.sync_every

    def sync(self, version: int) -> None:
        """Push the trainer's current weights to the engine as ``version`` (a file it reloads, or a broadcast).
        A collective; raises ``EngineDown`` on every rank when the engine failed on rank 0 during the reload."""
        from posttrain.generate.vllm_server import EngineDown
        from posttrain.rl.weight_sync import engine_tensors

        started = time.perf_counter()
        state, gathered = self.weights.gather()
        outcome: Any = None
        if dist.is_main():
            try:
                if self.broadcaster is not None:
                    size = self.broadcaster.send(engine_tensors(state, self.dtype))
                else:
                    size = self.writer.write(state)
                    self.client.reload_weights(self.writer.directory)
                outcome = {"bytes": size}
            except EngineDown as exc:
                outcome = {"down": str(exc)}
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                outcome = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                if self.writer is not None:
                    self.writer.clear()
                del state
        outcome = dist.broadcast_object(outcome)
        if "down" in outcome:
            raise EngineDown(outcome["down"])
        if "error" in outcome:
            raise RuntimeError(f"weight sync failed: {outcome['error']}")
        self.synced = version
        self.log.update({"rollout/sync_s": time.perf_counter() - started, "rollout/sync_bytes": outcome["bytes"],
                         "rollout/sync_gathered_bytes": gathered})

    # ------------------------------------------------------------------ sampling

    def submit(self, prompts: Sequence[Prompt], params: SamplingParams, prompt_keys: Sequence[int],
               version: int) -> _Requests:
        """Sync when due (a collective, here), then send the requests from the background thread."""
        if params.greedy:
            raise ValueError("rollouts need sampling (temperature > 0): greedy decoding has no sampling distribution "
                             "for the policy ratio")
        params = SamplingParams(**{**params.__dict__, "logprobs": True})
        prompts = list(prompts)

        def job(client) -> tuple[list[list[Rollout]], float]:
            started = time.perf_counter()
            completions = client.generate(prompts, params, seed_keys=prompt_keys) if prompts else []
            groups = to_rollouts(self.tokenizer, prompts, completions, params.temperature, prompt_keys)
            return groups, time.perf_counter() - started

        return self.submit_job(job, version)

    def submit_job(self, job: EngineJob, version: int) -> _Requests:
        """Sync when due (a collective, here), then run ``job`` from the background thread: the one path of
        single-turn sampling (``submit``) and of multi-turn episodes (``posttrain.rl.multiturn.EngineEpisodes``)."""
        from posttrain.generate.vllm_server import EngineDown

        self.log = {}
        failure, future = None, None
        try:
            if self._due(version):
                self.sync(version)
        except EngineDown as exc:
            failure = str(exc)
        if failure is None:
            future = self._sender.submit(job, self.client)
        return _Requests(self, job, version, future, failure)

    def sample(self, prompts: Sequence[Prompt], params: SamplingParams, prompt_keys: Sequence[int],
               version: int) -> list[list[Rollout]]:
        return self.submit(prompts, params, prompt_keys, version).result()

    def _finish(self, requests: _Requests) -> list[list[Rollout]]:
        """Wait for ``requests``; on an engine failure on any rank, restart it (collectively), re-sync, run the job
        again."""
        from posttrain.generate.vllm_server import EngineDown

        failure, groups, seconds = requests.failure, [], 0.0
        if failure is None and requests.future is not None:
            try:
                groups, seconds = requests.future.result()
            except EngineDown as exc:
                failure = str(exc)
        while _any_rank(failure is not None):
            self._restart(failure or "the engine failed on another rank")
            failure, groups = None, []
            try:
                if self._due(requests.version):
                    self.sync(requests.version)
                groups, seconds = requests.job(self.client)
            except EngineDown as exc:
                failure = str(exc)
        served = self.synced if self.synced is not None else requests.version
        self.log["rollout/engine_lag"] = requests.version - served
        self.log["rollout/engine_restarts"] = self.restarts
        requests.seconds = seconds
        for rollout in (r for group in groups for r in group):
            rollout.version = served
        return groups

    def _restart(self, why: str) -> None:
        """Restart the engine posttrain started (once per run; every rank calls this), else ``EngineUnavailable``."""
        from posttrain.generate.vllm_server import EngineUnavailable

        managed = dist.broadcast_object(self.server is not None)
        if not managed or self.restarts >= self.max_restarts:
            log = f"; its log: {self.server.log_path}" if self.server is not None else ""
            what = (f"restarted {self.restarts} time(s) and failed again" if managed
                    else f"at rollout.server_url={self.client.url} failed (a server posttrain did not start is not "
                    "restarted)")
            raise EngineUnavailable(f"the rollout engine {what}: {why[:300]}{log}")
        self.restarts += 1
        url = None
        if self.server is not None:
            from posttrain.train.runner import say

            say(f"rollout engine failed ({why[:200]}); restarting it (restart {self.restarts} of {self.max_restarts})")
            try:
                self.server.start()
                url = self.server.url
            except Exception as exc:  # noqa: BLE001 - every rank must hear of it
                url = f"error: {exc}"
        url = dist.broadcast_object(url)
        if url is None or url.startswith("error: "):
            raise EngineUnavailable(f"the rollout engine failed ({why[:200]}) and did not restart: {url}")
        self.client.url = url
        self.synced = None  # a fresh engine holds the weights of model.path
        if self.broadcaster is not None:
            self.broadcaster.close()  # the fresh engine joins a new weight group at the next sync

    def close(self) -> None:
        self._sender.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            self.server.stop()
        if self.writer is not None:
            self.writer.close()
        if self.broadcaster is not None:
            self.broadcaster.shutdown()


class RolloutFn:
    """What ``GRPOSource`` calls to sample: ``fn(prompts, keys, seed, version)`` with ``RLPrompt``s; ``fn.log``
    holds the engine's figures of the last call (the step source adds them to the step's metrics)."""

    def __init__(self, engine: RolloutEngine, params: SamplingParams):
        self.engine, self.params = engine, params

    def __call__(self, prompts: Sequence[Any], keys: Sequence[int], seed: int, version: int = 0) -> list[list[Rollout]]:
        return self.submit(prompts, keys, seed, version).result()

    def submit(self, prompts: Sequence[Any], keys: Sequence[int], seed: int, version: int = 0) -> Sampled:
        params = SamplingParams(**{**self.params.__dict__, "seed": seed})
        return self.engine.submit([p.prompt for p in prompts], params, keys, version)

    @property
    def overlaps(self) -> bool:
        return self.engine.overlaps

    @property
    def log(self) -> dict[str, Any]:
        return self.engine.log


def rollout_engine(config, root: torch.nn.Module, lm: torch.nn.Module, tokenizer: Any) -> RolloutEngine:
    """The one place the rollout engine is chosen, from ``config.rollout`` (a GRPO recipe). A collective for
    vllm: rank 0 starts the server (or checks ``rollout.server_url``) and every rank learns its address."""
    rollout = config.rollout
    if rollout.engine == "hf":
        return HFRollouts(root, lm, tokenizer, config.rl.rollout_batch_size)
    from posttrain.generate.vllm_server import EngineSetupError, VLLMServer, engine_python
    from posttrain.rl.weight_sync import default_sync_base
    from posttrain.store.run_store import working_dir
    from posttrain.train.runner import say

    work = working_dir(config.output_dir, config.store.local_dir)
    dtype = config.model.dtype if rollout.dtype == "auto" else rollout.dtype
    server, url, problem = None, rollout.server_url, None
    if dist.is_main():
        try:
            if url is None:
                server = VLLMServer(config.model.path, python=engine_python(rollout.engine_python),
                                    log_path=work / "engine.log", dtype=dtype, max_model_len=config.train.max_length,
                                    seed=config.train.seed, eager=rollout.eager, chunked_prefill=rollout.chunked_prefill,
                                    cpu_kv_cache_gib=rollout.cpu_kv_cache_gib, extra_args=rollout.engine_args,
                                    start_timeout_s=rollout.start_timeout_s,
                                    weight_extension=rollout.sync_method == "broadcast")
                started = time.perf_counter()
                say(f"starting the vLLM rollout engine ({server.python}); its log: {server.log_path}")
                server.start()
                url = server.url
                say(f"vLLM rollout engine up at {url} in {time.perf_counter() - started:.0f} s")
            else:
                from posttrain.generate.vllm_server import VLLMClient

                if not VLLMClient(url, tokenizer).healthy():
                    raise EngineSetupError(f"rollout.server_url={url} does not answer /health")
                if rollout.sync_method == "broadcast":
                    from posttrain.rl.weight_broadcast import check_extension

                    check_extension(url)
        except EngineSetupError as exc:
            problem = str(exc)
    problem, url = dist.broadcast_object((problem, url))
    if problem is not None:
        raise EngineSetupError(problem)
    params = sum(p.numel() * p.element_size() for p in lm.parameters())
    base = None
    if rollout.sync_method == "file":
        base = Path(rollout.sync_dir) if rollout.sync_dir else default_sync_base(params, work)
    return VLLMRollouts(root, lm, tokenizer, url=url, server=server, sync_every=rollout.sync_every, sync_base=base,
                        dtype=dtype, timeout_s=rollout.request_timeout_s, sync_method=rollout.sync_method,
                        sync_backend=rollout.sync_backend)
