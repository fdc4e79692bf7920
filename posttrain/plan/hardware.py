"""GPU presets for the planner: memory, peak bf16 dense TFLOP/s and HBM bandwidth, as the vendor publishes them.

| preset     | memory  | bf16 dense   | HBM       | source |
| ---------- | ------- | ------------ | --------- | ------ |
| ``h100``     | 80 GB   | 989 TFLOP/s  | 3.35 TB/s | NVIDIA H100 datasheet, SXM5 column (1,979 with sparsity) |
| ``h200``     | 141 GB  | 989 TFLOP/s  | 4.8 TB/s  | NVIDIA H200 datasheet, SXM column (1,979 with sparsity) |
| ``a100-80g`` | 80 GB   | 312 TFLOP/s  | 2.0 TB/s  | NVIDIA A100 datasheet, 80GB SXM column (624 with sparsity; 2,039 GB/s) |
| ``b200``     | 180 GB  | 2,250 TFLOP/s | 8 TB/s   | NVIDIA HGX B200 / DGX B200 specs: 1,440 GB and 36 PFLOP/s FP16/BF16 with sparsity for 8 GPUs |

NVIDIA quotes tensor-core FLOP/s with 2:4 sparsity; dense training gets half, which is what is listed. B200 is
taken at 180 GB, the memory of the shipping HGX/DGX B200 boards, not the 192 GB (eight 24 GB HBM3e stacks) of the
March 2024 announcement, which those boards do not expose: planning against 192 would call runs fitting that do
not (``--gpu b200 --gpu-memory 192`` plans a 192 GB part). The memory figure is read as GiB (2³⁰ B), the unit of
every figure the planner prints, because that is close to what the driver reports: nvidia-smi shows an H100 80GB
as 81,559 MiB (79.6 GiB) and an H200 as 143,771 MiB (140.4 GiB), where 10⁹-byte GB would give 74.5 and 131.3 GiB.
Peak FLOP/s matches ``posttrain.train.metrics.PEAK_FLOPS`` (H100, H200: 989; A100: 312).

HBM bandwidth is recorded with the plan for the GPU's roofline; no planner formula uses it yet (the planner has no
rollout decode-time model, where it would set the pace). It is not the network: ``--bandwidth-gbps`` is the
per-GPU inter-node bandwidth that FSDP's collectives use, a property of the cluster, which presets leave alone.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_gib: float
    peak_tflops: float  # bf16 dense tensor-core peak
    hbm_tbps: float  # HBM bandwidth, TB/s
    overridden: tuple[str, ...] = ()  # the flags that replaced a preset figure, for the plan's header


GPU_PRESETS: dict[str, GPUSpec] = {
    "h100": GPUSpec("h100", 80.0, 989.0, 3.35),
    "h200": GPUSpec("h200", 141.0, 989.0, 4.8),
    "a100-80g": GPUSpec("a100-80g", 80.0, 312.0, 2.0),
    "b200": GPUSpec("b200", 180.0, 2250.0, 8.0),
}
DEFAULT_GPU = "h100"  # the planner assumed an H100's 989 TFLOP/s before it had presets


def resolve_gpu(preset: str | None, memory_gib: float | None = None, peak_tflops: float | None = None,
                hbm_tbps: float | None = None) -> GPUSpec:
    """The preset's figures (``DEFAULT_GPU`` when none is named), each replaced by the explicit value given."""
    base = GPU_PRESETS[preset or DEFAULT_GPU]
    explicit = {"--gpu-memory": memory_gib, "--peak-tflops": peak_tflops, "--hbm-tbps": hbm_tbps}
    return GPUSpec(
        name=base.name,
        memory_gib=base.memory_gib if memory_gib is None else float(memory_gib),
        peak_tflops=base.peak_tflops if peak_tflops is None else float(peak_tflops),
        hbm_tbps=base.hbm_tbps if hbm_tbps is None else float(hbm_tbps),
        overridden=tuple(flag for flag, value in explicit.items() if value is not None),
    )
