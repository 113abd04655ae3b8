"""The code that runs inside an engine's processes and in its fill, one package per engine
(vLLM's: `vllm/`). Each imports torch and its engine; nothing in the daemon or the CLI imports
it (the engine's entry point and `Engine.filler` name it). What the control plane knows of an
engine, without torch, is `engines/`.
"""
