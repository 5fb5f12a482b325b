"""The engines: the CPU engine on the real llama.cpp, and the signals' meanings
(runner/engines/)."""
