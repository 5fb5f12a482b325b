"""The engines: the Engine protocol and its capability protocols (protocol.py), and one
module or package per engine (llama_cpp/, sglang/, replay.py; the simulated one is in
runner/sim/engine).

May import: engines.protocol, chat, their own packages. Never the runner around them.
"""
