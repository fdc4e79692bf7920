"""GPU utilisation, memory and temperature from NVML, read when Prometheus scrapes.

Kept tiny on purpose: one function that reads every visible device through ``pynvml`` and returns plain
numbers, and a collector that turns them into metric families. Without ``pynvml`` (``pip install
'posttrain[nvml]'``) or without an NVIDIA driver the reader returns no devices and the families carry no
samples: a CPU run exports the names, never made-up values.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuReading:
    index: int
    utilization_ratio: float  # NVML's "percent of time a kernel ran" over the last sample period, as 0..1
    memory_used_bytes: int
    memory_total_bytes: int
    temperature_celsius: float


def read_gpus() -> list[GpuReading]:
    """One reading per GPU NVML sees; ``[]`` when NVML is absent (no pynvml, no driver)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, …
        return []
    try:
        return [_read(pynvml, index) for index in range(pynvml.nvmlDeviceGetCount())]
    finally:
        pynvml.nvmlShutdown()


def _read(pynvml, index: int) -> GpuReading:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return GpuReading(
        index=index,
        utilization_ratio=pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0,
        memory_used_bytes=int(memory.used),
        memory_total_bytes=int(memory.total),
        temperature_celsius=float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
    )


class GpuCollector:
    """A prometheus_client collector: ``posttrain_gpu_*{gpu="<index>"}`` from NVML at each scrape (the GPUs of
    the node rank 0 runs on: the exporter runs there only)."""

    FAMILIES = (
        ("posttrain_gpu_utilization_ratio", "Fraction of the last NVML sample period a kernel ran on the GPU.",
         "utilization_ratio"),
        ("posttrain_gpu_memory_used_bytes", "GPU memory in use (NVML, all processes).", "memory_used_bytes"),
        ("posttrain_gpu_memory_total_bytes", "GPU memory in total (NVML).", "memory_total_bytes"),
        ("posttrain_gpu_temperature_celsius", "GPU core temperature (NVML).", "temperature_celsius"),
    )

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        readings = read_gpus()
        for name, documentation, attribute in self.FAMILIES:
            family = GaugeMetricFamily(name, documentation, labels=["gpu"])
            for reading in readings:
                family.add_metric([str(reading.index)], getattr(reading, attribute))
            yield family
