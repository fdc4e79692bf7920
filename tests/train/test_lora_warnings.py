"""A CPU LoRA run prints no third-party warning that does not concern it.

peft imports bitsandbytes whenever it is installed. On a CPU with AVX512-BF16, importing bitsandbytes
looks for a fused 4-bit kernel (the `kernels` package) and logs "Failed to load CPU gemm_4bit_forward
from kernels-community" when it is not there: a note about 4-bit layers, which a LoRA run without
``quantize: 4bit`` never has. This machine may lack AVX512-BF16, so the child process reports that the
CPU has it (an import hook patches ``bitsandbytes.functional.has_avx512bf16`` as it is first imported);
the first test checks that this does bring the warning out, so the second cannot pass by accident.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.train.conftest import ROOT, base_overrides, env

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

KERNEL_NOTE = "gemm_4bit_forward"
AVX512_BF16 = """
import importlib.abc, importlib.util, sys

class ReportBF16(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "bitsandbytes.functional":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module
        def exec_module(module):
            load(module)
            module.has_avx512bf16 = lambda: True
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, ReportBF16())
"""


def _child(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", AVX512_BF16 + code, *args], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=300)


def test_on_such_a_cpu_importing_bitsandbytes_logs_the_kernel_note():
    proc = _child("import bitsandbytes")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert KERNEL_NOTE in proc.stderr


def test_a_cpu_lora_run_without_quantize_does_not_print_it(tiny_model_dir, sft_data, tmp_path):
    overrides = base_overrides(tiny_model_dir, sft_data, tmp_path / "run", **{"train.max_steps": 2})
    run = ("from posttrain.cli import main\ncode = main(sys.argv[1:])\n"
           "print('bitsandbytes imported:', 'bitsandbytes.backends.cpu.ops' in sys.modules, file=sys.stderr)\n"
           "sys.exit(code)\n")
    proc = _child(run, "sft", "--config", "sft_lora_tiny", *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LoRA r=16" in proc.stderr and "bitsandbytes imported: True" in proc.stderr  # peft did import it
    assert KERNEL_NOTE not in proc.stderr and "kernels-community" not in proc.stderr, proc.stderr[-3000:]
