"""Typed config sections for evaluation, for recipes that embed an ``eval:`` section (e.g. a flywheel round)."""

from __future__ import annotations

from pydantic import Field

from posttrain.config.loader import StrictModel
from posttrain.eval.sandbox import SandboxLimits


class SandboxConfig(StrictModel):
    timeout_s: float = Field(default=10.0, gt=0, description="Wall-clock limit per code run.")
    cpu_s: int = Field(default=10, ge=1, description="CPU-seconds limit per code run.")
    memory_mb: int = Field(default=1024, ge=64, description="Address-space limit per code run.")
    max_processes: int = Field(default=32, ge=1, description="Process limit (RLIMIT_NPROC) of the sandbox uid.")

    def limits(self) -> SandboxLimits:
        return SandboxLimits(timeout_s=self.timeout_s, cpu_s=self.cpu_s, memory_mb=self.memory_mb,
                             max_processes=self.max_processes)


class EvalConfig(StrictModel):
    suite: str = Field(default="flywheel", description="A registered suite name or a suite file (.jsonl/.yaml/.json).")
    n_boot: int = Field(default=1000, ge=100, description="Bootstrap replicates for the confidence intervals.")
    seed: int = 0
    chat_template: bool = Field(default=True, description="Send prompts as a user turn through the chat template.")
    allow_unsandboxed_code: bool = Field(
        default=False,
        description="Run code tasks even where the sandbox cannot isolate them (no network/file-system isolation).",
    )
    code_workers: int = Field(default=2, ge=1, description="Code tasks verified in parallel.")
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
