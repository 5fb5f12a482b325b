"""The embedded CPU engine: llama.cpp in process (llama-cpp-python), SmolLM2-135M by default.

engine.py: the continuous-batching engine; pool.py: the KV pool's books; native.py: the
native library, the CPU and the safe way to load a model; selfcheck.py: the start-up check
in a child process; tokenizer.py: the GGUF's tokenizer and chat template. docs/engines.md.
"""

from .engine import LlamaCppEngine
from .native import DEFAULT_MODEL_FILE, default_model_path

__all__ = ["DEFAULT_MODEL_FILE", "LlamaCppEngine", "default_model_path"]
